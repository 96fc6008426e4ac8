"""The demo's batch: plan, run with faults (and a ledger outage), settle, verify, read the ledger."""

from __future__ import annotations

import contextlib
import io
import json
import math
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np

from shard_client.atomic import atomic_write
from shard_client.backoff import SENDER_MAX_DELAY_S
from shard_client.client import LedgerClient
from shard_client.errors import LedgerClientError
from shard_client.spooldir import drain_spool_dirs
from shardledger_cli.cli import CommandError
from shardledger_cli.cli import main as cli_main
from shardledger_cli.commands.plan import send_plan
from shardledger_cli.commands.plan_entries import entries_from_manifest
from shardledger_cli.demo.faults import (
    DELETED_OBJECT,
    DUPLICATE_RETRY,
    ENV_DRIFT,
    LETHAL,
    REPLACED_OBJECT,
    STORAGE_FORMS,
    FaultPlan,
)
from shardledger_cli.demo.infra import LedgerProcess, Watchdog
from shardledger_cli.demo.pool import PoolHooks, WorkerPool
from shardledger_cli.demo.report import Ui

HEARTBEAT_TIMEOUT_S: Final = 3.0
WATCHDOG_GRACE_S: Final = 1.0
OUTAGE_S: Final = 3.0
# After the ledger is back, workers need a moment to reconnect (their senders retry
# at most SENDER_MAX_DELAY_S apart) and drain their spools; until then attempts that ran
# through the outage look silent. The watchdog waits until each of them was heard from
# again (or ended), then a heartbeat timeout more; one that never speaks again (it hung
# meanwhile) is watched after HOLD_AFTER_OUTAGE_S at most.
HOLD_AFTER_OUTAGE_S: Final = SENDER_MAX_DELAY_S + HEARTBEAT_TIMEOUT_S + 30.0
SETTLE_TIMEOUT_S: Final = 60.0
BASE_IMAGE: Final = "sha256:project-x-train-2024.06"
DRIFTED_IMAGE: Final = "sha256:project-x-train-2024.06-hotfix"
OUTPUTS: Final = ("weights", "metrics")
SAMPLES, FEATURES, HIDDEN = 256, 8, 16


@dataclass(slots=True)
class Settings:
    """What the demo was asked to do."""

    shards: int
    workers: int
    steps: int
    seed: int
    namespace: str
    server: str | None
    progress: bool
    storage: str = "local"  # "s3": artifacts go to bucket_url (a local endpoint)
    bucket_url: str = ""


@dataclass(slots=True)
class Outage:
    """Kills the ledger a third of the way through the batch and brings it back OUTAGE_S later."""

    server: LedgerProcess | None
    watchdog: Watchdog
    trigger: int
    on_up: Callable[[], None]
    note: Callable[[str], None] = lambda text: None
    state: str = "waiting"  # waiting -> down -> done; "off" with an external ledger
    down_at: float = 0.0
    restart_at: float = 0.0
    up_at: float = 0.0
    _down_mono: float = 0.0
    # The attempts running when the ledger was killed (shard id -> attempt id).
    running: dict[str, str] | None = field(default_factory=dict)

    def holds(self, task: dict[str, Any]) -> bool:
        """Returns whether a task must wait: a worker that dies now would strand its spool."""
        return self.state == "down" and task.get("fault") in LETHAL

    def tick(self, done: int) -> None:
        """Advances the outage as the batch progresses."""
        if self.state == "waiting" and done >= self.trigger:
            assert self.server is not None
            self.watchdog.hold(math.inf)  # a dead ledger makes every attempt look silent
            try:
                self.running = self.watchdog.running_attempts()
            except LedgerClientError:  # not known: the watchdog then waits its whole deadline
                self.running = None
            self.server.kill()
            self.down_at, self._down_mono, self.state = time.time(), time.monotonic(), "down"
            self.note("running shards (ledger SIGKILLed: jobs spool their events)")
        if self.state == "down" and time.monotonic() - self._down_mono >= OUTAGE_S:
            self.restart()

    def restart(self) -> None:
        """Brings the ledger back on its port (if it is down) and re-arms the watchdog later."""
        if self.state != "down":
            return
        time.sleep(max(OUTAGE_S - (time.monotonic() - self._down_mono), 0.0))
        assert self.server is not None
        self.restart_at = time.time()
        self.server.start()
        self.up_at, self.state = time.time(), "done"
        self.note("running shards (ledger restarted: spools draining)")
        self.on_up()
        if self.running is None:
            self.watchdog.hold(HOLD_AFTER_OUTAGE_S)
            return
        self.watchdog.hold_until_heard(
            self.running,
            since_us=int(self.restart_at * 1_000_000),
            settle_s=HEARTBEAT_TIMEOUT_S,
            deadline_s=HOLD_AFTER_OUTAGE_S,
        )


@dataclass(slots=True)
class Demo:
    """One end-to-end run of the demo in a work directory."""

    settings: Settings
    work: Path
    ui: Ui
    run_id: str = ""
    target: str = ""
    server: LedgerProcess | None = None
    client: LedgerClient | None = None
    watchdog: Watchdog | None = None
    pool: WorkerPool | None = None
    faults: FaultPlan | None = None
    plan_lines: list[str] = field(default_factory=list)
    shard_ids: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    orphan_spool_events: int = 0

    # --- setting up -----------------------------------------------------------

    def start(self) -> None:
        """Starts the ledger (unless external), the watchdog and the worker pool, and plans."""
        s = self.settings
        for name in ("inputs", "out", "ckpt", "diag", "spool"):
            (self.work / name).mkdir(parents=True, exist_ok=True)
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        self.run_id = f"project-x-s{s.seed}-{stamp}"
        with self._timed("start"):
            self.ui.phase("starting the ledger and the workers")
            if s.server is None:
                self.server = LedgerProcess(self.work)
                self.server.start()
                self.target = self.server.target
            else:
                self.target = s.server
            self.client = LedgerClient(self.target, timeout_s=10.0, retry_deadline_s=30.0)
            self.client.wait_ready(10.0)  # an unreachable --server fails here, before any work
            self.watchdog = Watchdog(
                self.target,
                run_id=self.run_id,
                namespace=s.namespace,
                grace_s=WATCHDOG_GRACE_S,
                diag_dir=self.work / "diag",
            )
            self.pool = self._new_pool()
        with self._timed("plan"):
            self.ui.phase("making inputs and planning")
            self._plan()
        extra = STORAGE_FORMS if s.storage == "s3" else ()
        self.faults = FaultPlan.choose(s.shards, s.seed, extra=extra)
        self.watchdog.start()

    def _new_pool(self) -> WorkerPool:
        config = {
            "seed": self.settings.seed,
            "diag_dir": str(self.work / "diag"),
            "spool_dir": str(self.work / "spool"),
        }
        return WorkerPool(self.settings.workers, config)

    def _plan(self) -> None:
        s = self.settings
        params = {
            "steps": s.steps,
            "checkpoint_every": max(1, s.steps // 3),
            "hidden": HIDDEN,
            "lr": 0.05,
            "seed": s.seed,
        }
        manifest = self.work / "plan.jsonl"
        with open(manifest, "w", encoding="utf-8") as fh:
            for index in range(s.shards):
                path = self.work / "inputs" / f"part-{index:05d}.npy"
                np.save(path, _synthetic_input(s.seed, index))
                line = {"input": str(path), "params": params, "expected_outputs": list(OUTPUTS)}
                fh.write(json.dumps(line) + "\n")
        entries = entries_from_manifest(str(manifest), workers=4)
        assert self.client is not None
        outcome = send_plan(self.client, self.run_id, entries, namespace=s.namespace)
        if outcome.conflicts or outcome.refused:
            raise CommandError(
                f"the ledger refused the plan: {outcome.conflicts + outcome.refused}"
            )
        self.plan_lines = [e.plan_line for e in entries]
        self.shard_ids = [e.shard_id for e in entries]

    # --- running --------------------------------------------------------------

    def task(self, plan_line: str, *, key: str, fault: str | None) -> dict[str, Any]:
        """Returns the pool task for one plan line (the same whether planned or resumed)."""
        line = json.loads(plan_line)
        shard_id = line["shard_id"]
        return {
            "key": key,
            "run_id": self.run_id,
            "namespace": self.settings.namespace,
            "target": self.target,
            "shard_id": shard_id,
            "input": line["input"],
            "params": line["params"],
            "fault": fault,
            "out_dir": str(self.work / "out" / shard_id),
            # With --storage s3 the artifacts go to PREFIX/ATTEMPT/NAME (see worker._commit).
            "artifact_prefix": (
                f"{self.settings.bucket_url}/{self.run_id}/{shard_id}"
                if self.settings.bucket_url
                else ""
            ),
            "ckpt_dir": str(self.work / "ckpt" / shard_id),
            "image_digest": DRIFTED_IMAGE if fault == ENV_DRIFT else BASE_IMAGE,
            "heartbeat_timeout": HEARTBEAT_TIMEOUT_S,
        }

    def run_batch(self) -> tuple[list[dict[str, Any]], Outage]:
        """Runs every planned shard with its injected fault; kills the ledger partway through."""
        assert self.faults is not None and self.pool is not None and self.watchdog is not None
        tasks = [
            self.task(line, key=str(i), fault=self.faults.form_of(i))
            for i, line in enumerate(self.plan_lines)
        ]
        outage = Outage(
            self.server,
            self.watchdog,
            trigger=max(1, len(tasks) // 3),
            on_up=self.drain_orphans,
            note=self.ui.describe,
        )
        if self.server is None:
            outage.state = "off"
        done = 0

        def finished(result: dict[str, Any]) -> Iterable[dict[str, Any]]:
            nonlocal done
            done += 1
            self.ui.advance()
            if result["outcome"] == "died" and outage.state != "down":
                self.drain_orphans()  # before the watchdog judges the attempt by its last events
            if result["fault"] == DUPLICATE_RETRY and not result["key"].endswith("#retry"):
                # The launcher "lost" the first attempt's exit status and ran it again.
                line = self.plan_lines[int(result["key"])]
                self.ui.add_total(1)
                return [self.task(line, key=f"{result['key']}#retry", fault=DUPLICATE_RETRY)]
            return ()

        hooks = PoolHooks(
            may_start=lambda task: not outage.holds(task),
            finished=finished,
            tick=lambda: outage.tick(done),
        )
        with self._timed("batch"):
            self.ui.phase("running shards", total=len(tasks))
            results = self.pool.run(tasks, hooks)
            outage.restart()  # in case the batch ended inside the outage
            self.ui.phase("workers draining their spools")
            self.pool.close()
            self.pool = None
        return results, outage

    def rerun(self, lines: list[str]) -> list[dict[str, Any]]:
        """Runs exactly the given plan lines again, without faults, in a fresh pool."""
        with self._timed("rerun"):
            self.ui.phase("re-running the resume list", total=len(lines))
            pool = self.pool = self._new_pool()
            tasks = [self.task(line, key=f"rerun-{i}", fault=None) for i, line in enumerate(lines)]
            results = pool.run(tasks, PoolHooks(finished=self._advance))
            pool.close()
            self.pool = None
        return results

    def _advance(self, result: dict[str, Any]) -> Iterable[dict[str, Any]]:
        self.ui.advance()
        return ()

    # --- reading the ledger ---------------------------------------------------

    def drain_orphans(self) -> None:
        """Sends the spools of dead workers to the ledger, as `shardledger spool drain` does."""
        # A worker killed while the ledger was down leaves events behind; live spools are skipped.
        orphans = drain_spool_dirs(str(self.work / "spool"), target=self.target)
        self.orphan_spool_events += sum(r.sent for r in orphans)

    def settle(self, phase: str) -> dict[str, Any]:
        """Drains dead workers' spools and waits until no attempt is running or stale."""
        with self._timed(f"settle_{phase}"):
            self.ui.phase("waiting for the watchdog to settle silent attempts")
            self.drain_orphans()
            deadline = time.monotonic() + SETTLE_TIMEOUT_S + HOLD_AFTER_OUTAGE_S
            while True:
                summary = self.summary()
                if summary["running"] + summary["stale"] == 0 or time.monotonic() > deadline:
                    return summary
                time.sleep(0.5)

    def tamper_objects(self) -> None:
        """Replaces or deletes, in the bucket, the committed weights of the shards chosen for it."""
        if not self.settings.bucket_url or self.faults is None:
            return
        from shard_client.storage import store_for

        forms = {self.shard_ids[i]: f for i, f in self.faults.by_index.items()}
        for event in self.events():
            if event.WhichOneof("payload") != "artifact_committed":
                continue
            url, form = event.artifact_committed.path, forms.get(event.shard_id)
            if event.artifact_committed.name != "weights" or form not in (
                REPLACED_OBJECT,
                DELETED_OBJECT,
            ):
                continue
            store = store_for(url)
            if form == DELETED_OBJECT:
                store.delete(url)
            else:
                store.fs.pipe_file(url, b"someone else's weights")

    def verify(self, phase: str) -> dict[str, Any]:
        """Runs `shardledger verify RUN --root OUT --json` in-process and returns its report."""
        argv = ["verify", self.run_id, "--root", str(self.work / "out"), "--json"]
        argv += ["--server", self.target, "--namespace", self.settings.namespace]
        with self._timed(f"verify_{phase}"):
            self.ui.phase("verifying committed artifacts")
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = cli_main(argv)
        if code not in (0, 1):
            raise CommandError(f"`shardledger {' '.join(argv)}` failed with exit code {code}")
        report: dict[str, Any] = json.loads(out.getvalue())
        report["exit_code"] = code
        return report

    def summary(self) -> dict[str, Any]:
        """Returns the run summary the server computes (as `shardledger status --json`)."""
        assert self.client is not None
        text = self.client.summary(self.run_id, namespace=self.settings.namespace)
        return dict(json.loads(text))

    def views(self) -> dict[str, dict[str, Any]]:
        """Returns shard id -> shard view (as `shardledger shards --json`)."""
        assert self.client is not None
        views = self.client.shards(self.run_id, namespace=self.settings.namespace)
        return {v.shard_id: json.loads(v.view_json) for v in views}

    def resume_list(self, path: Path) -> list[tuple[str, str, str]]:
        """Writes the resume list's plan lines to path; returns (shard id, reason, line) each."""
        assert self.client is not None
        entries = [
            (e.shard_id, e.reason, e.plan_line)
            for e in self.client.resume(self.run_id, namespace=self.settings.namespace)
        ]
        with atomic_write(path, mode="w") as fh:
            fh.writelines(line + "\n" for _, _, line in entries)
        return entries

    def events(self) -> list[Any]:
        """Returns every event of the run."""
        assert self.client is not None
        ns = self.settings.namespace
        return list(self.client.list_events(self.run_id, namespace=ns, page_size=5000))

    # --- tearing down ---------------------------------------------------------

    def close(self) -> None:
        """Stops whatever is still running: pool, watchdog, ledger."""
        if self.pool is not None:
            self.pool.terminate()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.client is not None:
            self.client.close()
        if self.server is not None:
            self.server.stop()
        self.ui.close()

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        began = time.monotonic()
        try:
            yield
        finally:
            self.timings[name] = round(time.monotonic() - began, 3)


def _synthetic_input(seed: int, index: int) -> np.ndarray[Any, Any]:
    """Returns one shard's seeded regression data: features, then the target column."""
    rng = np.random.default_rng([seed, index])
    x = rng.standard_normal((SAMPLES, FEATURES), dtype=np.float32)
    w = rng.standard_normal((FEATURES, 1), dtype=np.float32)
    return np.hstack([x, np.tanh(x @ w)]).astype(np.float32)
