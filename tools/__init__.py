"""The `shardledger` CLI's source (shardledger_cli/, installed as shardledger_cli) and, in folders of their own, the scripts a checkout runs: bench/, gen/, campaign/, alerts/ (tools/README.md)."""
