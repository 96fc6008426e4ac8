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

from shard_client import determinism
from shard_client.ack import Ack
from shard_client.advice import CheckpointAdvice, checkpoint_advice
from shard_client.atomic import CommitInfo, atomic_write, commit_file
from shard_client.classify import failure_tag
from shard_client.client import LedgerClient
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
from shard_client.fingerprint import Fingerprint, fingerprint
from shard_client.ids import PlanEntry, hash_input, plan_events, shard_id_for
from shard_client.ledger import Ledger
from shard_client.ranks import RankInfo
from shard_client.remote import NotConfirmed, UploadPolicy
from shard_client.sender import Sender
from shard_client.shard import Shard
from shard_client.spooldir import drain_spool_dirs
from shard_client.storage import ObjectExists

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
