"""What is installed: shardledger's version, its contract, and what it runs on."""

from __future__ import annotations

import importlib.metadata
import platform
from typing import Any, Final

CONTRACT: Final = "shardledger.v1"


def versions() -> dict[str, Any]:
    """Returns the installed versions the CLI, the SDK and the ledger run on."""

    def of(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "shardledger": of("shardledger") or "unknown (not installed as a package)",
        "contract": CONTRACT,
        "python": platform.python_version(),
        "grpcio": of("grpcio"),
        "protobuf": of("protobuf"),
        "torch": of("torch"),
    }


def version_line() -> str:
    """Returns the one line `--version` prints."""
    v = versions()
    return f"shardledger {v['shardledger']} (contract {v['contract']}, Python {v['python']})"
