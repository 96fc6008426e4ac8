"""Audit checks shared by `audit` and `export`: signed heads, checkpoints, proofs, reports.

Everything here judges data it is handed; fetching over gRPC is limited to the
small rpc_* helpers, since LedgerClient has no audit methods yet. The chain
walks themselves live in audit_walk.py.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ledger_server.chain import event_from_row
from ledger_server.merkle import verify_consistency
from ledger_server.signing import (
    InclusionProofBundle,
    TreeHead,
    check_inclusion_bundle,
    load_public_key,
    public_key_id,
    verify_tree_head,
)
from ledger_server.store.base import Store, StoreError
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.errors import LedgerRejected
from shardledger_cli.audit_walk import ChainWalk, walk_server
from shardledger_cli.cli import EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, CommandError
from shardledger_cli.output import iso_us, print_json

__all__ = [
    "Check",
    "Checkpoint",
    "check_proof",
    "checkpoint_checks",
    "grown_head_check",
    "head_problem",
    "key_checks",
    "load_checkpoint",
    "open_database",
    "print_reports",
    "read_json",
    "read_public_key",
    "report_for",
    "rpc_consistency",
    "rpc_public_key",
    "rpc_tree_head",
    "server_checkpoint_checks",
    "signed_head_check",
]

# Times a verify reads the events committed while it read the run before it gives up on
# the listing catching up with the server's signed head.
_CATCH_UP_ROUNDS: Final = 5

Check = tuple[str, bool, str]


# --- checks and reports -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A saved signed head and the public key saved beside it."""

    head: TreeHead
    public_key_pem: str | None


def read_json(path: str) -> Any:
    """Returns the JSON in a file, or raises CommandError (exit 5)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise CommandError(f"{path} is not JSON: {exc}") from None


def load_checkpoint(path: str) -> Checkpoint:
    """Reads a checkpoint file (or a bare tree head JSON)."""
    data = read_json(path)
    try:
        if isinstance(data, dict) and "tree_head" in data:
            pem = data.get("public_key_pem")
            return Checkpoint(TreeHead.from_json(data["tree_head"]), pem)
        return Checkpoint(TreeHead.from_json(data), None)
    except (ValueError, TypeError) as exc:
        raise CommandError(f"{path} is not a checkpoint: {exc}") from None


def open_database(spec: str, *, must_exist: bool = True) -> Store:
    """Opens a database by path or URL (sqlite:///PATH, postgresql://...) for the CLI."""
    from ledger_server.store import open_store, redact_url, sqlite_path
    from ledger_server.store.sqlite import SqliteStore

    path = sqlite_path(spec)
    # SQLite creates a missing file: an auditor's typo must not look like an empty ledger.
    if must_exist and path is not None and not Path(path).is_file():
        raise CommandError(f"no database file at {spec}")
    try:
        if must_exist and path is not None:
            # Never a schema written into an empty or foreign file: refused, left as it was.
            return SqliteStore(path, must_exist=True)
        return open_store(spec)
    except ValueError as exc:
        raise CommandError(str(exc), code=EXIT_USAGE) from None
    except StoreError as exc:
        raise CommandError(f"cannot open {redact_url(spec)}: {exc}") from None


def read_public_key(path: str) -> str:
    """Returns a PEM Ed25519 public key from a file, or raises CommandError (exit 5)."""
    try:
        pem = Path(path).read_text(encoding="ascii")
        load_public_key(pem)
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise CommandError(f"{path}: {exc}") from None
    return pem


def head_problem(head: TreeHead, pem: str, *, run: tuple[str, str], size: int, root: bytes) -> str:
    """Returns why a signed head does not vouch for (run, size, root), or ""."""
    if not verify_tree_head(head, pem):
        return f"the head's signature does not verify under key {public_key_id(pem)}"
    if (head.namespace, head.run_id) != run:
        return f"the head is for {head.namespace}/{head.run_id}, not {run[0]}/{run[1]}"
    if head.tree_size != size:
        return f"the head signs size {head.tree_size}, not {size}"
    if head.root_hex != root.hex():
        return f"the signed root {head.root_hex[:16]} differs from the recomputed {root.hex()[:16]}"
    return ""


def checkpoint_checks(
    saved: Checkpoint, pem: str, walk: ChainWalk, proof: Sequence[bytes] | None = None
) -> list[Check]:
    """Returns the checks that today's log extends a saved head (proof: server's, if online)."""
    head, checks = saved.head, list[Check]()
    if not verify_tree_head(head, pem):
        return [("checkpoint", False, "the saved head's signature does not verify")]
    if (head.namespace, head.run_id) != (walk.namespace, walk.run_id):
        return [("checkpoint", False, f"the saved head is for {head.namespace}/{head.run_id}")]
    if walk.count < head.tree_size:
        return [
            (
                "checkpoint",
                False,
                f"the log has {walk.count} events, fewer than the"
                f" {head.tree_size} the saved head signed: truncated or restored from an"
                " older copy",
            )
        ]
    if walk.tree.root(head.tree_size).hex() != head.root_hex:
        return [
            (
                "checkpoint",
                False,
                f"the first {head.tree_size} events differ from those"
                " the saved head signed: history was rewritten",
            )
        ]
    checks.append(
        (
            "checkpoint",
            True,
            f"extends the saved head of size {head.tree_size}"
            f" signed {iso_us(head.timestamp_ms * 1000)}",
        )
    )
    if proof is not None:
        ok = verify_consistency(
            old_size=head.tree_size,
            new_size=walk.count,
            old_root=bytes.fromhex(head.root_hex),
            new_root=walk.tree.root(),
            proof=proof,
        )
        detail = f"{head.tree_size} -> {walk.count}" if ok else "the server's proof fails"
        checks.append(("consistency_proof", ok, detail))
    return checks


def report_for(walk: ChainWalk, checks: list[Check]) -> dict[str, Any]:
    """Returns one run's verdict as a JSON-ready dict."""
    chain: Check = (
        ("chain", True, f"{walk.count} rows chain to head {walk.head_hash.hex()[:16]}")
        if not walk.problem
        else ("chain", False, f"{walk.where}: {walk.problem}")
    )
    checks = [chain, *checks]
    return {
        "namespace": walk.namespace,
        "run_id": walk.run_id,
        "events": walk.count,
        "ok": all(ok for _, ok, _ in checks),
        "first_bad_sequence": walk.bad_sequence,
        "first_bad": walk.where or None,
        "problem": walk.problem,
        "root_hex": walk.tree.root().hex(),
        "checks": [{"check": n, "ok": ok, "detail": d} for n, ok, d in checks],
    }


def print_reports(reports: list[dict[str, Any]], as_json: bool) -> int:
    """Prints the verdicts; returns 0 when every run is clean."""
    ok = all(r["ok"] for r in reports)
    if as_json:
        print_json({"ok": ok, "runs": reports})
        return EXIT_OK if ok else EXIT_PROBLEMS
    for r in reports:
        verdict = "clean" if r["ok"] else "TAMPERED OR INCONSISTENT"
        # After a break, the count and root cover only the rows before it.
        span = "events" if not r["problem"] else "rows before the break"
        print(
            f"run {r['namespace']}/{r['run_id']}: {r['events']} {span},"
            f" root {r['root_hex'][:16]}: {verdict}"
        )
        for check in r["checks"]:
            print(f"  {'ok  ' if check['ok'] else 'FAIL'}  {check['check']:<18} {check['detail']}")
    return EXIT_OK if ok else EXIT_PROBLEMS


def rpc_tree_head(client: Any, namespace: str, run_id: str, size: int) -> TreeHead:
    """Returns the server's signed head of the run at size (0: now)."""
    request = pb.GetTreeHeadRequest(namespace=namespace, run_id=run_id, tree_size=size)
    response = client.call(lambda t: client.stub.GetTreeHead(request, timeout=t))
    return TreeHead.from_json(json.loads(response.tree_head_json))


def rpc_consistency(
    client: Any, walk: ChainWalk, old_size: int, new_size: int | None = None
) -> list[bytes]:
    """Returns the server's consistency proof from old_size to new_size (default: walked)."""
    request = pb.GetConsistencyProofRequest(
        namespace=walk.namespace,
        run_id=walk.run_id,
        old_size=old_size,
        new_size=walk.count if new_size is None else new_size,
    )
    return list(client.call(lambda t: client.stub.GetConsistencyProof(request, timeout=t)).proof)


def signed_head_check(client: Any, walk: ChainWalk, pem: str) -> Check:
    """Returns the check that the server's current signed head is the walked size and root.

    Events committed after the listing ended are walked first (a few rounds at most);
    a run that still grows faster than it is read passes when the server proves that the
    walked events are the first of its larger signed head, so appends raise no alarm.
    """
    assert walk.namespace is not None
    for round_ in range(_CATCH_UP_ROUNDS + 1):
        try:
            head = rpc_tree_head(client, walk.namespace, walk.run_id, 0)
        except LedgerRejected as exc:
            return "signed_head", False, f"the server refuses to sign ({exc.reason}): {exc}"
        walked = walk.count
        if head.tree_size <= walked or walk.problem or round_ == _CATCH_UP_ROUNDS:
            break
        walk_server(client, walk.run_id, walk.namespace, walk=walk)
        if walk.count == walked:
            break
    if head.tree_size > walk.count and not walk.problem and verify_tree_head(head, pem):
        grown = grown_head_check(client, walk, head)
        if grown is not None:
            return grown
    if head.tree_size != walk.count and verify_tree_head(head, pem):
        return (
            "signed_head",
            False,
            f"the server's current signed head is for {head.tree_size} events, the listing"
            f" gave {walk.count}: rows were removed from or added to the run behind the server",
        )
    run = (walk.namespace, walk.run_id)
    problem = head_problem(head, pem, run=run, size=walk.count, root=walk.tree.root())
    if problem:
        return "signed_head", False, problem
    when = iso_us(head.timestamp_ms * 1000)
    return "signed_head", True, f"size {head.tree_size} signed by key {head.key_id} at {when}"


def grown_head_check(client: Any, walk: ChainWalk, head: TreeHead) -> Check | None:
    """Returns a passing check when the server proves the walk is a prefix of its signed head.

    None when it cannot (no proof, a failing one, or a head for another run): the caller
    then reports the size mismatch.
    """
    if (head.namespace, head.run_id) != (walk.namespace, walk.run_id):
        return None
    try:
        proof = rpc_consistency(client, walk, walk.count, head.tree_size)
    except LedgerRejected:
        return None
    if not verify_consistency(
        old_size=walk.count,
        new_size=head.tree_size,
        old_root=walk.tree.root(),
        new_root=bytes.fromhex(head.root_hex),
        proof=proof,
    ):
        return None
    when = iso_us(head.timestamp_ms * 1000)
    return (
        "signed_head",
        True,
        f"size {head.tree_size} signed by key {head.key_id} at {when}; the run grew while it"
        f" was read, and the server proves the {walk.count} events walked are its first",
    )


def server_checkpoint_checks(
    client: Any, saved: Checkpoint, pem: str, walk: ChainWalk
) -> list[Check]:
    """Returns the checks that the walked log extends a saved head, with the server's proof."""
    checks, proof = list[Check](), None
    if walk.count >= saved.head.tree_size:
        try:
            proof = rpc_consistency(client, walk, saved.head.tree_size)
        except LedgerRejected as exc:
            detail = f"the server refuses to prove ({exc.reason}): {exc}"
            checks.append(("consistency_proof", False, detail))
    return [*checks, *checkpoint_checks(saved, pem, walk, proof)]


def key_checks(pinned: str | None, server_pem: str) -> list[Check]:
    """Returns a failed check when the server's key is not the pinned one."""
    if pinned is None or public_key_id(pinned) == public_key_id(server_pem):
        return []
    detail = (
        f"the server signs with key {public_key_id(server_pem)}, pinned is {public_key_id(pinned)}"
    )
    return [("public_key", False, detail)]


def rpc_public_key(client: Any) -> str:
    """Returns the server's tree-head public key (PEM)."""
    request = pb.GetPublicKeyRequest()
    return str(client.call(lambda t: client.stub.GetPublicKey(request, timeout=t)).public_key_pem)


def check_proof(bundle_data: Any, pem: str) -> tuple[bool, str]:
    """Returns whether a bundle proves its row under the key, with the reason."""
    try:
        bundle = InclusionProofBundle.from_json(bundle_data)
    except (ValueError, TypeError, KeyError) as exc:
        return False, f"not an inclusion proof bundle: {exc}"
    ok, why = check_inclusion_bundle(bundle, pem)
    if not ok:
        return ok, why
    try:
        event, run_sequence, receive_us = event_from_row(bytes.fromhex(bundle.leaf_hex))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return False, f"the proven leaf is not a ledger row ({type(exc).__name__}: {exc})"
    head = bundle.head
    if (event.namespace, event.run_id) != (head.namespace, head.run_id):
        return False, f"the row belongs to {event.namespace}/{event.run_id}, not the signed run"
    if run_sequence != bundle.leaf_index + 1:
        return (
            False,
            f"the row says run_sequence {run_sequence} but sits at leaf {bundle.leaf_index}",
        )
    return True, (
        f"event {event.event_id} ({event.kind} of shard {event.shard_id}, received"
        f" {iso_us(receive_us)}) is {why}"
    )
