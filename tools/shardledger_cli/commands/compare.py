"""`shardledger compare RUN RUN-ref`: output by output against a reference run; the silent error rate.

Re-compute a sample in a reference environment and compare (docs/metrics.md).
Each output of a shard verified in both runs is compared:

  same fingerprint group   strictly: the same digest, or, for an output given a
                           --tolerance, the numbers within it
  different groups         structure only (both verified): numbers need not match
                           across environments (docs/metrics.md)

The estimated silent error rate is disagreements / strictly compared outputs,
with a Wilson score interval; above --threshold (default 0.5 %, a common
line) the command exits 1.

Tolerances (--tolerance NAME=SPEC, repeatable), on .npy, .npz (every array) and
.json/.jsonl (every number, in order) files:
  max_abs:1e-6                      |a - b| <= 1e-6 everywhere
  rel:1e-5                          |a - b| <= 1e-5 * |b| everywhere
  allclose:rtol=1e-5,atol=1e-8      numpy.allclose
  validator:package.module:func     func(path, reference_path) -> bool
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from shardledger_cli.cli import (
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    CommandError,
    client_from,
)
from shardledger_cli.local_ledger import serve_db_option
from shardledger_cli.output import print_json, print_table
from shardledger_cli.parsing import add_format_option, json_help, output_format

__all__ = ["Tolerance", "parse_tolerance", "register", "run_compare", "wilson_interval"]

EXAMPLES: Final = """
Examples:
  shardledger compare night-01 night-01-ref
  shardledger compare night-01 night-01-ref --tolerance logits=max_abs:1e-5 --json
  shardledger compare night-01 night-01-ref --tolerance emb=allclose:rtol=1e-4,atol=1e-6 \\
      --root /data/night-01 --ref-root /ref/night-01-ref --threshold 0.01

exit codes: 0 the estimated silent error rate is at most --threshold; 1 it is above
(or nothing could be compared); 2 usage (a bad --tolerance); 3 server unreachable;
4 refused (e.g. an unknown run); 5 a file a tolerance needs cannot be read"""


@dataclass(frozen=True, slots=True)
class Tolerance:
    """How two non-deterministic outputs may differ and still agree."""

    kind: str
    max_abs: float = 0.0
    rel: float = 0.0
    rtol: float = 1e-5
    atol: float = 1e-8
    validator: str = ""


def parse_tolerance(text: str) -> tuple[str, Tolerance]:
    """Returns (output name, tolerance) from NAME=SPEC; raises ValueError saying what is wrong."""
    name, sep, spec = text.partition("=")
    kind, _, arg = spec.partition(":")
    if not sep or not name or not arg:
        raise ValueError(f"not NAME=KIND:VALUE: {text!r}")
    try:
        if kind == "max_abs":
            return name, Tolerance(kind, max_abs=_non_negative(arg))
        if kind == "rel":
            return name, Tolerance(kind, rel=_non_negative(arg))
        if kind == "allclose":
            opts = dict(p.split("=", 1) for p in arg.split(","))
            unknown = set(opts) - {"rtol", "atol"}
            if unknown:
                raise ValueError(f"unknown allclose option(s) {', '.join(sorted(unknown))}")
            return name, Tolerance(
                kind,
                rtol=_non_negative(opts.get("rtol", "1e-5")),
                atol=_non_negative(opts.get("atol", "1e-8")),
            )
        if kind == "validator" and ":" in arg:
            return name, Tolerance(kind, validator=arg)
    except ValueError as exc:
        raise ValueError(f"{text!r}: {exc}") from None
    raise ValueError(f"{text!r}: KIND is max_abs, rel, allclose or validator (module:function)")


def _non_negative(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{text} is not a finite number >= 0")
    return value


def wilson_interval(failures: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Returns the Wilson score interval of a proportion (0, 1 when n is 0)."""
    if n == 0:
        return 0.0, 1.0
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    p = failures / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the compare command."""
    p = sub.add_parser(
        "compare",
        parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="compare a run with its reference sample; estimate the silent error rate",
        description=(__doc__ or "").split("\n", 1)[1] + EXAMPLES,
    )
    p.add_argument("run", help="the run that was sampled")
    p.add_argument("reference", help="the reference run (`shardledger sample ... --as`)")
    p.add_argument(
        "--tolerance", action="append", default=[], metavar="NAME=SPEC", help="repeatable"
    )
    p.add_argument("--threshold", type=float, default=0.005, help="default 0.005 (0.5 %%)")
    p.add_argument("--confidence", type=float, default=0.95, help="interval level (default 0.95)")
    p.add_argument("--root", default="", help="where RUN's files are (default: as recorded)")
    p.add_argument("--ref-root", default="", help="where the reference's files are")
    json_help(
        p, single="the comparison: agreement rate, each disagreement, the silent error estimate"
    )
    add_format_option(p)
    serve_db_option(p, run_compare)


def _where(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/")) if root else path


def _numbers(path: str) -> Any:
    try:
        import numpy as np
    except ImportError:
        raise CommandError("a numeric tolerance needs numpy (pip install numpy)") from None
    suffix = Path(path).suffix.lower()
    try:
        if suffix == ".npy":
            return np.load(path, allow_pickle=False).astype(float).ravel()
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as data:
                return np.concatenate([data[k].astype(float).ravel() for k in sorted(data.files)])
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, ValueError) as exc:
        raise CommandError(f"cannot read numbers from {path}: {exc}") from None
    values: list[float] = []
    docs = text.splitlines() if suffix in (".jsonl", ".ndjson") else [text]
    for doc in docs:
        if doc.strip():
            _collect(json.loads(doc), values)
    return np.array(values, dtype=float)


def _collect(value: Any, out: list[float]) -> None:
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        out.append(float(value))
    elif isinstance(value, dict):
        for k in sorted(value):
            _collect(value[k], out)
    elif isinstance(value, list):
        for v in value:
            _collect(v, out)


def _within(tol: Tolerance, path: str, ref: str) -> tuple[bool, dict[str, Any]]:
    """Returns whether two files agree under the tolerance, with the numbers that decided it."""
    if tol.kind == "validator":
        module, _, func = tol.validator.partition(":")
        check: Callable[[str, str], bool] = getattr(importlib.import_module(module), func)
        return bool(check(path, ref)), {"validator": tol.validator}
    import numpy as np

    a, b = _numbers(path), _numbers(ref)
    if a.shape != b.shape:
        return False, {"shape": list(a.shape), "reference_shape": list(b.shape)}
    diff = np.abs(a - b)
    max_abs = float(diff.max()) if diff.size else 0.0
    scale = np.abs(b)
    max_rel = float((diff / np.where(scale > 0, scale, 1.0)).max()) if diff.size else 0.0
    numbers = {"max_abs": max_abs, "max_rel": max_rel, "values": int(a.size)}
    if tol.kind == "max_abs":
        return max_abs <= tol.max_abs, numbers
    if tol.kind == "rel":
        return bool(np.all(diff <= tol.rel * scale)), numbers
    return bool(np.allclose(a, b, rtol=tol.rtol, atol=tol.atol)), numbers


def _views(client: Any, run: str, namespace: str) -> dict[str, dict[str, Any]]:
    return {
        v["shard_id"]: v
        for v in (json.loads(x.view_json) for x in client.shards(run, namespace=namespace))
    }


def run_compare(args: argparse.Namespace) -> int:
    """Compares every output of the shards verified in both runs; exits 1 above the threshold."""
    try:
        tolerances = dict(parse_tolerance(t) for t in args.tolerance)
    except ValueError as exc:
        raise CommandError(f"bad --tolerance: {exc}", EXIT_USAGE) from None
    if not 0 < args.confidence < 1 or not 0 <= args.threshold <= 1:
        raise CommandError("--confidence must lie in (0, 1) and --threshold in [0, 1]", EXIT_USAGE)
    client = client_from(args)
    client.summary(args.reference, namespace=args.namespace)  # an unknown run is refused here
    first = next(iter(client.list_events(args.reference, namespace=args.namespace, page_size=1)))
    sample_of = dict(first.planned.labels).get("sample_of")
    runs, refs = (
        _views(client, args.run, args.namespace),
        _views(client, args.reference, args.namespace),
    )
    agree, structural = 0, 0
    disagreements: list[dict[str, Any]] = []
    not_compared = {"reference_not_verified": 0, "run_not_verified": 0, "not_in_run": 0}
    for sid in sorted(refs):
        ref, mine = refs[sid], runs.get(sid)
        if ref["state"] != "verified":
            not_compared["reference_not_verified"] += 1
            continue
        if mine is None or mine["state"] != "verified":
            not_compared["not_in_run" if mine is None else "run_not_verified"] += 1
            continue
        same_group = bool(mine["fingerprint"]) and mine["fingerprint"] == ref["fingerprint"]
        for name in sorted(ref["artifacts"].keys() & mine["artifacts"].keys()):
            a, b = mine["artifacts"][name], ref["artifacts"][name]
            if not same_group:
                structural += 1
                continue
            if a["blake3"] == b["blake3"]:
                agree += 1
                continue
            entry: dict[str, Any] = {
                "shard_id": sid,
                "output": name,
                "blake3": a["blake3"],
                "reference_blake3": b["blake3"],
            }
            tol = tolerances.get(name)
            if tol is not None:
                ok, numbers = _within(
                    tol, _where(args.root, a["path"]), _where(args.ref_root, b["path"])
                )
                entry |= {"tolerance": tol.kind, **numbers}
                if ok:
                    agree += 1
                    continue
            disagreements.append(entry)
    compared = agree + len(disagreements)
    rate = len(disagreements) / compared if compared else None
    low, high = wilson_interval(len(disagreements), compared, args.confidence)
    report = {
        "run_id": args.run,
        "reference_run_id": args.reference,
        "sample_of": sample_of,
        "compared_outputs": compared,
        "agreed": agree,
        "agreement_rate": agree / compared if compared else None,
        "structure_only": structural,
        "not_compared": not_compared,
        "disagreements": disagreements,
        "silent_error_rate": rate,
        "interval": {"method": "wilson", "confidence": args.confidence, "low": low, "high": high},
        "threshold": args.threshold,
        "above_threshold": rate is None or rate > args.threshold,
    }
    fmt = output_format(args)
    if fmt == "json":
        print_json(report)
    elif fmt == "plain":
        _print_plain(report)
    else:
        _print(report)
    return EXIT_PROBLEMS if report["above_threshold"] else EXIT_OK


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f} %"


def _print(r: dict[str, Any]) -> None:
    print(f"compare {r['run_id']} with reference {r['reference_run_id']}")
    print(
        f"  compared      {r['compared_outputs']} outputs in the same fingerprint group,"
        f" agreement {_pct(r['agreement_rate'])}; {r['structure_only']} across groups"
        " (structure only)"
    )
    skipped = ", ".join(f"{k.replace('_', ' ')} {n}" for k, n in r["not_compared"].items() if n)
    if skipped:
        print(f"  not compared  {skipped}")
    for d in r["disagreements"][:20]:
        numbers = ", ".join(f"{k} {d[k]:.3g}" for k in ("max_abs", "max_rel") if k in d)
        print(
            f"  DISAGREES     {d['shard_id']} {d['output']}: {d['blake3'][:12]} vs"
            f" {d['reference_blake3'][:12]}" + (f" ({numbers})" if numbers else "")
        )
    i = r["interval"]
    print(
        f"  silent errors {_pct(r['silent_error_rate'])} estimated"
        f" ({100 * i['confidence']:.0f} % Wilson interval {_pct(i['low'])} to {_pct(i['high'])});"
        f" threshold {_pct(r['threshold'])}: {'ABOVE' if r['above_threshold'] else 'ok'}"
    )


def _print_plain(r: dict[str, Any]) -> None:
    """Prints a "# comparison" block of FIELD/VALUE rows and a "# disagreements" block."""
    i = r["interval"]
    fields = [
        ("run", r["run_id"]),
        ("reference", r["reference_run_id"]),
        ("compared outputs", r["compared_outputs"]),
        ("agreed", r["agreed"]),
        ("agreement rate", _pct(r["agreement_rate"])),
        ("structure only", r["structure_only"]),
        *((f"not compared: {k.replace('_', ' ')}", n) for k, n in r["not_compared"].items()),
        ("silent error rate", _pct(r["silent_error_rate"])),
        (f"{100 * i['confidence']:.0f} % interval", f"{_pct(i['low'])} to {_pct(i['high'])}"),
        ("threshold", _pct(r["threshold"])),
        ("above threshold", "yes" if r["above_threshold"] else "no"),
    ]
    print_table("comparison", ("field", "value"), fields, plain=True)
    heads = ("shard", "output", "blake3", "reference blake3", "max abs", "max rel")
    rows = [
        [d["shard_id"], d["output"], d["blake3"], d["reference_blake3"]]
        + [f"{d[k]:.3g}" if k in d else "" for k in ("max_abs", "max_rel")]
        for d in r["disagreements"]
    ]
    print_table("disagreements", heads, rows, plain=True)
