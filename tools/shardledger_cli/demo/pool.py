"""A process pool for the demo that survives its workers being killed.

``multiprocessing.Pool`` loses the task of a worker that dies (and
``ProcessPoolExecutor`` breaks altogether), yet dying is what two of the
injected faults do. So each worker gets its own pipe and one task at a time:
the pool always knows which task a dead worker held, reports it as ``died`` and
forks a replacement.

Workers come from the "forkserver" context with ``shardledger_cli.demo.worker`` (and so
torch) preloaded: torch is imported once for the pool, not per worker or per
shard. A forkserver's children are not the demo's children, which also keeps
the watchdog's ``waitpid`` from reaping them behind multiprocessing's back.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Final

PRELOAD: Final = ["shardledger_cli.demo.worker"]
POLL_S: Final = 0.2
# A last resort: no demo shard takes a minute, and a wedged one must not hang the demo.
TASK_TIMEOUT_S: Final = 120.0


def _entry(conn: Connection, config: dict[str, Any]) -> None:
    # Imported here so that the demo's own process never imports torch for the pool.
    from shardledger_cli.demo.worker import worker_main

    worker_main(conn, config)


@dataclass(slots=True)
class _Slot:
    process: Any  # multiprocessing.context.ForkServerProcess
    conn: Connection
    task: dict[str, Any] | None = None
    began: float = 0.0


@dataclass(slots=True)
class PoolHooks:
    """How the caller steers a batch: what may start now, follow-ups, and a periodic tick."""

    may_start: Callable[[dict[str, Any]], bool] = lambda task: True
    finished: Callable[[dict[str, Any]], Iterable[dict[str, Any]]] = lambda result: ()
    tick: Callable[[], None] = lambda: None


@dataclass(slots=True)
class PoolStats:
    """Counts over the pool's life."""

    started: int = 0
    replaced: int = 0
    idle_deaths: int = 0
    bye: list[dict[str, Any]] = field(default_factory=list)


class WorkerPool:
    """``workers`` forkserver processes running demo tasks; replaces any that die."""

    def __init__(self, workers: int, config: dict[str, Any]) -> None:
        self._ctx = multiprocessing.get_context("forkserver")
        # Only takes effect if this process's forkserver is not running yet.
        self._ctx.set_forkserver_preload(PRELOAD)
        self._config = config
        self.stats = PoolStats()
        self._slots = [self._spawn() for _ in range(workers)]

    def _spawn(self) -> _Slot:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_entry, args=(child, self._config), daemon=True)
        process.start()
        child.close()
        self.stats.started += 1
        return _Slot(process, parent)

    def run(self, tasks: Iterable[dict[str, Any]], hooks: PoolHooks) -> list[dict[str, Any]]:
        """Runs every task (and the follow-ups hooks.finished returns); returns the results."""
        pending = deque(tasks)
        results: list[dict[str, Any]] = []
        while pending or any(slot.task is not None for slot in self._slots):
            self._dispatch(pending, hooks)
            waitables: list[Any] = [s.conn for s in self._slots]
            waitables += [s.process.sentinel for s in self._slots]
            wait(waitables, timeout=POLL_S)
            for index, slot in enumerate(self._slots):
                if slot.task is not None and time.time() - slot.began > TASK_TIMEOUT_S:
                    slot.process.kill()
                for result in self._collect(index, slot):
                    results.append(result)
                    pending.extend(hooks.finished(result))
            hooks.tick()
        return results

    def _dispatch(self, pending: deque[dict[str, Any]], hooks: PoolHooks) -> None:
        for slot in self._slots:
            if slot.task is not None:
                continue
            task = next((t for t in pending if hooks.may_start(t)), None)
            if task is None:
                return
            pending.remove(task)
            slot.task, slot.began = task, time.time()
            slot.conn.send(("task", task))

    def _collect(self, index: int, slot: _Slot) -> list[dict[str, Any]]:
        """Returns the results a worker sent, or a died result when it is gone."""
        out: list[dict[str, Any]] = []
        try:
            while slot.conn.poll():
                kind, payload = slot.conn.recv()
                if kind == "done":
                    out.append(payload)
                    slot.task = None
        except (EOFError, OSError):
            pass  # the worker is gone; its sentinel says so below
        if slot.process.is_alive():
            return out
        if slot.task is not None:
            out.append(self._died(slot))
        else:
            self.stats.idle_deaths += 1
            if self.stats.idle_deaths > 2 * len(self._slots):
                # Workers dying before any task is a broken environment, not an injected fault.
                raise RuntimeError(
                    f"demo workers keep dying at start (exit {slot.process.exitcode})"
                )
        slot.conn.close()
        self._slots[index] = self._spawn()
        self.stats.replaced += 1
        return out

    def _died(self, slot: _Slot) -> dict[str, Any]:
        slot.process.join(1.0)
        task = slot.task
        assert task is not None
        return {
            "key": task["key"],
            "shard_id": task["shard_id"],
            "fault": task.get("fault"),
            "pid": slot.process.pid,
            "outcome": "died",
            "exitcode": slot.process.exitcode,
            "begin": slot.began,
            "end": time.time(),
        }

    def close(self, timeout_s: float = 90.0) -> list[dict[str, Any]]:
        """Stops every worker after it drained its ledger spool; returns their goodbyes."""
        for slot in self._slots:
            with contextlib.suppress(OSError):
                slot.conn.send(("stop", None))
        deadline = time.monotonic() + timeout_s
        for slot in self._slots:
            try:
                if slot.conn.poll(max(deadline - time.monotonic(), 0.0)):
                    kind, payload = slot.conn.recv()
                    if kind == "bye":
                        self.stats.bye.append(payload)
            except (EOFError, OSError):
                pass
            slot.process.join(max(deadline - time.monotonic(), 1.0))
            if slot.process.is_alive():
                slot.process.kill()
                slot.process.join(5.0)
            slot.conn.close()
        return self.stats.bye

    def terminate(self) -> None:
        """Kills every worker at once (on an error or Ctrl-C)."""
        for slot in self._slots:
            if slot.process.is_alive():
                slot.process.kill()
        for slot in self._slots:
            slot.process.join(5.0)
            slot.conn.close()
