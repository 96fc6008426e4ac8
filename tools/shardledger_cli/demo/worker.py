"""The demo's worker process: a small torch training job wired with shard_client, plus its faults.

The pool preloads this module in its forkserver, so torch is imported once for
the whole pool and each forked worker starts in milliseconds. A worker receives
one task at a time over its pipe, runs it as one shard attempt and reports what
it emitted, so the demo can check that the ledger received exactly that.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch

# determinism.enable() imports torch._inductor.config, which takes seconds on
# torch 2.13; importing it in the forkserver's preload pays that once per pool.
import torch._inductor.config

from shard_client import IncompleteShard, Ledger, Shard, determinism
from shard_client.environment import IMAGE_DIGEST_ENV
from shard_client.signals import DIAG_ENV
from shardledger_cli.demo.faults import (
    EMPTY_OUTPUT,
    HANG,
    LETHAL,
    NAN_WEIGHTS,
    SILENT_MISSING,
    TORN_UPLOAD,
    TRUNCATION,
)

OUTPUTS: Final = ("weights", "metrics")
# Catastrophic backtracking: 2**64 ways to split the a's, explored inside the C
# regex engine, which holds the GIL, so the heartbeat thread never runs again.
_BACKTRACKING: Final = re.compile(r"(a+)+$")


def worker_main(conn: Connection, config: dict[str, Any]) -> None:
    """Runs tasks from the pipe until told to stop, then drains the ledger spool and says bye."""
    torch.set_num_threads(1)  # tiny models: threads only fight over the demo's few cores
    determinism.enable(config["seed"])
    os.environ[DIAG_ENV] = config["diag_dir"]
    ledgers: dict[str, Ledger] = {}
    while True:
        try:
            kind, task = conn.recv()
        except EOFError:
            break
        if kind == "stop":
            break
        ledger = ledgers.get(task["target"])
        if ledger is None:
            ledger = ledgers[task["target"]] = _new_ledger(task, config)
        conn.send(("done", run_task(ledger, task)))
    drained = all(ledger.sender.drain(60.0) for ledger in ledgers.values())
    for ledger in ledgers.values():
        ledger.close()
    conn.send(("bye", {"pid": os.getpid(), "drained": drained}))


def _new_ledger(task: dict[str, Any], config: dict[str, Any]) -> Ledger:
    ledger = Ledger(
        task["target"],
        namespace=task["namespace"],
        spool_dir=config["spool_dir"],
        # Spool after one second without the ledger, and retry the drain every
        # second: the demo's outage is short and should be over quickly.
        unavailable_after_s=1.0,
    )
    ledger.sender.max_backoff_s = 1.0
    return ledger


def run_task(ledger: Ledger, task: dict[str, Any]) -> dict[str, Any]:
    """Runs one shard attempt and returns what happened and which events it emitted."""
    fault = task.get("fault")
    if fault in LETHAL:
        # This worker is about to die; its spool must not take other shards' events with it.
        ledger.sender.drain(30.0)
    os.environ[IMAGE_DIGEST_ENV] = task["image_digest"]
    report: dict[str, Any] = {
        "key": task["key"],
        "shard_id": task["shard_id"],
        "fault": fault,
        "pid": os.getpid(),
        "begin": time.time(),
        "emitted": {"started": 0, "checkpoint": 0, "artifact_committed": 0, "failed": 0},
        "resumed_from": 0,
    }
    shard = ledger.shard(
        task["run_id"],
        task["shard_id"],
        heartbeat_timeout=task["heartbeat_timeout"],
        expected_outputs=OUTPUTS,
        output_dir=task["out_dir"],
        checkpoint_dir=task["ckpt_dir"],
        # One writer per output directory: any temp file found there is a dead writer's.
        orphan_age_s=0.0,
    )
    report["attempt_id"] = shard.attempt_id
    try:
        with shard:
            report["emitted"]["started"] = 1
            _job(shard, task, report)
        report["outcome"] = "committed"
    except IncompleteShard:
        report["outcome"] = "incomplete"
        report["emitted"]["failed"] = 1
    except Exception as exc:  # reported to the demo, which treats it as unexpected
        report["outcome"] = f"error: {type(exc).__name__}: {exc}"
        report["emitted"]["failed"] = int(report["emitted"]["started"])
    report["end"] = time.time()
    return report


def _job(shard: Shard, task: dict[str, Any], report: dict[str, Any]) -> None:
    """Trains a tiny MLP on the shard's input, checkpointing, then commits weights and metrics."""
    params, fault = task["params"], task.get("fault")
    steps, every = int(params["steps"]), int(params["checkpoint_every"])
    data = torch.from_numpy(np.load(task["input"]))
    x, y = data[:, :-1], data[:, -1:]
    torch.manual_seed(int(params["seed"]))
    model = torch.nn.Sequential(
        torch.nn.Linear(x.shape[1], int(params["hidden"])),
        torch.nn.Tanh(),
        torch.nn.Linear(int(params["hidden"]), 1),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=float(params["lr"]))
    loaded = shard.load_latest_checkpoint(model=model, optimizer=optimizer)
    start = report["resumed_from"] = loaded.step if loaded else 0
    for step in range(start + 1, steps + 1):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        if fault == HANG and step == steps:
            _hang()
        if step % every == 0 and step < steps:
            shard.save_checkpoint(step, model=model, optimizer=optimizer)
            report["emitted"]["checkpoint"] += 1
        if step % every == 0 or step == steps:
            shard.progress(step, progress=step / steps, loss=loss.item())
    with torch.no_grad():
        final_loss = float(torch.nn.functional.mse_loss(model(x), y))
    if fault == SILENT_MISSING:
        try:
            _read_label_map(task)
        except OSError:
            return  # the bug: a blanket except, and the job "succeeds" with nothing written
    _commit(shard, task, model, final_loss, report)


def _commit(
    shard: Shard, task: dict[str, Any], model: torch.nn.Module, loss: float, report: dict[str, Any]
) -> None:
    fault, out = task.get("fault"), _artifact_home(shard, task)
    state = model.state_dict()
    if fault == NAN_WEIGHTS:
        state["0.weight"][0, 0] = float("nan")  # one poisoned value is enough to ruin the model
    if fault == TORN_UPLOAD:
        _die_mid_upload(f"{out}/weights.pt", state)
    with shard.atomic_write(
        f"{out}/weights.pt", name="weights", media_type="application/x-torch"
    ) as f:
        if fault == TRUNCATION:
            _die_mid_write(f, state)
        torch.save(state, f)
    report["emitted"]["artifact_committed"] += 1
    metrics = {"shard_id": task["shard_id"], "steps": int(task["params"]["steps"]), "loss": loss}
    with shard.atomic_write(
        f"{out}/metrics.json", name="metrics", media_type="application/json"
    ) as f:
        if fault != EMPTY_OUTPUT:  # the writer that "forgot to flush": zero bytes, committed
            f.write(json.dumps(metrics, sort_keys=True).encode())
    report["emitted"]["artifact_committed"] += 1


def _artifact_home(shard: Shard, task: dict[str, Any]) -> str:
    """Returns where the shard's artifacts go: its output directory, or its S3 prefix.

    In object storage each attempt writes under its own id: the conditional write
    then never refuses a rerun because an earlier attempt's object is still there.
    """
    prefix = task.get("artifact_prefix")
    return f"{prefix}/{shard.attempt_id}" if prefix else str(Path(task["out_dir"]))


def _die_mid_upload(url: str, state: dict[str, torch.Tensor]) -> None:
    """Starts a multipart upload of the weights, sends one part and SIGKILLs this process."""
    from shard_client.storage import store_for

    buffer = io.BytesIO()
    torch.save(state, buffer)
    store = store_for(url)
    bucket, key = url.removeprefix("s3://").split("/", 1)
    upload = store.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    store.fs.call_s3(
        "upload_part",
        Bucket=bucket,
        Key=key,
        UploadId=upload["UploadId"],
        PartNumber=1,
        Body=buffer.getvalue()[: len(buffer.getvalue()) // 2],
    )
    os.kill(os.getpid(), signal.SIGKILL)  # never completed: nothing appears at the key


def _die_mid_write(f: Any, state: dict[str, torch.Tensor]) -> None:
    """Writes half of the weights and SIGKILLs this process, as a preemption mid-write does."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # no rename, so no commit: only a temp file is left


def _read_label_map(task: dict[str, Any]) -> None:
    """Stands in for post-processing that needs a side file this shard does not have."""
    Path(task["input"]).with_suffix(".labels.json").read_text()


def _hang() -> None:
    """Stalls forever holding the GIL, as a pathological regex on one bad record does."""
    _BACKTRACKING.match("a" * 64 + "!")
    raise AssertionError("unreachable: the backtracking match takes longer than the universe")
