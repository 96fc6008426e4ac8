"""Run and attempt labels (provider, pool, region, image, ...): their rules, flags and env vars.

Shared by the SDK (``labels=`` and ``$SHARDLEDGER_LABEL_<KEY>``), the CLI
(``--label k=v``) and the server's validation, so all three refuse the same
labels with the same words.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Final

__all__ = [
    "LABEL_ENV_PREFIX",
    "MAX_LABELS",
    "MAX_LABEL_VALUE_CHARS",
    "WELL_KNOWN_LABELS",
    "label_problem",
    "labels_from_env",
    "merged_labels",
    "parse_label",
]

# The labels the platform table (docs/metrics.md) compares platforms by; any other key is allowed too.
WELL_KNOWN_LABELS: Final = ("provider", "pool", "region", "image")
LABEL_ENV_PREFIX: Final = "SHARDLEDGER_LABEL_"
MAX_LABELS: Final = 32
MAX_LABEL_VALUE_CHARS: Final = 256
# Lowercase so that $SHARDLEDGER_LABEL_POOL and --label pool=spot name one label.
_KEY: Final = re.compile(r"[a-z][a-z0-9_.-]{0,62}")


def label_problem(labels: Mapping[str, str]) -> str | None:
    """Returns what is wrong with a set of labels, or None when every rule holds."""
    if len(labels) > MAX_LABELS:
        return f"more than {MAX_LABELS} labels"
    for key, value in labels.items():
        if not _KEY.fullmatch(key):
            return f"label key {key!r} must match [a-z][a-z0-9_.-]* (at most 63 characters)"
        if len(value) > MAX_LABEL_VALUE_CHARS:
            return f"label {key!r}: value longer than {MAX_LABEL_VALUE_CHARS} characters"
        if any(ord(c) < 32 for c in value):
            return f"label {key!r}: value holds a control character"
    return None


def parse_label(text: str) -> tuple[str, str]:
    """Returns (key, value) from ``key=value``; raises ValueError with the rule broken."""
    key, sep, value = text.partition("=")
    if not sep:
        raise ValueError(f"not key=value: {text!r}")
    problem = label_problem({key: value})
    if problem:
        raise ValueError(problem)
    return key, value


def labels_from_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Returns the labels $SHARDLEDGER_LABEL_<KEY>=value set (keys lowercased)."""
    env = os.environ if environ is None else environ
    out = {
        name[len(LABEL_ENV_PREFIX) :].lower(): value
        for name, value in env.items()
        if name.startswith(LABEL_ENV_PREFIX) and len(name) > len(LABEL_ENV_PREFIX)
    }
    problem = label_problem(out)
    if problem:
        raise ValueError(f"${LABEL_ENV_PREFIX}*: {problem}")
    return dict(sorted(out.items()))


def merged_labels(*layers: Mapping[str, str] | None) -> dict[str, str]:
    """Returns the layers merged, later ones winning (env, then Ledger, then shard)."""
    out: dict[str, str] = {}
    for layer in layers:
        out.update(layer or {})
    problem = label_problem(out)
    if problem:
        raise ValueError(problem)
    return dict(sorted(out.items()))
