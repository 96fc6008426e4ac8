"""Which shard `shardledger exec` runs, and the child's command line and environment for it.

The shard comes from the SHARD argument, a plan line (``--plan-line``), or a line
of a plan file (``--plan-file``) picked by ``--index`` or $SLURM_ARRAY_TASK_ID:
line N+1 for index N, the plan order of `shardledger plan --dry-run`, as
examples/slurm_array.sbatch reads it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from shard_client.ids import check_id
from shardledger_cli.exec.outputs import DeclaredOutput, env_name
from shardledger_cli.exec.progress import PROGRESS_FILE_ENV

__all__ = [
    "ARRAY_ENV",
    "PLACEHOLDERS",
    "Target",
    "check_expected",
    "child_env",
    "resolve_target",
    "substitute",
]

ARRAY_ENV: Final = "SLURM_ARRAY_TASK_ID"
PLACEHOLDERS: Final = "{tmp:NAME}, {run}, {shard}, {attempt}, {input}, {param:KEY}"
_PLACEHOLDER: Final = re.compile(r"\{(tmp|param):([^{}\s]+)\}|\{(run|shard|attempt|input)\}")


@dataclass(frozen=True, slots=True)
class Target:
    """The shard to run and, when it came from a plan, its plan line."""

    shard_id: str
    plan_line: dict[str, Any] | None = None


def _parse_line(text: str, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("shard_id"), str):
        raise ValueError(
            f'{where} must be a JSON object with a "shard_id" (plan --dry-run writes them)'
        )
    return obj


def _line_of_file(path: str, index: int) -> str:
    count = 0
    try:
        with open(path, encoding="utf-8") as f:
            for count, text in enumerate(f, start=1):
                if count == index + 1:
                    return text
    except OSError as exc:
        raise OSError(f"cannot read --plan-file {path}: {exc.strerror}") from None
    raise ValueError(f"--plan-file {path} has no line for index {index} ({count} lines)")


def resolve_target(
    *,
    shard: str | None,
    plan_line: str | None,
    plan_file: str | None,
    index: int | None,
    env: Mapping[str, str],
) -> Target:
    """Returns the shard to run; ValueError (usage) or OSError (local) say what is wrong."""
    if plan_line is not None and plan_file is not None:
        raise ValueError("give --plan-line or --plan-file, not both")
    if index is not None and plan_file is None:
        raise ValueError("--index picks a line of --plan-file; give --plan-file too")
    line: dict[str, Any] | None = None
    if plan_line is not None:
        line = _parse_line(plan_line, "--plan-line")
    elif plan_file is not None:
        if index is None:
            raw = env.get(ARRAY_ENV, "")
            if not raw.isdigit():
                raise ValueError(
                    f"--plan-file needs --index N or ${ARRAY_ENV} (a Slurm array task), not {raw!r}"
                )
            index = int(raw)
        line = _parse_line(_line_of_file(plan_file, index), f"line {index + 1} of {plan_file}")
    if line is None:
        if shard is None:
            raise ValueError("name the shard: SHARD, --plan-line JSON or --plan-file FILE")
        check_id("SHARD", shard)
        return Target(shard_id=shard)
    if shard is not None and shard != line["shard_id"]:
        raise ValueError(f"SHARD {shard!r} is not the plan line's shard_id {line['shard_id']!r}")
    check_id("the plan line's shard_id", line["shard_id"])
    return Target(shard_id=line["shard_id"], plan_line=line)


def substitute(
    argv: Sequence[str],
    *,
    run_id: str,
    target: Target,
    attempt_id: str,
    outputs: Sequence[DeclaredOutput],
) -> list[str]:
    """Replaces each placeholder in the command's words; ValueError names one it cannot fill."""
    temps = {o.name: o.temp for o in outputs}
    line = target.plan_line
    params = line.get("params", {}) if line is not None else {}

    def fill(match: re.Match[str]) -> str:
        kind, key, plain = match.group(1), match.group(2), match.group(3)
        if kind == "tmp":
            if key not in temps:
                raise ValueError(
                    f"{match.group(0)} names no --output (declared: {', '.join(temps)})"
                )
            return temps[key]
        if kind == "param":
            if not isinstance(params, dict) or key not in params:
                raise ValueError(f"{match.group(0)}: the plan line has no params.{key}")
            value = params[key]
            return value if isinstance(value, str) else json.dumps(value)
        if plain == "input":
            if line is None or not isinstance(line.get("input"), str):
                raise ValueError('{input} needs a plan line with an "input"')
            return str(line["input"])
        return {"run": run_id, "shard": target.shard_id, "attempt": attempt_id}[plain]

    return [_PLACEHOLDER.sub(fill, word) for word in argv]


def child_env(
    base: Mapping[str, str],
    *,
    run_id: str,
    target: Target,
    attempt_id: str,
    outputs: Sequence[DeclaredOutput],
    progress_file: str,
) -> dict[str, str]:
    """Returns the child's environment: the wrapper's plus the SHARDLEDGER_* variables of the attempt."""
    env = dict(base)
    env.update(
        SHARDLEDGER_RUN=run_id,
        SHARDLEDGER_SHARD=target.shard_id,
        SHARDLEDGER_ATTEMPT=attempt_id,
        SHARDLEDGER_OUTPUTS=" ".join(o.name for o in outputs),
    )
    env[PROGRESS_FILE_ENV] = progress_file
    for output in outputs:
        env[env_name(output.name)] = output.temp
    if target.plan_line is not None:
        env["SHARDLEDGER_PLAN_LINE"] = json.dumps(target.plan_line, ensure_ascii=False)
        if isinstance(target.plan_line.get("input"), str):
            env["SHARDLEDGER_INPUT"] = target.plan_line["input"]
    return env


def check_expected(target: Target, outputs: Sequence[DeclaredOutput]) -> None:
    """Raises ValueError when the plan line expects an output no --output declares."""
    if target.plan_line is None:
        return
    expected = target.plan_line.get("expected_outputs") or []
    declared = {o.name for o in outputs}
    missing = [n for n in expected if n not in declared]
    if missing:
        raise ValueError(
            f"the plan expects outputs {', '.join(missing)} that no --output declares"
            " (the attempt could never be complete)"
        )
