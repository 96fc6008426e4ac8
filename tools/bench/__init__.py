"""Benchmarks, each with its baseline measured in the same run: `python -m tools.bench NAME` (ingest.py lists them)."""
