"""Tests of the shardledger CLI (tools/shardledger_cli), the examples, the benchmarks and the alert rules."""
