"""`shardledger exec`: any process as one attempt at a shard (docs/exec.md)."""
