"""`shardledger demo`: a real batch of small torch shards with every failure form injected."""
