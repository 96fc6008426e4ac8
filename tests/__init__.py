"""The test suite: tests/server, tests/sdk, tests/cli and tests/contract (see tests/README.md)."""
