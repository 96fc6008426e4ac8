"""`python -m tools.bench NAME`: the entry point of every benchmark (tools/bench/ingest.py)."""

from tools.bench.ingest import main

raise SystemExit(main())
