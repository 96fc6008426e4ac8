"""`shardledger audit ...`: check chains and signed Merkle heads, prove events, replay the past."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Final

from ledger_server.errors import LedgerError
from ledger_server.signing import (
    InclusionProofBundle,
    check_inclusion_bundle,
    public_key_id,
    verify_tree_head,
)
from ledger_server.store import redact_url
from ledger_server.validation import check_namespace
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.errors import LedgerRejected
from shardledger_cli.audit_checks import (
    Checkpoint,
    check_proof,
    checkpoint_checks,
    key_checks,
    load_checkpoint,
    open_database,
    print_reports,
    read_json,
    read_public_key,
    report_for,
    rpc_public_key,
    rpc_tree_head,
    server_checkpoint_checks,
    signed_head_check,
)
from shardledger_cli.audit_walk import ChainWalk, walk_server, walk_store
from shardledger_cli.cli import (
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_REJECTED,
    EXIT_USAGE,
    CommandError,
    client_from,
)
from shardledger_cli.output import atomic_output, print_json
from shardledger_cli.parsing import add_db_option, add_json_option, examples, json_help

CHECKPOINT_FORMAT: Final = "shardledger-checkpoint-v1"

DESCRIPTION: Final = """\
Audit a run's ledger: the hash chain, the server's signed Merkle tree heads, and
proofs that a third party checks with the public key alone.

  verify RUN          fetch every event, recompute each row's canonical bytes and the
                      chain, the Merkle root, and check the server's signed head for it
  verify --db PATH    the same from the database file (or URL), no server (RUN optional)
  checkpoint RUN      save the signed head (with the public key) for later --against
  prove RUN --event   an inclusion proof bundle for one event
  check-proof FILE    check a bundle offline with --public-key; no server needed
  public-key          the server's tree-head public key (PEM)
  replay RUN --until  every projection as it stood at a sequence or a time
  diff RUN --from --to  the shards whose state changed between two points

exit codes: 0 clean; 1 tampered, inconsistent or a proof fails; 2 usage;
3 unreachable; 4 refused (e.g. unknown run); 5 local error (unreadable file)
"""


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the audit command group."""
    raw = argparse.RawDescriptionHelpFormatter
    audit = sub.add_parser(
        "audit",
        epilog=examples(
            "shardledger audit checkpoint night-01 -o head.json",
            "shardledger audit verify night-01 --against head.json",
        ),
        help="verify chains and signed heads, prove events, replay the past",
        description=DESCRIPTION,
        formatter_class=raw,
    )
    cmds = audit.add_subparsers(dest="audit_command", metavar="SUBCOMMAND", required=True)

    p = cmds.add_parser(
        "verify",
        epilog=examples(
            "shardledger audit verify night-01",
            "shardledger audit verify night-01 --against head.json --public-key ledger.pub.pem",
            "shardledger audit verify --db ledger.db              # every run, read from the file",
        ),
        parents=[common],
        help="check the chain, root and signed head",
        description=DESCRIPTION,
        formatter_class=raw,
    )
    p.add_argument("run", nargs="?", help="run id (required unless --db)")
    add_db_option(p, required=False, env=False, help="read this database instead of a server")
    p.add_argument("--against", metavar="HEAD.json", help="a saved checkpoint the log must extend")
    p.add_argument(
        "--public-key", metavar="PEM", help="pin this key instead of trusting the server"
    )
    json_help(p, single="the verdict for each run")
    p.set_defaults(func=run_verify)

    p = cmds.add_parser(
        "checkpoint",
        epilog=examples("shardledger audit checkpoint night-01 -o head.json"),
        parents=[common],
        help="save the run's signed tree head",
    )
    p.add_argument("run", help="run id")
    p.add_argument("-o", "--output", metavar="FILE", help="write here (atomically) not stdout")
    json_help(p, single="the signed tree head")
    p.set_defaults(func=run_checkpoint)

    p = cmds.add_parser(
        "prove",
        epilog=examples("shardledger audit prove night-01 --event EVENT_ID -o proof.json"),
        parents=[common],
        help="an inclusion proof bundle for one event",
    )
    p.add_argument("run", help="run id")
    p.add_argument("--event", required=True, metavar="ID", help="the event id to prove")
    p.add_argument("--tree-size", type=int, default=0, help="prove against this size (0: now)")
    p.add_argument("-o", "--output", metavar="FILE", help="write here (atomically) not stdout")
    json_help(p, single="the proof bundle")
    p.set_defaults(func=run_prove)

    p = cmds.add_parser(
        "check-proof",
        epilog=examples("shardledger audit check-proof proof.json --public-key ledger.pub.pem"),
        help="check a proof bundle with the public key alone",
    )
    p.add_argument("bundle", help="proof bundle JSON file (from `audit prove`)")
    p.add_argument("--public-key", required=True, metavar="PEM", help="the server's public key")
    add_json_option(p, single="the verdict")
    p.set_defaults(func=run_check_proof)

    p = cmds.add_parser(
        "public-key",
        epilog=examples("shardledger audit public-key > ledger.pub.pem"),
        parents=[common],
        help="the server's tree-head public key",
    )
    p.add_argument("-o", "--output", metavar="FILE", help="write here (atomically) not stdout")
    json_help(p, single="the public key")
    p.set_defaults(func=run_public_key)

    from shardledger_cli.audit_replay import register_replay

    register_replay(cmds, common)


# --- verify -----------------------------------------------------------------


def run_verify(args: argparse.Namespace) -> int:
    """Verifies one run over gRPC, or every run (or one) of a database."""
    saved = load_checkpoint(args.against) if args.against else None
    pinned = read_public_key(args.public_key) if args.public_key else None
    if saved is not None and pinned is None:
        pinned = saved.public_key_pem
    if args.db:
        if saved is not None and pinned is None:
            raise CommandError(
                f"{args.against} holds no public key: pass --public-key", code=EXIT_USAGE
            )
        return print_reports(verify_offline(args, saved, pinned), args.json)
    if not args.run:
        raise CommandError("RUN is required unless --db is given", code=EXIT_USAGE)
    return print_reports([verify_online(args, saved, pinned)], args.json)


def verify_online(
    args: argparse.Namespace, saved: Checkpoint | None, pinned: str | None
) -> dict[str, Any]:
    """Walks the run over gRPC and checks the server's signed head and saved checkpoint."""
    client = client_from(args)
    namespace = args.namespace or (saved.head.namespace if saved else "")
    try:
        walk = walk_server(client, args.run, namespace)
    except LedgerRejected as exc:
        if not (exc.reason == "RUN_NOT_FOUND" and _saved_for(saved, namespace, args.run)):
            raise
        # The run a saved head signed is gone: a finding (the checkpoint check fails), not a refusal.
        walk = ChainWalk(args.run, namespace)
    if walk.problem:
        return report_for(walk, [])
    if walk.namespace is None:
        # An empty listing names no namespace, yet the head and checkpoint checks still run:
        # a run exists only with rows, so an empty one is a finding for them to report.
        walk.namespace = _namespace(namespace)
    server_pem = rpc_public_key(client)
    pem = pinned or server_pem
    checks = [*key_checks(pinned, server_pem), signed_head_check(client, walk, pem)]
    if saved is not None:
        checks.extend(server_checkpoint_checks(client, saved, pem, walk))
    return report_for(walk, checks)


def verify_offline(
    args: argparse.Namespace, saved: Checkpoint | None, pinned: str | None
) -> list[dict[str, Any]]:
    """Walks the runs of a database (one run, or all of them) and any saved checkpoint."""
    run_id = args.run or (saved.head.run_id if saved else None)
    namespace = args.namespace or (saved.head.namespace if saved else None)
    store = open_database(args.db)
    try:
        view = store.read()
        runs = [r for r in view.list_runs(namespace, 1 << 30) if run_id in (None, r.run_id)]
        if run_id is not None and not runs:
            if saved is None or pinned is None or not _saved_for(saved, namespace, run_id):
                raise CommandError(
                    f"run {run_id} is not in {redact_url(args.db)}", code=EXIT_REJECTED
                )
            # The run a saved head signed is gone: a finding (the checkpoint check fails).
            walk = ChainWalk(run_id, saved.head.namespace)
            return [report_for(walk, checkpoint_checks(saved, pinned, walk))]
        reports = []
        for run in sorted(runs, key=lambda r: r.run_pk):
            chain, tree = walk_store(view, run)
            walk = ChainWalk(run.run_id, run.namespace, tree, head_hash=run.head_hash)
            if not chain["ok"]:
                seq = chain["first_bad_sequence"]
                walk.fail(f"sequence {seq}" if seq else "run head", chain["problem"], seq)
            checks = []
            if saved is not None and pinned is not None and not walk.problem:
                checks = checkpoint_checks(saved, pinned, walk)
            reports.append(report_for(walk, checks))
        return reports
    finally:
        store.close()


def _saved_for(saved: Checkpoint | None, namespace: str | None, run_id: str) -> bool:
    """Returns whether the saved head is for this run (of this namespace, when one is named)."""
    if saved is None:
        return False
    return saved.head.run_id == run_id and namespace in (None, "", saved.head.namespace)


def _namespace(value: str) -> str:
    """Returns the namespace the CLI means (empty: the default), or raises a usage error."""
    try:
        return check_namespace(value)
    except LedgerError as exc:
        raise CommandError(f"--namespace {value!r}: {exc}", code=EXIT_USAGE) from None


# --- checkpoint, prove, check-proof, public-key -----------------------------


def run_checkpoint(args: argparse.Namespace) -> int:
    """Saves the run's current signed head with the public key beside it."""
    client = client_from(args)
    head = rpc_tree_head(client, args.namespace, args.run, 0)
    pem = rpc_public_key(client)
    if not verify_tree_head(head, pem):
        print("shardledger: the server's head does not verify under its own key", file=sys.stderr)
        return EXIT_PROBLEMS
    doc = {"format": CHECKPOINT_FORMAT, "tree_head": head.to_json(), "public_key_pem": pem}
    with atomic_output(args.output) as out:
        out.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    print(
        f"checkpoint: {head.namespace}/{head.run_id} size {head.tree_size} root"
        f" {head.root_hex[:16]} key {head.key_id}",
        file=sys.stderr,
    )
    return EXIT_OK


def run_prove(args: argparse.Namespace) -> int:
    """Writes the inclusion proof bundle of one event, checked first with the server's key."""
    client = client_from(args)
    request = pb.GetInclusionProofRequest(
        namespace=args.namespace, run_id=args.run, event_id=args.event, tree_size=args.tree_size
    )
    response = client.call(lambda t: client.stub.GetInclusionProof(request, timeout=t))
    bundle = InclusionProofBundle.from_json(json.loads(response.proof_bundle_json))
    ok, why = check_inclusion_bundle(bundle, rpc_public_key(client))
    if not ok:
        print(f"shardledger: the server's proof does not check: {why}", file=sys.stderr)
        return EXIT_PROBLEMS
    with atomic_output(args.output) as out:
        out.write(json.dumps(bundle.to_json(), indent=2, sort_keys=True) + "\n")
    print(f"proof: {why}", file=sys.stderr)
    return EXIT_OK


def run_check_proof(args: argparse.Namespace) -> int:
    """Checks a proof bundle with the public key alone; no server is contacted."""
    ok, why = check_proof(read_json(args.bundle), read_public_key(args.public_key))
    if args.json:
        print_json({"ok": ok, "detail": why})
    else:
        print(f"{'proof ok' if ok else 'PROOF FAILS'}: {why}")
    return EXIT_OK if ok else EXIT_PROBLEMS


def run_public_key(args: argparse.Namespace) -> int:
    """Writes the server's public key (PEM, or with --json an object with its key id)."""
    pem = rpc_public_key(client_from(args))
    key_id = public_key_id(pem)
    with atomic_output(args.output) as out:
        if args.json:
            doc = {"key_id": key_id, "public_key_pem": pem}
            out.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        else:
            out.write(pem)
    if not args.json:
        print(f"key id {key_id}", file=sys.stderr)
    return EXIT_OK
