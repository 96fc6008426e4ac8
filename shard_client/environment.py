"""The environment fingerprint: GPUs, driver, torch, determinism settings, image, as flat strings.

Two attempts of a shard can only be expected to produce identical bytes when
their fingerprints agree, so every value that can change numerics is recorded.
Reading it never crashes the job: a missing GPU, NVML library or torch becomes a
recorded value instead of an exception.

It costs a job nothing it did not already pay: torch is never imported here. A
job that has imported torch when the fingerprint is taken gets torch's runtime
settings (``torch.source: imported``: the cuDNN version, the determinism and
precision switches); one that has not gets the installed build, read from torch's
own ``torch/version.py`` without importing it (``torch.source: installed``: the
version and the CUDA it was built for) — a job that never imported torch cannot
have changed a switch. What does not change while a process lives (Python, the
platform, the torch build) is read once per process; NVML once per
``NVML_MAX_AGE_S``; the environment variables and torch's switches at every call.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import importlib
import importlib.util
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Final, Protocol

from shard_client.canonical import digest_fields, fingerprint_digest, fingerprint_json

__all__ = [
    "NVML_MAX_AGE_S",
    "SCHEMA_VERSION",
    "Fingerprint",
    "NvmlSeam",
    "PynvmlSeam",
    "fingerprint",
    "gpu_count",
]

# Bumped whenever a key is added, removed or renamed, so digests are comparable.
# 3: torch.source, and torch read from its installed build when the job has not imported it.
SCHEMA_VERSION = "3"
# A process that lives long re-reads NVML this often (GPU health counters move).
NVML_MAX_AGE_S: Final = 300.0
# pynvml's own library name on Linux: when it cannot be opened, pynvml is not imported.
_NVML_LIBRARY: Final = "libnvidia-ml.so.1"
IMAGE_DIGEST_ENV = "SHARDLEDGER_IMAGE_DIGEST"
_RECORDED_ENV = ("CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED")


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """Flat string fields plus the BLAKE3 digest of their canonical JSON."""

    fields: dict[str, str]
    digest: str

    @classmethod
    def from_fields(cls, fields: Mapping[str, str]) -> Fingerprint:
        """Builds a fingerprint; the digest covers every field but GPU identity and health."""
        copied = dict(fields)
        return cls(fields=copied, digest=fingerprint_digest(copied))


def digest_material(fields: Mapping[str, str]) -> bytes:
    """Returns the bytes the digest is computed over: the kept fields' RFC 8785 bytes.

    GPU UUIDs and ECC counters are left out: two identical nodes, or one board
    before and after an ECC event, are one environment for numerics. The rule is
    the contract's (docs/contract.md); the ledger recomputes every digest with it.
    """
    return fingerprint_json(digest_fields(fields))


class NvmlSeam(Protocol):
    """The handful of NVML queries the fingerprint needs; the only hardware seam."""

    def init(self) -> None:
        """Initializes NVML; raises if NVML is unusable."""

    def shutdown(self) -> None:
        """Releases NVML."""

    def driver_version(self) -> str:
        """Returns the kernel driver version, e.g. "550.54.15"."""

    def cuda_driver_version(self) -> str:
        """Returns the CUDA version the driver supports, e.g. "12.4"."""

    def device_count(self) -> int:
        """Returns the number of visible GPUs."""

    def device(self, index: int) -> dict[str, str]:
        """Returns one GPU's fields (name, uuid, memory, ECC counters) as strings."""


def _text(value: str | bytes) -> str:
    """Returns NVML text as str; older pynvml releases return bytes."""
    return value.decode() if isinstance(value, bytes) else value


class PynvmlSeam:
    """NvmlSeam backed by nvidia-ml-py, imported only when init() runs."""

    def __init__(self, module: ModuleType | None = None) -> None:
        self._nvml: Any = module

    def init(self) -> None:
        """Imports pynvml if needed and initializes NVML."""
        if self._nvml is None:
            self._nvml = importlib.import_module("pynvml")
        self._nvml.nvmlInit()

    def shutdown(self) -> None:
        """Shuts NVML down."""
        self._nvml.nvmlShutdown()

    def driver_version(self) -> str:
        """Returns the kernel driver version."""
        return _text(self._nvml.nvmlSystemGetDriverVersion())

    def cuda_driver_version(self) -> str:
        """Returns the driver's CUDA version as "major.minor"."""
        # NVML encodes 12.4 as 12040.
        encoded = int(self._nvml.nvmlSystemGetCudaDriverVersion())
        return f"{encoded // 1000}.{encoded % 1000 // 10}"

    def device_count(self) -> int:
        """Returns the number of GPUs NVML sees."""
        return int(self._nvml.nvmlDeviceGetCount())

    def device(self, index: int) -> dict[str, str]:
        """Returns name, UUID, total memory and uncorrected ECC counts of one GPU."""
        nvml = self._nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        return {
            "name": _text(nvml.nvmlDeviceGetName(handle)),
            "uuid": _text(nvml.nvmlDeviceGetUUID(handle)),
            "memory_total_bytes": str(nvml.nvmlDeviceGetMemoryInfo(handle).total),
            "ecc.volatile_uncorrected": self._ecc(handle, nvml.NVML_VOLATILE_ECC),
            "ecc.aggregate_uncorrected": self._ecc(handle, nvml.NVML_AGGREGATE_ECC),
        }

    def _ecc(self, handle: object, counter: int) -> str:
        """Returns an uncorrected ECC count, or why there is none."""
        nvml = self._nvml
        try:
            count = nvml.nvmlDeviceGetTotalEccErrors(
                handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, counter
            )
        except nvml.NVMLError_NotSupported:
            # Consumer GPUs and ECC-disabled boards have no counters; that is a fact, not a failure.
            return "not_supported"
        except nvml.NVMLError as exc:
            return f"error: {exc}"
        return str(count)


def _describe(exc: BaseException) -> str:
    """Returns a one-line reason for an exception."""
    message = str(exc).strip()
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _gpu_fields(nvml: NvmlSeam) -> dict[str, str]:
    """Returns the NVML part of the fingerprint; failures become recorded values."""
    try:
        nvml.init()
    except Exception as exc:
        return {"nvml": f"unavailable: {_describe(exc)}", "gpu.count": "0"}
    try:
        fields = {
            "nvml": "ok",
            "driver.version": _guarded(nvml.driver_version),
            "cuda.driver_version": _guarded(nvml.cuda_driver_version),
        }
        count = nvml.device_count()
        fields["gpu.count"] = str(count)
        for index in range(count):
            try:
                device = nvml.device(index)
            except Exception as exc:
                fields[f"gpu.{index}.error"] = _describe(exc)
                continue
            fields.update({f"gpu.{index}.{key}": value for key, value in device.items()})
        return fields
    except Exception as exc:
        return {"nvml": f"unavailable: {_describe(exc)}", "gpu.count": "0"}
    finally:
        # A failed shutdown changes nothing about what was already read.
        with contextlib.suppress(Exception):
            nvml.shutdown()


def _guarded(read: Callable[[], str]) -> str:
    """Returns read()'s value, or "error: <reason>" instead of raising."""
    try:
        return read()
    except Exception as exc:
        return f"error: {_describe(exc)}"


def _flag(value: object) -> str:
    """Returns a boolean-ish setting as "true"/"false"."""
    return "true" if value else "false"


def _torch_runtime_fields(torch: Any) -> dict[str, str]:
    """Returns the version and determinism settings of the torch the job imported."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    return {
        "torch.source": "imported",
        "torch.version": str(torch.__version__),
        "torch.cuda": str(torch.version.cuda or "none"),
        "torch.cudnn": _guarded(lambda: str(cudnn.version() or "none")),
        "torch.deterministic_algorithms": _flag(torch.are_deterministic_algorithms_enabled()),
        "torch.deterministic_warn_only": _flag(
            torch.is_deterministic_algorithms_warn_only_enabled()
        ),
        "torch.cudnn.benchmark": _flag(cudnn.benchmark),
        "torch.cudnn.deterministic": _flag(cudnn.deterministic),
        # Precision policy: a changed default (TF32, reduced-precision reductions)
        # changes results as surely as a new driver does.
        "torch.float32_matmul_precision": _guarded(torch.get_float32_matmul_precision),
        "torch.cuda.matmul.allow_tf32": _guarded(lambda: _flag(matmul.allow_tf32)),
        "torch.cudnn.allow_tf32": _guarded(lambda: _flag(cudnn.allow_tf32)),
        "torch.cuda.matmul.allow_fp16_reduced_precision_reduction": _guarded(
            lambda: _flag(matmul.allow_fp16_reduced_precision_reduction)
        ),
        "torch.cuda.matmul.allow_bf16_reduced_precision_reduction": _guarded(
            lambda: _flag(matmul.allow_bf16_reduced_precision_reduction)
        ),
    }


def _torch_installed_fields() -> dict[str, str]:
    """Returns the installed torch's version and CUDA build, read from torch/version.py.

    torch writes that file at build time and takes ``torch.__version__`` and
    ``torch.version.cuda`` from it, so the values are the ones an import would give.
    """
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):  # None in sys.modules: the job made torch unimportable
        return {"torch": "absent"}
    if spec is None:
        return {"torch": "absent"}
    try:
        locations = list(spec.submodule_search_locations or [])
        text = (Path(locations[0]) / "version.py").read_text(encoding="utf-8")
        values = _assignments(text)
        return {
            "torch.source": "installed",
            "torch.version": str(values["__version__"]),
            "torch.cuda": str(values.get("cuda") or "none"),
        }
    except Exception as exc:  # a broken install is a recorded fact, never a failed job
        return {"torch": f"error: {_describe(exc)}"}


def _assignments(source: str) -> dict[str, object]:
    """Returns the literal top-level assignments of a Python file (``x = 1``, ``x: T = 1``)."""
    values: dict[str, object] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name):
            with contextlib.suppress(ValueError):
                values[target.id] = ast.literal_eval(value)
    return values


def _torch_fields() -> dict[str, str]:
    """Returns torch's fields: the runtime's if the job imported torch, else its installed build."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "are_deterministic_algorithms_enabled"):
        try:
            return _torch_runtime_fields(torch)
        except Exception as exc:  # a half-initialized or broken torch must not take the job down
            return {"torch": f"error: {_describe(exc)}"}
    return _cached("torch", _torch_installed_fields)


class _ProcessCache:
    """What does not change while a process lives, read once (NVML: once per max age)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: dict[str, tuple[float, dict[str, str]]] = {}
        self.pid = os.getpid()


_CACHE = _ProcessCache()


def _cached(
    key: str, read: Callable[[], dict[str, str]], *, max_age_s: float = float("inf")
) -> dict[str, str]:
    """Returns read()'s fields, read at most once per max_age_s in this process."""
    with _CACHE.lock:
        if _CACHE.pid != os.getpid():  # a forked child reads its own (its GPUs may differ)
            _CACHE.values.clear()
            _CACHE.pid = os.getpid()
        now = time.monotonic()
        held = _CACHE.values.get(key)
        if held is None or now - held[0] >= max_age_s:
            held = (now, read())
            _CACHE.values[key] = held
        return dict(held[1])


def _platform_fields() -> dict[str, str]:
    return {
        "python.version": platform.python_version(),
        "python.implementation": platform.python_implementation(),
        "platform": platform.platform(),
    }


def _default_gpu_fields() -> dict[str, str]:
    """Returns the NVML fields through nvidia-ml-py, unless NVML's library is not there.

    pynvml opens the same library first and fails the same way; probing it here spares
    a machine without a GPU driver the import of pynvml on every process start.
    """
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(_NVML_LIBRARY)
        except OSError:
            return {
                "nvml": "unavailable: NVMLError_LibraryNotFound: NVML Shared Library Not Found",
                "gpu.count": "0",
            }
    return _gpu_fields(PynvmlSeam())


def fingerprint(
    *,
    nvml: NvmlSeam | None = None,
    env: Mapping[str, str] | None = None,
    with_torch: bool = True,
) -> Fingerprint:
    """Returns the fingerprint of this process's GPU and software environment.

    ``nvml``: a seam to read GPUs through, read at every call (default: nvidia-ml-py,
    read once per ``NVML_MAX_AGE_S`` in a process). ``with_torch=False`` records
    ``torch: not-read``: `shardledger exec` runs a child whose runtime is not this
    interpreter's.
    """
    environ = os.environ if env is None else env
    fields = {"schema": SCHEMA_VERSION, **_cached("platform", _platform_fields)}
    fields["image.digest"] = environ.get(IMAGE_DIGEST_ENV, "unknown")
    fields.update({f"env.{name}": environ.get(name, "unset") for name in _RECORDED_ENV})
    if nvml is not None:
        fields.update(_gpu_fields(nvml))
    else:
        fields.update(_cached("nvml", _default_gpu_fields, max_age_s=NVML_MAX_AGE_S))
    fields.update(_torch_fields() if with_torch else {"torch": "not-read"})
    return Fingerprint.from_fields(fields)


def gpu_count(fields: Mapping[str, str], env: Mapping[str, str], *, one_rank: bool) -> int:
    """Returns the GPUs this process holds, for the field figures' GPU time (0: unknown).

    The devices CUDA_VISIBLE_DEVICES names (CUDA stops at the first invalid entry, and
    "-1" hides them all), else NVML's device count from the fingerprint fields. One
    rank of a multi-rank launch uses one device of those it sees (torchrun's
    LOCAL_RANK picks it), so it holds one.
    """
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [entry.strip() for entry in visible.split(",")]
        count = next(
            (i for i, entry in enumerate(entries) if not entry or entry.startswith("-")),
            len(entries),
        )
    else:
        raw = fields.get("gpu.count", "")
        count = int(raw) if raw.isdigit() else 0
    return min(count, 1) if one_rank else count
