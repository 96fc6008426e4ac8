"""The shardledger server; it needs the server extra: pip install 'shardledger[server]'."""

from __future__ import annotations

import importlib.util
from typing import Final

INSTALL_HINT: Final = "pip install 'shardledger[server]'"

# Import names of the server extra's packages (pyproject.toml); a job installs only the SDK.
SERVER_MODULES: Final = (
    "cryptography",
    "grpc_health",
    "grpc_reflection",
    "prometheus_client",
    "structlog",
)

# Checked here, once, so a base install fails with what to install rather than with
# whichever module a submodule happens to import first.
_missing = [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]
if _missing:
    raise ImportError(
        f"ledger_server needs {', '.join(_missing)} (not installed): {INSTALL_HINT}",
        name=__name__,
    )
