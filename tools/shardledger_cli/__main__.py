"""Runs the CLI as `python -m shardledger_cli`."""

from __future__ import annotations

from shardledger_cli.cli import main

raise SystemExit(main())
