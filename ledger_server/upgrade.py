"""Brings stored projections up to the current record format by replaying their events.

Shard records are a cache of the fold over the events, so a record written by an
older release is never converted in place: its run is replayed (`rebuild_run`)
and rewritten, and the events, the truth, stay untouched. A server runs this
before it accepts writes; `shardledger db rebuild` does the same on demand.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from ledger_server.rebuild import RebuildRefused, RunRebuild, rebuild_run
from ledger_server.record import RECORD_VERSION, record_version
from ledger_server.store.base import RunRow, Store

log = structlog.get_logger("shardledger.upgrade")

# list_runs pages by recency; a ledger with more runs than this is upgraded in passes.
_RUNS_PER_PASS = 1_000_000


def stale_runs(store: Store) -> list[RunRow]:
    """Returns the runs whose shard records are of an older format (one row read per run)."""
    view = store.read()
    out = []
    for run in view.list_runs(None, _RUNS_PER_PASS):
        first = next(iter(view.iter_shards(run.run_pk)), None)
        if first is not None and first.record and record_version(first.record) < RECORD_VERSION:
            out.append(run)
    return out


def upgrade_projections(
    store: Store, *, on_run: Callable[[RunRebuild], None] = lambda r: None
) -> list[RunRebuild]:
    """Rebuilds every run whose records are older than RECORD_VERSION; returns what it did.

    A run rebuilds in one transaction, so an interrupted upgrade leaves each run
    either as it was or upgraded, and the next start finishes the rest. A run the
    rebuild must refuse (its chain is broken, or another replica moved it meanwhile)
    is left as it is and logged: `shardledger db rebuild` names why.
    """
    done = []
    for run in stale_runs(store):
        try:
            result = rebuild_run(store, run, write=True)
        except RebuildRefused as exc:
            log.warning(
                "projections_upgrade_refused",
                namespace=run.namespace,
                run_id=run.run_id,
                reason=str(exc),
            )
            continue
        on_run(result)
        done.append(result)
    return done
