"""shardledger's job SDK: record every shard event, commit files atomically, never end in a bare success.

    from shard_client import Ledger

    ledger = Ledger()  # $SHARDLEDGER_SERVER or 127.0.0.1:50551; one per process
    with ledger.shard("night-01", shard_id, expected_outputs=["out"]) as shard:
        with shard.atomic_write(out_path, name="out") as f:
            f.write(result)

Importing this package imports neither torch nor pynvml; the helpers that need
them import them when called.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:  # what mypy and IDEs see; at run time each name loads on first use
    from shard_client import determinism
    from shard_client.ack import Ack
    from shard_client.advice import CheckpointAdvice, checkpoint_advice
    from shard_client.atomic import CommitInfo, atomic_write, commit_file
    from shard_client.classify import failure_tag
    from shard_client.client import LedgerClient
    from shard_client.environment import Fingerprint, fingerprint
    from shard_client.errors import (
        Conflict,
        InvalidArgument,
        LedgerClientError,
        LedgerRejected,
        LedgerUnavailable,
        LifecycleError,
        NotFound,
        Overloaded,
        PermissionDenied,
    )
    from shard_client.failures import DataError, IncompleteShard, InputChanged, Preempted
    from shard_client.ids import PlanEntry, hash_input, plan_events, shard_id_for
    from shard_client.ledger import Ledger
    from shard_client.ranks import RankInfo
    from shard_client.remote import NotConfirmed, UploadPolicy
    from shard_client.sender import Sender
    from shard_client.shard import Shard
    from shard_client.spooldir import drain_spool_dirs
    from shard_client.storage import ObjectExists

# Each public name and the module it lives in. A name is imported on first use (PEP 562),
# so `import shard_client.errors` (the CLI's start, a job's first line) does not pay for
# gRPC, protobuf and the sender before it needs them.
_EXPORTS: Final[dict[str, str]] = {
    "Ack": "shard_client.ack",
    "CheckpointAdvice": "shard_client.advice",
    "CommitInfo": "shard_client.atomic",
    "Conflict": "shard_client.errors",
    "DataError": "shard_client.failures",
    "Fingerprint": "shard_client.environment",
    "IncompleteShard": "shard_client.failures",
    "InputChanged": "shard_client.failures",
    "InvalidArgument": "shard_client.errors",
    "Ledger": "shard_client.ledger",
    "LedgerClient": "shard_client.client",
    "LedgerClientError": "shard_client.errors",
    "LedgerRejected": "shard_client.errors",
    "LedgerUnavailable": "shard_client.errors",
    "LifecycleError": "shard_client.errors",
    "NotConfirmed": "shard_client.remote",
    "NotFound": "shard_client.errors",
    "ObjectExists": "shard_client.storage",
    "Overloaded": "shard_client.errors",
    "PermissionDenied": "shard_client.errors",
    "PlanEntry": "shard_client.ids",
    "Preempted": "shard_client.failures",
    "RankInfo": "shard_client.ranks",
    "Sender": "shard_client.sender",
    "Shard": "shard_client.shard",
    "UploadPolicy": "shard_client.remote",
    "atomic_write": "shard_client.atomic",
    "checkpoint_advice": "shard_client.advice",
    "commit_file": "shard_client.atomic",
    "determinism": "shard_client.determinism",  # a module
    "drain_spool_dirs": "shard_client.spooldir",
    "failure_tag": "shard_client.classify",
    "fingerprint": "shard_client.environment",
    "hash_input": "shard_client.ids",
    "plan_events": "shard_client.ids",
    "shard_id_for": "shard_client.ids",
}

__all__ = [
    "Ack",
    "CheckpointAdvice",
    "CommitInfo",
    "Conflict",
    "DataError",
    "Fingerprint",
    "IncompleteShard",
    "InputChanged",
    "InvalidArgument",
    "Ledger",
    "LedgerClient",
    "LedgerClientError",
    "LedgerRejected",
    "LedgerUnavailable",
    "LifecycleError",
    "NotConfirmed",
    "NotFound",
    "ObjectExists",
    "Overloaded",
    "PermissionDenied",
    "PlanEntry",
    "Preempted",
    "RankInfo",
    "Sender",
    "Shard",
    "UploadPolicy",
    "atomic_write",
    "checkpoint_advice",
    "commit_file",
    "determinism",
    "drain_spool_dirs",
    "failure_tag",
    "fingerprint",
    "hash_input",
    "plan_events",
    "shard_id_for",
]


def __getattr__(name: str) -> Any:
    """Imports a public name's module on first use and keeps the name here."""
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module 'shard_client' has no attribute {name!r}")
    module = importlib.import_module(where)
    value = module if where == f"shard_client.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
