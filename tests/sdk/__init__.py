"""Tests of shard_client, the SDK a job imports: atomic commits, spool, sender, checks, shard life cycle."""
