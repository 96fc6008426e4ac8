"""The `shardledger` command line; `shardledger_cli.cli.main` is its entry point."""
