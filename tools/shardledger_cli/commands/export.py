"""`shardledger export|import`: a run as a self-verifying JSONL file, and back into a database.

The file holds a header (format, namespace, run id, the server's public key),
one line per event (run_sequence, receive_time_us, the canonical row as a JSON
object, its chain hash) and a trailer with the server's signed tree head for
the whole run. Anyone can check it offline: the rows re-encode to the exact
bytes that were hashed, the hashes chain, the rows' Merkle root is the signed
root, and the signature verifies under the header's (or a pinned) key.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any, Final

from ledger_server.chain import encode_parsed_row
from ledger_server.errors import ConflictError, LedgerError
from ledger_server.importer import ImportRow, import_run
from ledger_server.signing import TreeHead, load_public_key, public_key_id
from ledger_server.store import redact_url
from ledger_server.store.base import WriterBusy
from ledger_server.validation import check_namespace
from shard_client.canonical import legacy_json
from shard_client.errors import LedgerRejected
from shardledger_cli.audit_checks import (
    head_problem,
    read_public_key,
    rpc_public_key,
    rpc_tree_head,
)
from shardledger_cli.audit_walk import ChainWalk, event_row
from shardledger_cli.cli import (
    EXIT_LOCAL,
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_REJECTED,
    EXIT_USAGE,
    CommandError,
    client_from,
    open_ledger,
)
from shardledger_cli.local_ledger import require_signing_key, serve_db_option
from shardledger_cli.output import atomic_output, count_shards, print_json
from shardledger_cli.parsing import add_db_option, add_json_option, examples, json_help

EXPORT_FORMAT: Final = "shardledger-export-v1"
EXPORT_HELP: Final = """
--sqlite OUT.db writes the run instead into an analysis database for
sqlite-utils or Datasette (tables runs, shards, attempts, artifacts,
checkpoints, verdicts, events; docs/analysis.md). Exporting more runs into the
same file adds them (a run exported again is replaced whole).

Examples:
  shardledger export night-01 -o night-01.jsonl        # self-verifying; `import` reads it
  shardledger export night-01 --sqlite nights.db       # tidy tables for your own queries
  shardledger export night-02 --sqlite nights.db --json
  sqlite-utils query nights.db "select provider, avg(silent) from shards group by provider"

exit codes: 0 written; 1 the run's chain or signed head does not check (nothing
written to -o); 3 unreachable; 4 refused (e.g. unknown run); 5 the database
cannot be written (or is not an analysis database: it is left untouched)"""


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the export and import commands."""
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "export",
        epilog=examples(
            "shardledger export night-01 -o night-01.jsonl",
            "shardledger export night-01 | gzip > night-01.jsonl.gz",
            "shardledger export night-01 --db copy/ledger.db -o night-01.jsonl   # no server",
        ),
        parents=[common],
        help="write a run as a self-verifying JSONL file",
        description=__doc__ + EXPORT_HELP,
        formatter_class=raw,
    )
    p.add_argument("run", help="run id")
    target = p.add_mutually_exclusive_group()
    target.add_argument("-o", "--output", metavar="FILE", help="write here (atomically) not stdout")
    target.add_argument(
        "--sqlite",
        metavar="OUT.db",
        help="write the run into a tidy analysis database instead (docs/analysis.md)",
    )
    json_help(
        p,
        single="the export's summary (the events go to -o or stdout; --sqlite: the database's tables)",
    )
    serve_db_option(p, run_export)

    p = sub.add_parser(
        "import",
        epilog=examples(
            "shardledger import night-01.jsonl --db archive.db",
            "shardledger import night-01.jsonl --db postgresql://ledger@db/ledger --public-key ledger.pub.pem",
        ),
        help="check an exported run and write it into a database",
        description=__doc__ + "\nThe whole file is checked before anything is written; then"
        " its rows are\nwritten verbatim in one transaction with the projections rebuilt.\n\n"
        "exit codes: 0 imported; 1 the file is broken (the first bad line is named);\n"
        "2 --namespace differs from the file's; 4 the run (or an event id) exists;\n"
        "5 the file cannot be read",
        formatter_class=raw,
    )
    p.add_argument("file", help="a file written by `shardledger export`")
    add_db_option(p, help="the database to import into: a SQLite path or a postgresql:// URL")
    p.add_argument(
        "--namespace",
        default="",
        help="refuse unless the file's run is in this namespace (rows commit to theirs)",
    )
    p.add_argument("--public-key", metavar="PEM", help="require the head be signed by this key")
    add_json_option(p, single="what was imported")
    p.set_defaults(func=run_import)


# --- export -----------------------------------------------------------------


def _line(value: dict[str, Any]) -> str:
    # Python's json, not RFC 8785: it round-trips every parsed number exactly, so each row
    # re-encodes to its hashed bytes by its own format's rules (chain.encode_parsed_row).
    return legacy_json(value) + "\n"


def run_export(args: argparse.Namespace) -> int:
    """Streams the run to JSONL, checking its chain and signed head on the way."""
    if args.sqlite:
        from shardledger_cli.commands.export_sqlite import run_export_sqlite

        return run_export_sqlite(args)
    if args.db:
        require_signing_key(args.db)
    client = client_from(args)
    pem = rpc_public_key(client)
    walk = ChainWalk(args.run, args.namespace or None)
    with atomic_output(args.output) as out:
        for msg in client.list_events(args.run, namespace=args.namespace, page_size=5000):
            row = event_row(msg)
            if walk.count == 0:
                header = {
                    "type": "header",
                    "format": EXPORT_FORMAT,
                    "namespace": msg.namespace,
                    "run_id": msg.run_id,
                    "public_key_pem": pem,
                    "key_id": public_key_id(pem),
                }
                out.write(_line(header))
            where = f"sequence {msg.sequence}"
            if not walk.add(row, row_hash=msg.row_hash, run_sequence=msg.run_sequence, where=where):
                raise CommandError(
                    f"refusing to export a broken chain: {walk.where}: {walk.problem}",
                    code=EXIT_PROBLEMS,
                )
            body = json.loads(row)
            line = {
                "type": "event",
                "run_sequence": msg.run_sequence,
                "receive_time_us": body["receive_time_us"],
                "row": body,
                "row_hash": bytes(msg.row_hash).hex(),
            }
            out.write(_line(line))
        # A run whose rows were all deleted lists nothing: its namespace is the asked one.
        namespace = walk.namespace or check_namespace(args.namespace)
        try:
            head = rpc_tree_head(client, namespace, walk.run_id, walk.count)
        except LedgerRejected as exc:  # e.g. the stored rows and the run head disagree
            raise CommandError(
                f"refusing to export: the server will not sign the run's head: {exc}",
                code=EXIT_PROBLEMS,
            ) from None
        problem = head_problem(
            head, pem, run=(namespace, walk.run_id), size=walk.count, root=walk.tree.root()
        )
        if problem:
            raise CommandError(f"refusing to export: {problem}", code=EXIT_PROBLEMS)
        out.write(_line({"type": "trailer", "events": walk.count, "tree_head": head.to_json()}))
    where = f" to {args.output}" if args.output else ""
    print(f"exported {walk.count} events of {namespace}/{walk.run_id}{where}", file=sys.stderr)
    return EXIT_OK


# --- reading an export ------------------------------------------------------


class ExportBroken(Exception):
    """The export file fails a check; ``line`` is the first bad line (1-based)."""

    def __init__(self, line: int, problem: str) -> None:
        super().__init__(f"line {line}: {problem}")
        self.line = line
        self.problem = problem


class ExportReader:
    """Reads and checks an export file; each pass re-checks everything it yields."""

    def __init__(self, path: str, *, pinned_pem: str | None = None) -> None:
        self.path = path
        self.pinned_pem = pinned_pem
        self.header: dict[str, Any] | None = None
        self.head: TreeHead | None = None

    @property
    def namespace(self) -> str:
        """Returns the namespace the header names."""
        assert self.header is not None
        return str(self.header["namespace"])

    @property
    def run_id(self) -> str:
        """Returns the run id the header names."""
        assert self.header is not None
        return str(self.header["run_id"])

    def check(self) -> int:
        """Reads the whole file; returns its event count or raises ExportBroken."""
        return sum(1 for _ in self.rows())

    def rows(self) -> Iterator[ImportRow]:
        """Yields the checked rows; raises ExportBroken at the first bad line or at the end."""
        try:
            handle = open(self.path, "rb")  # noqa: SIM115 - closed in finally
        except OSError as exc:
            raise CommandError(f"cannot read {self.path}: {exc.strerror}") from None
        try:
            lines = enumerate(handle, start=1)
            walk = self._header(next(lines, (1, b"")))
            for number, text in lines:
                record = _json(number, text)
                if record.get("type") == "trailer":
                    self._trailer(number, record, walk)
                    if next(lines, None) is not None:
                        raise ExportBroken(number + 1, "data after the trailer")
                    return
                yield self._event(number, record, walk)
            raise ExportBroken(walk.count + 2, "no trailer: the file is truncated")
        finally:
            handle.close()

    def _header(self, numbered: tuple[int, bytes]) -> ChainWalk:
        number, text = numbered
        header = _json(number, text)
        if header.get("type") != "header" or header.get("format") != EXPORT_FORMAT:
            raise ExportBroken(number, f"not a {EXPORT_FORMAT} header")
        try:
            check_namespace(header["namespace"])
            load_public_key(header["public_key_pem"])
            run_id = str(header["run_id"])
            key_id = public_key_id(header["public_key_pem"])
        except (KeyError, TypeError, ValueError, LedgerError) as exc:
            raise ExportBroken(number, f"bad header: {exc}") from None
        if header.get("key_id") != key_id:
            raise ExportBroken(number, f"the header's key_id is not its key's ({key_id})")
        if self.header is not None and header != self.header:
            raise ExportBroken(number, "the header changed while the file was read")
        self.header = header
        return ChainWalk(run_id, header["namespace"])

    def _event(self, number: int, record: dict[str, Any], walk: ChainWalk) -> ImportRow:
        try:
            if record["type"] != "event" or not isinstance(record["row"], dict):
                raise ValueError("not an event line")
            row = encode_parsed_row(record["row"])
            run_sequence = int(record["run_sequence"])
            row_hash = bytes.fromhex(record["row_hash"])
            if record["row"].get("receive_time_us") != record["receive_time_us"]:
                raise ValueError("receive_time_us differs from the row's")
        except (KeyError, TypeError, ValueError) as exc:
            raise ExportBroken(number, f"bad event line: {exc}") from None
        if not walk.add(row, row_hash=row_hash, run_sequence=run_sequence, where=f"line {number}"):
            raise ExportBroken(number, walk.problem)
        return ImportRow(run_sequence, row, row_hash)

    def _trailer(self, number: int, record: dict[str, Any], walk: ChainWalk) -> None:
        try:
            head = TreeHead.from_json(record["tree_head"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ExportBroken(number, f"bad trailer: {exc}") from None
        assert self.header is not None and walk.namespace is not None
        pem = self.pinned_pem or self.header["public_key_pem"]
        if public_key_id(pem) != public_key_id(self.header["public_key_pem"]):
            raise ExportBroken(1, "the header's key is not the pinned public key")
        run = (walk.namespace, walk.run_id)
        problem = head_problem(head, pem, run=run, size=walk.count, root=walk.tree.root())
        if problem or record.get("events") != walk.count:
            raise ExportBroken(number, problem or f"the trailer counts {record.get('events')}")
        self.head = head


def _json(number: int, text: bytes) -> dict[str, Any]:
    try:
        value = json.loads(text.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError is a ValueError too
        raise ExportBroken(number, f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ExportBroken(number, "not a JSON object")
    return value


# --- import -----------------------------------------------------------------


def run_import(args: argparse.Namespace) -> int:
    """Checks the whole export, then writes it into the database in one transaction."""
    pinned = read_public_key(args.public_key) if args.public_key else None
    reader = ExportReader(args.file, pinned_pem=pinned)
    try:
        reader.check()
    except ExportBroken as exc:
        print(f"shardledger: refusing {args.file}: {exc}; nothing was written", file=sys.stderr)
        return EXIT_PROBLEMS
    if args.namespace and args.namespace != reader.namespace:
        raise CommandError(
            f"the file's run is in namespace {reader.namespace}, not {args.namespace}:"
            " its rows and signed head commit to their namespace",
            code=EXIT_USAGE,
        )
    store = open_ledger(args.db, create=True)
    try:
        result = import_run(
            store, namespace=reader.namespace, run_id=reader.run_id, rows=reader.rows()
        )
    except ExportBroken as exc:
        print(f"shardledger: refusing {args.file}: {exc}; nothing was written", file=sys.stderr)
        return EXIT_PROBLEMS
    except ConflictError as exc:
        # Exit 4 as documented ("the run or an event id exists"), in a local command's words.
        raise CommandError(
            f"cannot import {args.file} into {args.db}: {exc} ({exc.reason}); nothing was written",
            code=EXIT_REJECTED,
        ) from None
    except LedgerError as exc:
        print(f"shardledger: refusing {args.file}: {exc}; nothing was written", file=sys.stderr)
        return EXIT_PROBLEMS
    except WriterBusy as exc:
        raise CommandError(
            f"cannot import {args.file}: {exc}; nothing was written", code=EXIT_LOCAL
        ) from None
    finally:
        store.close()
    summary = {
        "namespace": reader.namespace,
        "run_id": reader.run_id,
        "events": result.events,
        "shards": result.shards,
        "head_hash": result.head_hash.hex(),
        "first_sequence": result.first_sequence,
        "last_sequence": result.last_sequence,
    }
    if args.json:
        print_json(summary)
    else:
        print(
            f"imported {result.events} events ({count_shards(result.shards)}) of"
            f" {reader.namespace}/{reader.run_id} into {redact_url(args.db)}"
        )
    return EXIT_OK
