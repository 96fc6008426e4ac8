"""A reference sample: which verified shards to re-compute elsewhere, and how their outputs compare.

Format checks cannot see a result that is well-formed and wrong; only re-computing a
sample in a reference environment can (docs/metrics.md). `stratified_sample` picks
the shards (`shardledger sample`), `compare_outputs` compares each output of the
shards verified in both runs and estimates the silent error rate with a Wilson
score interval (`shardledger compare`). Functions of shard views (the JSON a
ShardView carries); only a --tolerance reads the output files themselves.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

__all__ = [
    "Tolerance",
    "UnreadableNumbers",
    "compare_outputs",
    "parse_tolerance",
    "stratified_sample",
    "verified_groups",
    "wilson_interval",
]


# --- picking the sample ------------------------------------------------------------


def verified_groups(views: Iterable[dict[str, Any]]) -> dict[str, list[str]]:
    """Returns fingerprint group -> the ids of its verified shards ("(none)": no fingerprint)."""
    groups: dict[str, list[str]] = defaultdict(list)
    for v in views:
        if v["state"] == "verified":
            groups[v["fingerprint"] or "(none)"].append(v["shard_id"])
    return dict(groups)


def _rank(seed: str, shard_id: str) -> str:
    return blake3.blake3(f"{seed}\x00{shard_id}".encode()).hexdigest()


def stratified_sample(
    groups: Mapping[str, Sequence[str]], *, fraction: float, minimum: int, seed: str
) -> dict[str, list[str]]:
    """Returns group -> the picked shard ids: max(ceil(fraction·N), minimum) in all, capped at N.

    Each group gets its proportional quota, floors first and the remaining picks to
    the largest remainders (ties by group key); inside a group the shards with the
    smallest seeded hashes are picked.
    """
    total = sum(len(v) for v in groups.values())
    want = min(total, max(math.ceil(fraction * total - 1e-9), minimum))
    quotas = {g: want * len(v) / total for g, v in groups.items()} if total else {}
    counts = {g: math.floor(q) for g, q in quotas.items()}
    left = want - sum(counts.values())
    for g in sorted(quotas, key=lambda g: (-(quotas[g] - counts[g]), g))[:left]:
        counts[g] += 1
    return {
        g: sorted(sorted(ids, key=lambda s: _rank(seed, s))[: counts[g]])
        for g, ids in sorted(groups.items())
    }


# --- comparing with the reference ---------------------------------------------------


class UnreadableNumbers(Exception):
    """A file a numeric tolerance needs cannot be read as numbers (or numpy is missing)."""


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


def _where(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/")) if root else path


def _numbers(path: str) -> Any:
    try:
        import numpy as np
    except ImportError:
        raise UnreadableNumbers("a numeric tolerance needs numpy (pip install numpy)") from None
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
        raise UnreadableNumbers(f"cannot read numbers from {path}: {exc}") from None
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


def files_agree(tol: Tolerance, path: str, ref: str) -> tuple[bool, dict[str, Any]]:
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


def compare_outputs(
    runs: Mapping[str, dict[str, Any]],
    refs: Mapping[str, dict[str, Any]],
    *,
    tolerances: Mapping[str, Tolerance],
    threshold: float,
    confidence: float,
    root: str = "",
    ref_root: str = "",
) -> dict[str, Any]:
    """Returns the comparison of every output of the shards verified in both runs.

    `runs` and `refs` are shard views by shard id. In one fingerprint group an output
    agrees when its digest is the same or, for an output given a tolerance, when its
    numbers are within it (files read under `root` / `ref_root`, else where recorded);
    across groups only the structure is compared. Raises UnreadableNumbers.
    """
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
                ok, numbers = files_agree(tol, _where(root, a["path"]), _where(ref_root, b["path"]))
                entry |= {"tolerance": tol.kind, **numbers}
                if ok:
                    agree += 1
                    continue
            disagreements.append(entry)
    compared = agree + len(disagreements)
    rate = len(disagreements) / compared if compared else None
    low, high = wilson_interval(len(disagreements), compared, confidence)
    return {
        "compared_outputs": compared,
        "agreed": agree,
        "agreement_rate": agree / compared if compared else None,
        "structure_only": structural,
        "not_compared": not_compared,
        "disagreements": disagreements,
        "silent_error_rate": rate,
        "interval": {"method": "wilson", "confidence": confidence, "low": low, "high": high},
        "threshold": threshold,
        "above_threshold": rate is None or rate > threshold,
    }
