"""Checkout-only tools, run as `python -m tools.X` and never installed: stub and CLI-doc generators, benchmarks, the fuzz harness. The installed CLI is shardledger_cli/."""
