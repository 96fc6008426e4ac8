"""Writes docs/configuration.md: every flag and every SHARDLEDGER_* variable, from the code.

The flags come from the CLI's own parser; the variables from a scan of the
packages' sources, each described once in ENVIRONMENT below. `--check` fails when
the page is stale, when the code reads a variable ENVIRONMENT does not describe,
or when ENVIRONMENT describes one the code no longer reads.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[2]
DOC: Final = ROOT / "docs" / "configuration.md"
# Where the product reads its environment (the test campaigns' own knobs are not product).
SOURCES: Final = ("shard_client", "ledger_server", "tools/shardledger_cli")
# The shipped job template and service units read a few more of their own.
DEPLOY_FILES: Final = ("examples/slurm_array.sbatch", "deploy/systemd")
VARIABLE: Final = re.compile(r"\bSHARDLEDGER_[A-Z0-9_]*[A-Z0-9]\b")

# name -> (who reads it, what it means). The flag named, where there is one, wins.
ENVIRONMENT: Final[dict[str, tuple[str, str]]] = {
    "SHARDLEDGER_SERVER": (
        "SDK, client commands",
        "the ledger's address (default 127.0.0.1:50551): HOST:PORT, [IPV6]:PORT, unix:PATH,"
        " dns:///HOST:PORT or several HOST:PORT separated by commas; anything else (a URL,"
        " a bare port) is refused before dialing; `--server` wins",
    ),
    "SHARDLEDGER_TOKEN": (
        "SDK, client commands",
        "a bearer token, the secret itself (`shardledger token create`); `--token-file` wins."
        " In a batch job read it from a file: `export SHARDLEDGER_TOKEN=$(cat FILE)`",
    ),
    "SHARDLEDGER_TLS_CA": (
        "SDK, client commands",
        "the CA certificate (PEM file) that signed the server's certificate; `--tls-ca` wins",
    ),
    "SHARDLEDGER_TLS_CERT": (
        "SDK, client commands",
        "a client certificate (PEM file) for mutual TLS; `--tls-cert` wins",
    ),
    "SHARDLEDGER_TLS_KEY": (
        "SDK, client commands",
        "the client certificate's private key (PEM file); `--tls-key` wins",
    ),
    "SHARDLEDGER_DATABASE_URL": (
        "serve, db, token, import",
        "the database a command opens directly: a SQLite path, sqlite:///PATH or"
        " postgresql://USER@HOST/DB (default ./ledger.db); `--db`/`--database-url` wins",
    ),
    "SHARDLEDGER_TLS_SERVER_CERT": ("serve", "the server's certificate chain; `--tls-cert` wins"),
    "SHARDLEDGER_TLS_SERVER_KEY": ("serve", "the server's private key; `--tls-key` wins"),
    "SHARDLEDGER_TLS_CLIENT_CA": (
        "serve",
        "require client certificates signed by this CA (mutual TLS); `--client-ca` wins",
    ),
    "SHARDLEDGER_ARCHIVE_FAILPOINT": (
        "archive, serve",
        "fault tests only: the archive kills its own process (SIGKILL) at this step"
        " (ledger_server.archiver.STEPS); never set it in production",
    ),
    "SHARDLEDGER_SPOOL_DIR": (
        "SDK, spool",
        "where jobs spool events while the ledger is away (default"
        " ~/.cache/shardledger/spool/<target>); put it on node-local disk",
    ),
    "SHARDLEDGER_APPEND_STREAM": (
        "SDK",
        "0 sends every append as a unary AppendEvents call; by default a process's appends"
        " go on one StreamAppendEvents stream (unary when the ledger lacks it)",
    ),
    "SHARDLEDGER_EXIT_WAIT": (
        "SDK",
        "seconds a job waits at exit for the ledger to acknowledge its events (default 10)",
    ),
    "SHARDLEDGER_DIAG_DIR": (
        "SDK, watch",
        "where hang diagnostics bundles go (default $TMPDIR/shardledger-diag)",
    ),
    "SHARDLEDGER_WATCHDOG": ("SDK", "`off` turns the in-job hang watchdog off"),
    "SHARDLEDGER_HANG_TIMEOUT": (
        "SDK",
        "seconds without progress after which a job counts as hung, instead of the"
        " step-time rule; also watches jobs that never call progress()",
    ),
    "SHARDLEDGER_HANG_GRACE": (
        "SDK",
        "seconds added to 10 x the median step time before a hang is declared (default 300)",
    ),
    "SHARDLEDGER_KILL_GRACE": (
        "SDK",
        "seconds between the watchdog's SIGTERM and its SIGKILL (default 30)",
    ),
    "SHARDLEDGER_LOG_FILE": (
        "SDK",
        "the job's log file, whose last lines go into a diagnostics bundle",
    ),
    "SHARDLEDGER_IMAGE_DIGEST": (
        "SDK",
        "the container image digest, recorded in each attempt's environment fingerprint",
    ),
    "SHARDLEDGER_POD_NAME": (
        "SDK",
        "the Kubernetes pod (downward API; wins over POD_NAME), recorded with the attempt",
    ),
    "SHARDLEDGER_POD_NAMESPACE": (
        "SDK",
        "the pod's namespace (downward API; wins over POD_NAMESPACE)",
    ),
    "SHARDLEDGER_NODE_NAME": (
        "SDK",
        "the Kubernetes node (downward API; wins over NODE_NAME)",
    ),
    "SHARDLEDGER_LABEL_POOL": (
        "SDK, plan",
        "any SHARDLEDGER_LABEL_<KEY> labels the run or attempt (here: pool = on-demand, spot,"
        " preemptible); `--label KEY=VALUE` and the SDK's labels= win (docs/metrics.md)",
    ),
    "SHARDLEDGER_LABEL_REGION": (
        "SDK, plan",
        "the region label, as SHARDLEDGER_LABEL_<KEY> above (e.g. eu-1)",
    ),
    "SHARDLEDGER_NOTIFY_URL": (
        "notify",
        "the webhook the morning report is posted to; `--url` wins (docs/alerts.md)",
    ),
    "SHARDLEDGER_RUN": ("exec (set for the child)", "the run id of the attempt (docs/exec.md)"),
    "SHARDLEDGER_SHARD": ("exec (set for the child)", "the shard id of the attempt"),
    "SHARDLEDGER_ATTEMPT": ("exec (set for the child)", "the attempt id"),
    "SHARDLEDGER_INPUT": ("exec (set for the child)", "the shard's input_ref from its plan"),
    "SHARDLEDGER_PLAN_LINE": ("exec (set for the child)", "the shard's plan line (JSON)"),
    "SHARDLEDGER_OUTPUTS": (
        "exec (set for the child)",
        "the declared output names; each has its temp path in SHARDLEDGER_OUTPUT_<NAME>",
    ),
    "SHARDLEDGER_OUTPUT_WEIGHTS": (
        "exec (set for the child)",
        "the temp path of the output named weights (any SHARDLEDGER_OUTPUT_<NAME>): the"
        " child writes there, exec commits it after a clean exit",
    ),
    "SHARDLEDGER_PROGRESS_FILE": (
        "exec (set for the child)",
        "a file the child may rewrite with `step=N progress=F key=value` pairs (docs/exec.md)",
    ),
    "SHARDLEDGER_PROGRESS": (
        "exec (a line, not a variable)",
        "the word a progress line starts with: `SHARDLEDGER_PROGRESS step=N [progress=F]"
        " [key=value ...]` on stdout or stderr",
    ),
}

# Variables only the template and the units read: name -> (file, what it means).
DEPLOYMENT: Final[dict[str, tuple[str, str]]] = {
    "SHARDLEDGER_TOKEN_FILE": (
        "examples/slurm_array.sbatch",
        "a file holding the job's bearer token; the script exports its content as"
        " $SHARDLEDGER_TOKEN (sbatch arguments are visible to every user)",
    ),
    "SHARDLEDGER_VENV": (
        "examples/slurm_array.sbatch",
        "a virtual environment the script activates before it runs the job",
    ),
    "SHARDLEDGER_LISTEN": (
        "deploy/systemd",
        "the address shardledger-serve.service passes to `serve --listen`",
    ),
    "SHARDLEDGER_SERVE_ARGS": (
        "deploy/systemd",
        "more `serve` flags for shardledger-serve.service (e.g. `--auth tokens`)",
    ),
    "SHARDLEDGER_WATCH_ARGS": (
        "deploy/systemd",
        "more `watch` flags for shardledger-watch@.service",
    ),
    "SHARDLEDGER_WATCH_TOKEN_FILE": (
        "deploy/systemd",
        "the token file shardledger-watch@.service passes as `--token-file`",
    ),
}

HEADER: Final = """# Configuration: every flag and environment variable

Generated by `python -m tools.gen.config_docs` from the code (the parser and a scan
of the sources for `SHARDLEDGER_*`); a test fails when this page, the parser or
the sources disagree. A flag always wins over its environment variable. The
commands' own `--help` (and [cli.md](cli.md)) explain each flag with examples;
[concepts.md](concepts.md) defines the words.
"""


def variables_in_code() -> set[str]:
    """Returns every SHARDLEDGER_* name the product's sources mention."""
    found: set[str] = set()
    for source in SOURCES:
        for path in (ROOT / source).rglob("*.py"):
            if "/api/" in path.as_posix():
                continue
            found |= set(VARIABLE.findall(path.read_text(encoding="utf-8")))
    return found


def variables_in_deployment() -> set[str]:
    """Returns every SHARDLEDGER_* name the job template and the service units mention."""
    found: set[str] = set()
    for name in DEPLOY_FILES:
        path = ROOT / name
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            found |= set(VARIABLE.findall(file.read_text(encoding="utf-8")))
    return found


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _flag(action: argparse.Action) -> tuple[str, str, str]:
    names = ", ".join(f"`{o}`" for o in action.option_strings)
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        value = "|".join(str(c) for c in action.choices)
    elif action.nargs == 0:
        value = ""
    else:
        value = str(action.metavar or action.dest.upper())
    default = action.default
    shown = "" if default in (None, False, "", argparse.SUPPRESS) else f"`{default}`"
    return f"{names} {_cell(value)}".strip(), shown, _cell(action.help or "")


def render() -> str:
    """Returns the whole page (built with no SHARDLEDGER_* set, so defaults are the code's)."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SHARDLEDGER_")}
    try:
        from shardledger_cli.cli import build_parser, common_parent
        from shardledger_cli.parsing import subcommand_parsers

        parser = build_parser()
        pages = subcommand_parsers(parser)
    finally:
        os.environ.update(saved)
    parts = [
        HEADER,
        "\n## Environment variables\n\n| variable | read by | meaning |\n|---|---|---|\n",
    ]
    for name, (who, what) in sorted(ENVIRONMENT.items()):
        parts.append(f"| `{name}` | {who} | {_cell(what)} |\n")
    parts.append(
        "\nRead only by the shipped job template and service units (beside the ones above):\n\n"
        "| variable | read by | meaning |\n|---|---|---|\n"
    )
    for name, (who, what) in sorted(DEPLOYMENT.items()):
        parts.append(f"| `{name}` | `{who}` | {_cell(what)} |\n")
    parts.append(
        "\n## Connection options (every command that talks to a ledger)\n\n"
        "| flag | default | meaning |\n|---|---|---|\n"
    )
    for action in common_parent()._actions:
        if action.option_strings and action.option_strings != ["--json"]:
            parts.append("| {} | {} | {} |\n".format(*_flag(action)))
    parts.append(
        "\n`--json` prints one JSON object for a single answer and JSON Lines (one object"
        " per line) for lists and streams; each command's help says which.\n"
    )
    parts.append("\n## Flags by command\n")
    # The connection options are one action object that every client command shares.
    uses = Counter(id(a) for _, sub in pages for a in sub._actions)
    for path, sub in pages[1:]:
        connects = any(uses[id(a)] > 1 and a.dest == "server" for a in sub._actions)

        rows = [
            _flag(a)
            for a in sub._actions
            if a.option_strings
            and a.dest != "help"
            and uses[id(a)] == 1
            and not (connects and a.dest == "json")
        ]
        parts.append(f"\n### `{' '.join(path)}`\n\n")
        if connects:
            parts.append("Takes the connection options and `--json`.\n\n")
        if rows:
            parts.append("| flag | default | meaning |\n|---|---|---|\n")
            parts.extend(f"| {f} | {d} | {h} |\n" for f, d, h in rows)
        elif not connects:
            parts.append("No flags of its own.\n")
    return "".join(parts)


def problems() -> list[str]:
    """Returns what the code and ENVIRONMENT disagree on."""
    used = variables_in_code()
    out = [
        f"{name} is read by the code but not described"
        for name in sorted(used - ENVIRONMENT.keys())
    ]
    out += [
        f"{name} is described but no code reads it" for name in sorted(ENVIRONMENT.keys() - used)
    ]
    deployed = variables_in_deployment() - used
    out += [
        f"{n} is read by a deployment file but not described"
        for n in sorted(deployed - DEPLOYMENT.keys())
    ]
    out += [
        f"{n} is described but no deployment file reads it"
        for n in sorted(DEPLOYMENT.keys() - deployed)
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    """Writes docs/configuration.md, or with --check reports whether it is stale."""
    parser = argparse.ArgumentParser(prog="python -m tools.gen.config_docs", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    wrong = problems()
    for problem in wrong:
        print(f"tools/gen/config_docs.py: {problem}", file=sys.stderr)
    text = render()
    if args.check:
        if wrong or not DOC.exists() or DOC.read_text() != text:
            print(
                "docs/configuration.md is stale: run python -m tools.gen.config_docs",
                file=sys.stderr,
            )
            return 1
        print("docs/configuration.md is fresh")
        return 0
    if wrong:
        return 1
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
