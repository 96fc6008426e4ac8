"""An environment fingerprint: GPUs, driver, torch, determinism settings, image, as flat strings.

Two attempts of a shard can only be expected to produce identical bytes when
their fingerprints agree, so every value that can change numerics is recorded.
Reading it never crashes the job: a missing GPU, NVML library or torch becomes a
recorded value instead of an exception. torch is imported when the fingerprint
is taken (not when this module is imported), since its settings are recorded.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import platform
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from shard_client.canonical import digest_fields, fingerprint_digest, fingerprint_json

__all__ = ["SCHEMA_VERSION", "Fingerprint", "NvmlSeam", "PynvmlSeam", "fingerprint", "gpu_count"]

# Bumped whenever a key is added, removed or renamed, so digests are comparable.
SCHEMA_VERSION = "2"
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


def _torch_fields() -> dict[str, str]:
    """Returns torch's version and determinism settings, or that torch is absent."""
    try:
        torch: Any = importlib.import_module("torch")
    except ImportError:
        return {"torch": "absent"}
    except Exception as exc:
        # A broken install (e.g. missing CUDA libraries) must not take the job down.
        return {"torch": f"error: {_describe(exc)}"}
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    return {
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


def fingerprint(
    *,
    nvml: NvmlSeam | None = None,
    env: Mapping[str, str] | None = None,
    with_torch: bool = True,
) -> Fingerprint:
    """Returns the fingerprint of this process's GPU and software environment.

    ``with_torch=False`` records ``torch: not-read`` instead of importing torch:
    `shardledger exec` runs a child whose runtime is not this interpreter's.
    """
    environ = os.environ if env is None else env
    fields = {
        "schema": SCHEMA_VERSION,
        "python.version": platform.python_version(),
        "python.implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "image.digest": environ.get(IMAGE_DIGEST_ENV, "unknown"),
    }
    fields.update({f"env.{name}": environ.get(name, "unset") for name in _RECORDED_ENV})
    fields.update(_gpu_fields(nvml if nvml is not None else PynvmlSeam()))
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
