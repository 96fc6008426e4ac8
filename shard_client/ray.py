"""Shards on Ray: a task per shard, and Ray Data batches that are shards (docs/ray.md).

A task per shard: wrap the function that does the work, then make it remote as
you always do. Each call runs inside ``ledger.shard(run, shard_id, input=line)``;
each Ray retry (a dead worker, or an exception with ``retry_exceptions``) is a
new attempt, and the ledger keeps the one that commits and names the others::

    @ray.remote(max_retries=3, retry_exceptions=True)
    @shard_task("night-01", expected_outputs=["counts"])
    def count(shard: Shard, line: dict) -> str:
        with shard.atomic_write(f"out/{line['shard_id']}.json", name="counts") as f:
            f.write(...)

    ray.get([count.remote(line) for line in plan_lines])

Ray Data: a batch of rows is a shard. `batch_manifest` groups the rows (each
with an id) into batches and writes the manifest that ``shardledger plan``
takes; the plan lines it stores carry each batch's rows and ids, so the
pipeline reads the plan (tonight) or the resume list (tomorrow) and
`ShardBatches` runs your function on each line's batch, commits its results as
JSON Lines keyed by id, and checks that they hold exactly the batch's ids::

    ds = ray.data.read_json("plan-lines.jsonl")        # or the resume list
    ds.map_batches(ShardBatches, fn_constructor_args=(Model,),
                   fn_constructor_kwargs={"run_id": "night-01", "output_dir": "out"},
                   batch_size=1, concurrency=4)

One `Ledger` per worker process (`worker_ledger`), shared by every shard the
process runs: an actor runs many. ray is imported by the caller, never here.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, TypeVar, Unpack

import blake3

from shard_client.canonical import canonical_json
from shard_client.keyed import KeyedMismatch, check_keyed_ids
from shard_client.ledger import Ledger
from shard_client.options import ShardOptionKwargs
from shard_client.scheduler import ray_identity

__all__ = [
    "BATCH_INPUT_PREFIX",
    "ShardAlreadyVerified",
    "ShardBatches",
    "batch_manifest",
    "plan_line_of",
    "shard_task",
    "verified_artifacts",
    "worker_ledger",
]

R = TypeVar("R")

# A batch's input names its rows, not a file: `plan` takes the digest the manifest gives.
BATCH_INPUT_PREFIX: Final = "rows:"

_LEDGERS: dict[tuple[str | None, str], Ledger] = {}
_LEDGERS_LOCK = threading.Lock()


def worker_ledger(target: str | None = None, *, namespace: str = "") -> Ledger:
    """Returns this process's Ledger for ``target`` (created once; $SHARDLEDGER_SERVER by default).

    A Ray worker process runs many tasks, and an actor many batches: they share one
    Ledger, its sender and its spool, which the process closes at exit.
    """
    key = (target, namespace)
    with _LEDGERS_LOCK:
        ledger = _LEDGERS.get(key)
        if ledger is None:
            ledger = _LEDGERS[key] = Ledger(target, namespace=namespace)
        return ledger


def plan_line_of(line: str | Mapping[str, Any]) -> dict[str, Any]:
    """Returns a plan line as a dict: from its JSON text, a dict, or a row Ray Data read."""
    if isinstance(line, str):
        value = json.loads(line)
    else:
        value = {str(k): _plain(v) for k, v in line.items()}
    if not isinstance(value, dict) or not isinstance(value.get("shard_id"), str):
        raise ValueError("a plan line is a JSON object with a string shard_id")
    return value


def shard_task(
    run_id: str,
    *,
    server: str | None = None,
    namespace: str = "",
    check_input: bool = True,
    committed_result: Callable[[dict[str, Any], dict[str, str]], Any] | None = None,
    **options: Unpack[ShardOptionKwargs],
) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Returns a decorator that runs ``fn(shard, line, *args)`` as one attempt at the line's shard.

    The wrapped function takes one plan line (JSON text or a dict, as `plan --dry-run`
    and `resume --format jsonl` write them) and ``fn``'s other arguments; apply
    ``@ray.remote(...)`` over it. With
    ``check_input`` the line is the shard's ``input=`` (docs/concepts.md, "Input
    identity"). ``options`` are `Ledger.shard`'s (``expected_outputs``,
    ``heartbeat_timeout``, ...). What ``fn`` returns is the task's result.

    A Ray re-execution (task attempt 1 and up: a retry, or lineage reconstruction of
    a lost result) of a shard the ledger already verified does not run ``fn``: it
    opens no attempt and rewrites nothing, so the verified artifact stays the one
    verified. It returns ``committed_result(line, artifacts)`` (``artifacts``: output
    name -> the verified path) where you read the result back, or, without it,
    raises `ShardAlreadyVerified` (docs/ray.md, "Failure semantics").
    """

    def decorate(fn: Callable[..., R]) -> Callable[..., R]:
        @functools.wraps(fn)
        def run(line: str | Mapping[str, Any], *args: Any, **kwargs: Any) -> R:
            plan_line = plan_line_of(line)
            ledger = worker_ledger(server, namespace=namespace)
            if _ray_attempt() > 0:
                artifacts = verified_artifacts(ledger, run_id, plan_line["shard_id"], namespace)
                if artifacts is not None:
                    reused: R = _reuse(run_id, plan_line, artifacts, committed_result)
                    return reused
            given: ShardOptionKwargs = {**options}
            if check_input and "input" not in given:
                given["input"] = plan_line
            with ledger.shard(run_id, plan_line["shard_id"], **given) as shard:
                return fn(shard, plan_line, *args, **kwargs)

        # Ray checks a call's arguments against the signature, which __wrapped__ would make
        # fn's (shard, line, ...) instead of this function's (line, ...).
        del run.__wrapped__
        return run

    return decorate


class ShardAlreadyVerified(RuntimeError):
    """Ray ran a task again whose shard the ledger verified, and no ``committed_result`` says
    what the task returns then: its result is lost to Ray, its artifact is untouched."""


def verified_artifacts(
    ledger: Ledger, run_id: str, shard_id: str, namespace: str = ""
) -> dict[str, str] | None:
    """Returns the shard's verified outputs (name -> path), or None if it is not verified."""
    for view in ledger.client.shards(run_id, namespace=namespace, state="verified"):
        if view.shard_id == shard_id:
            artifacts = json.loads(view.view_json).get("artifacts") or {}
            return {str(name): str(held["path"]) for name, held in artifacts.items()}
    return None


def _reuse(
    run_id: str,
    line: dict[str, Any],
    artifacts: dict[str, str],
    committed_result: Callable[[dict[str, Any], dict[str, str]], Any] | None,
) -> Any:
    """Returns the verified shard's result without running it again, or raises."""
    where = f"{run_id}/{line['shard_id']}"
    if committed_result is None:
        raise ShardAlreadyVerified(
            f"{where} is verified: Ray ran its task again (a retry or lineage reconstruction);"
            " nothing was run or rewritten. Pass shard_task(..., committed_result=) to return"
            " the result from the committed outputs"
        )
    print(
        f"shardledger: {where} is verified: Ray attempt {_ray_attempt()} returns the"
        " committed result; nothing was run or rewritten",
        file=sys.stderr,
        flush=True,
    )
    return committed_result(line, artifacts)


def _ray_attempt() -> int:
    """Returns the running Ray task's attempt number (0 outside a Ray task)."""
    identity = ray_identity()
    return int(identity.task_attempt or 0) if identity is not None else 0


def batch_manifest(
    rows: Iterable[Mapping[str, Any]],
    *,
    batch_size: int,
    id_column: str = "id",
    output: str = "results",
    params: Mapping[str, Any] | None = None,
) -> Iterator[dict[str, Any]]:
    """Yields one manifest line per batch of ``batch_size`` rows, in the rows' order.

    Each line carries its rows, the batch's digest (blake3 of their canonical JSON),
    and params that declare ``output`` keyed by ``id_column`` with the batch's ids,
    so `verify` checks the committed results hold exactly those ids. The shard id
    `plan` derives from the digest and the params: the same rows, the same shard.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    batch: list[dict[str, Any]] = []
    for row in rows:
        batch.append({str(k): _plain(v) for k, v in row.items()})
        if len(batch) == batch_size:
            yield _manifest_line(batch, id_column, output, params or {})
            batch = []
    if batch:
        yield _manifest_line(batch, id_column, output, params or {})


def _manifest_line(
    rows: list[dict[str, Any]], id_column: str, output: str, params: Mapping[str, Any]
) -> dict[str, Any]:
    ids = []
    for row in rows:
        value = row.get(id_column)
        if not isinstance(value, str | int) or isinstance(value, bool):
            raise ValueError(f"row {row!r} has no string or integer {id_column!r}")
        ids.append(str(value))
    text = canonical_json({"rows": rows}).encode()
    return {
        "input": f"{BATCH_INPUT_PREFIX}{ids[0]}..{ids[-1]}",
        "input_bytes": len(text),
        "input_blake3": blake3.blake3(text).hexdigest(),
        "params": {**params, "keyed_outputs": {output: id_column}, "input_ids": ids},
        "expected_outputs": [output],
        "rows": rows,
    }


class ShardBatches:
    """A Ray Data ``map_batches`` class: each plan line in a batch is one shard's batch of rows.

    ``work`` is your batch function (a numpy-format batch in, one out) or a class that
    makes one, instantiated once per actor (load the model there). For each plan
    line, `ShardBatches` rebuilds the line's rows as a numpy batch, calls ``work``
    inside ``ledger.shard(run_id, shard_id, output_dir=...)``, checks the results hold
    exactly the batch's ids (else failed(data)), commits them as
    ``output_dir/<shard_id>.jsonl`` (the plan's output name, keyed by its id column)
    and returns them. ``output_dir`` is required; the other ``options`` are
    `Ledger.shard`'s.

    A shard that fails is on the ledger (failed, with its tag) and in the resume list;
    with ``on_failure="skip"`` (the default) its rows are left out of the returned
    batch and the pipeline goes on, with ``"raise"`` the exception reaches Ray Data,
    which fails the dataset unless ``DataContext.max_errored_blocks`` allows it.
    """

    def __init__(
        self,
        work: Callable[..., Any],
        *,
        run_id: str,
        server: str | None = None,
        namespace: str = "",
        work_args: Sequence[Any] = (),
        on_failure: str = "skip",
        **options: Unpack[ShardOptionKwargs],
    ) -> None:
        output_dir = options.get("output_dir")
        if output_dir is None:
            raise ValueError("ShardBatches needs output_dir=, where each shard's results go")
        if on_failure not in ("skip", "raise"):
            raise ValueError('on_failure must be "skip" or "raise"')
        self.work: Callable[[dict[str, Any]], Mapping[str, Any]] = (
            work(*work_args) if isinstance(work, type) else work
        )
        self.run_id, self.output_dir, self.on_failure = run_id, os.fspath(output_dir), on_failure
        self.ledger = worker_ledger(server, namespace=namespace)
        self.options = options

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """Runs every plan line of the batch as one shard; returns their results, concatenated."""
        rows: list[dict[str, Any]] = []
        for line in _records(batch):
            try:
                rows += self.run_line(line)
            except Exception:
                # The shard context recorded failed(tag) before the exception left it.
                if self.on_failure == "raise":
                    raise
        return _columns(rows)

    def run_line(self, line: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Runs one plan line's batch as one attempt at its shard; returns the result rows."""
        plan_line = plan_line_of(line)
        params = plan_line.get("params") or {}
        keyed = params.get("keyed_outputs") or {}
        if len(keyed) != 1 or not isinstance(plan_line.get("rows"), list):
            raise ValueError(
                f"plan line of {plan_line['shard_id']}: not a batch_manifest line"
                " (rows, and one keyed output in params)"
            )
        ((output, id_column),) = keyed.items()
        ids = [str(i) for i in params.get("input_ids") or []]
        target = os.path.join(self.output_dir, f"{plan_line['shard_id']}.jsonl")
        options: ShardOptionKwargs = {"expected_outputs": [output], **self.options}
        with self.ledger.shard(self.run_id, plan_line["shard_id"], **options) as shard:
            rows = _records(self.work(_columns(plan_line["rows"])))
            report = check_keyed_ids((str(r.get(id_column)) for r in rows), ids)
            if not report.ok:
                raise KeyedMismatch(report)
            with shard.atomic_write(target, name=output, mode="w") as f:
                f.writelines(canonical_json(r) + "\n" for r in rows)
        return rows


def _plain(value: Any) -> Any:
    """Returns a numpy or Arrow value as plain JSON-able Python (lists, dicts, scalars)."""
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):
        value = value.tolist()  # numpy arrays and scalars
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _records(batch: Any) -> list[dict[str, Any]]:
    """Returns a batch (dict of columns, pandas or Arrow table) as a list of row dicts."""
    if hasattr(batch, "to_pylist"):  # pyarrow.Table
        return [dict(r) for r in batch.to_pylist()]
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas.DataFrame
        return [_plain(dict(r)) for r in batch.to_dict("records")]
    columns = {str(k): _plain(v) for k, v in batch.items()}
    lengths = {len(v) for v in columns.values()}
    if len(lengths) > 1:
        raise ValueError(f"batch columns differ in length: {sorted(lengths)}")
    n = lengths.pop() if lengths else 0
    return [{k: v[i] for k, v in columns.items()} for i in range(n)]


def _columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Returns rows as a numpy-format batch (one array per column)."""
    import numpy as np  # Ray Data's own dependency; only batches need it

    names: list[str] = []
    for row in rows:
        names.extend(k for k in row if k not in names)
    out: dict[str, Any] = {}
    for name in names:
        values = [row.get(name) for row in rows]
        try:
            out[name] = np.asarray(values)
        except ValueError:  # ragged nested values
            out[name] = np.empty(len(values), dtype=object)
            out[name][:] = values
        if out[name].ndim > 1:  # rows of lists: keep one list per row
            column = np.empty(len(values), dtype=object)
            column[:] = values
            out[name] = column
    return out
