"""Who runs this process: the batch scheduler's identity and the process start time.

A watchdog elsewhere on the cluster acts on a hung attempt through what the
``started`` event records here: ``scancel`` needs the Slurm job id, ``kubectl``
the pod and its namespace, and a signal on the job's own host needs the pid
*and* its start time, since a pid alone may have been reused by another process.

Slurm sets its variables in every job. Kubernetes sets none by default; give the
pod these through the downward API (the ``SHARDLEDGER_`` names win over the plain
ones, so a job can override a variable another tool also uses)::

    env:
      - name: POD_NAME
        valueFrom: {fieldRef: {fieldPath: metadata.name}}
      - name: POD_NAMESPACE
        valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
      - name: NODE_NAME
        valueFrom: {fieldRef: {fieldPath: spec.nodeName}}

Without ``POD_NAME`` a pod is still recognised by ``KUBERNETES_SERVICE_HOST``
(its ``HOSTNAME`` is then the pod name), and its namespace is read from the
service account's mounted ``namespace`` file when there is one.

Ray sets no variable that names the task; a Ray worker is recognised by its
runtime context (``ray.get_runtime_context()``): job id, task id, the task's
attempt number, actor id, node id and namespace. Ray wins over Slurm and
Kubernetes, which may run the Ray cluster itself: the task is what one stops
or retries. ray is never imported here; a process that has not imported it
runs no Ray task.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from shard_client.vocabulary import SCHEDULER_FIELDS

__all__ = ["SchedulerIdentity", "detect", "process_start_ticks", "ray_identity"]

# The server refuses longer values (ledger_server/validation.py).
_MAX_LEN: Final = 255
_SA_NAMESPACE: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# (field, variables tried in order) for each scheduler.
SLURM_ENV: Final = (
    ("job_id", ("SLURM_JOB_ID", "SLURM_JOBID")),
    ("array_job_id", ("SLURM_ARRAY_JOB_ID",)),
    ("array_task_id", ("SLURM_ARRAY_TASK_ID",)),
    ("cluster", ("SLURM_CLUSTER_NAME",)),
    ("node", ("SLURMD_NODENAME",)),
)
KUBERNETES_ENV: Final = (
    ("job_id", ("SHARDLEDGER_POD_NAME", "POD_NAME")),
    ("namespace", ("SHARDLEDGER_POD_NAMESPACE", "POD_NAMESPACE")),
    ("node", ("SHARDLEDGER_NODE_NAME", "NODE_NAME")),
)


@dataclass(frozen=True, slots=True)
class SchedulerIdentity:
    """A job's name in its scheduler; the fields of the proto's SchedulerIdentity."""

    kind: str
    job_id: str = ""
    array_job_id: str = ""
    array_task_id: str = ""
    cluster: str = ""
    node: str = ""
    namespace: str = ""
    task_id: str = ""
    task_attempt: str = ""
    actor_id: str = ""

    def fields(self) -> dict[str, str]:
        """Returns the set fields, as the proto message's keyword arguments."""
        return {n: getattr(self, n)[:_MAX_LEN] for n in SCHEDULER_FIELDS if getattr(self, n)}


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str:
    return next((env[n] for n in names if env.get(n)), "")


def ray_identity(ray: Any = None) -> SchedulerIdentity | None:
    """Returns the Ray task or actor call this thread runs, or None outside a Ray worker.

    ``ray`` is the imported module (default: the one in sys.modules, never imported here).
    """
    ray = sys.modules.get("ray") if ray is None else ray
    if ray is None or not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    # A driver has a job and a node but runs no task of its own that Ray would retry.
    if context.worker.mode != ray.WORKER_MODE:
        return None
    task_id = context.get_task_id() or ""
    if not task_id:
        return None
    return SchedulerIdentity(
        "ray",
        job_id=context.get_job_id() or "",
        node=context.get_node_id() or "",
        namespace=context.namespace or "",
        task_id=task_id,
        task_attempt=_ray_attempt(context),
        actor_id=context.get_actor_id() or "",
    )


def _ray_attempt(context: Any) -> str:
    """Returns the running task's attempt number ("" where this Ray does not say it).

    The runtime context has no public getter for it (Ray 2.60); the core worker has.
    """
    getter = getattr(context.worker.core_worker, "get_current_task_attempt_number", None)
    return "" if getter is None else str(getter())


def detect(
    env: Mapping[str, str] | None = None, *, sa_namespace: Path = _SA_NAMESPACE
) -> SchedulerIdentity | None:
    """Returns the Ray, Slurm or Kubernetes identity of this process, or None outside them."""
    if env is None:
        found_ray = ray_identity()
        if found_ray is not None:
            return found_ray
    env = os.environ if env is None else env
    if env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"):
        return SchedulerIdentity("slurm", **{f: _first(env, names) for f, names in SLURM_ENV})
    found = {f: _first(env, names) for f, names in KUBERNETES_ENV}
    if not found["job_id"] and env.get("KUBERNETES_SERVICE_HOST"):
        found["job_id"] = env.get("HOSTNAME", "")
    if not found["job_id"]:
        return None
    if not found["namespace"]:
        # Without a mounted service account the namespace stays unknown.
        with contextlib.suppress(OSError):
            found["namespace"] = sa_namespace.read_text().strip()
    return SchedulerIdentity("kubernetes", **found)


def process_start_ticks(pid: int | str = "self") -> int:
    """Returns the process's start time in clock ticks since boot (/proc/PID/stat field 22), or 0."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0  # not Linux, or no such process
    # The command name (field 2) is in parentheses and may hold spaces or ')' itself,
    # so the fields are counted from the last ')': field 3 is the first after it.
    fields = stat.rpartition(")")[2].split()
    try:
        return int(fields[22 - 3])
    except (IndexError, ValueError):
        return 0
