"""The SDK's public surface: what `import shard_client` offers, costs and never does."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import shard_client
from shard_client import DataError, Preempted, failure_tag, shard_id_for
from shard_client.ids import PlanEntry, plan_events

REPO = Path(__file__).resolve().parents[2]
ID_RE = r"[A-Za-z0-9][A-Za-z0-9._:@+=/-]*"

PUBLIC_API = [
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


def _python(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_public_api_is_frozen_and_every_name_exists() -> None:
    assert sorted(shard_client.__all__) == PUBLIC_API
    for name in shard_client.__all__:
        assert hasattr(shard_client, name), name


def test_importing_the_sdk_loads_no_torch_pynvml_or_server_code() -> None:
    loaded = _python(
        "import sys, json, shard_client, shard_client.shard, shard_client.sender;"
        "print(json.dumps(sorted(m for m in sys.modules"
        " if m.split('.')[0] in ('torch', 'pynvml', 'numpy', 'ledger_server'))))"
    )
    assert json.loads(loaded) == []


def test_importing_the_sdk_configures_no_logging() -> None:
    state = _python(
        "import logging, json, shard_client;"
        "print(json.dumps([len(logging.getLogger().handlers),"
        " len(logging.getLogger('shard_client').handlers), logging.getLogger().level]))"
    )
    assert json.loads(state) == [0, 0, 30]


def test_shard_id_depends_on_content_and_params_not_key_order() -> None:
    digest = "ab" * 32
    first = shard_id_for(input_blake3=digest, params={"lr": 0.1, "seed": 1})
    assert first == shard_id_for(input_blake3=digest, params={"seed": 1, "lr": 0.1})
    assert first != shard_id_for(input_blake3=digest, params={"lr": 0.2, "seed": 1})
    assert first != shard_id_for(input_blake3="cd" * 32, params={"lr": 0.1, "seed": 1})
    assert first.startswith("s-") and len(first) == 34
    assert re.fullmatch(ID_RE, first)


def test_shard_id_refuses_a_digest_that_is_not_blake3_hex() -> None:
    with pytest.raises(ValueError, match="64 lowercase hex"):
        shard_id_for(input_blake3="ABC", params={})


def test_plan_events_are_identical_when_planned_twice() -> None:
    entry = PlanEntry(
        shard_id="s-1",
        input_ref="/in/a",
        input_bytes=3,
        input_blake3="ab" * 32,
        params={"b": 1, "a": 2},
        expected_outputs=("out",),
        plan_line='{"input":"/in/a"}',
    )
    once, twice = plan_events("run-1", [entry]), plan_events("run-1", [entry])
    assert once[0].SerializeToString() == twice[0].SerializeToString()
    assert once[0].event_id.startswith("plan-")
    assert once[0].planned.params_json == '{"a":2,"b":1}'
    moved = plan_events("run-1", [dataclasses.replace(entry, plan_index=4)])
    assert moved[0].event_id != once[0].event_id


class OutOfMemoryError(RuntimeError):
    """Stands in for torch.cuda.OutOfMemoryError, recognised by its name."""


@pytest.mark.parametrize(
    ("exc", "tag"),
    [
        (MemoryError(), "oom"),
        (OutOfMemoryError("CUDA"), "oom"),
        (RuntimeError("CUDA error: out of memory"), "oom"),
        (KeyboardInterrupt(), "killed"),
        (Preempted("grace over"), "preempted"),
        (DataError("bad row 7"), "data"),
        (json.JSONDecodeError("x", "doc", 0), "data"),
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"), "data"),
        (RuntimeError("NCCL error: unhandled system error"), "nccl"),
        (ValueError("something else"), "unknown"),
    ],
)
def test_failure_tag_classifies_the_usual_failures(exc: BaseException, tag: str) -> None:
    assert failure_tag(exc) == tag


def test_failure_tag_looks_through_chained_causes() -> None:
    try:
        try:
            raise MemoryError
        except MemoryError as inner:
            raise RuntimeError("step failed") from inner
    except RuntimeError as outer:
        assert failure_tag(outer) == "oom"


def test_every_public_name_is_the_object_its_docs_describe_whatever_was_imported_first() -> None:
    # Each submodule first (a job, a plugin or the CLI may have imported any of them, which
    # sets the package's attribute of that name), then each public name, in a new process.
    described = json.loads(
        _python(
            "import importlib, inspect, json, pkgutil, types, shard_client;"
            "[importlib.import_module(m.name) for m in pkgutil.walk_packages("
            "shard_client.__path__, 'shard_client.') if '.api' not in m.name];"
            "kinds = {};"
            "exec('for name in shard_client.__all__:\\n"
            '    value = getattr(importlib.import_module("shard_client"), name)\\n'
            '    kinds[name] = ("module" if isinstance(value, types.ModuleType) else'
            ' "class" if inspect.isclass(value) else'
            ' "callable" if callable(value) else type(value).__name__)\');'
            "print(json.dumps(kinds))"
        )
    )

    assert set(described) == set(PUBLIC_API)
    assert [name for name, kind in described.items() if kind == "module"] == ["determinism"]
    for name, kind in described.items():
        if name == "determinism":
            continue
        # Classes are named in CamelCase, functions in snake_case: each is what it says.
        assert kind == ("class" if name[0].isupper() else "callable"), (name, kind)
    # The name a harness imports directly, in the same fresh way.
    called = _python(
        "import shard_client.environment; from shard_client import fingerprint;"
        "print(type(fingerprint(env={})).__name__)"
    )
    assert called.strip() == "Fingerprint"
