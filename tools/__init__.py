"""The shardledger command line, stub generator, benchmarks and fault harnesses."""
