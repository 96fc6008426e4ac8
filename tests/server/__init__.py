"""Tests of ledger_server: the server core, its store backends, audit, security, ingest and crash safety."""
