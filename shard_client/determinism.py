"""One call that seeds every global RNG and switches torch to deterministic kernels.

torch and numpy are imported inside :func:`enable`, never at module import, so
jobs that use neither pay nothing.
"""

from __future__ import annotations

import importlib
import os
import random
from typing import Any

__all__ = ["CUBLAS_WORKSPACE_CONFIG", "enable"]

# cuBLAS needs a fixed workspace to pick reproducible reduction orders; see
# https://docs.nvidia.com/cuda/cublas/#results-reproducibility
CUBLAS_WORKSPACE_CONFIG = ":4096:8"
_MAX_SEED = 2**32  # numpy's legacy global RNG accepts seeds below 2**32 only.


def _optional_module(name: str) -> Any:
    """Returns the imported module, or None if it is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def enable(seed: int, *, warn_only: bool = False) -> dict[str, str]:
    """Seeds python, numpy and torch RNGs, enables deterministic torch, and returns what it applied.

    Call it before the first CUDA operation: cuBLAS reads CUBLAS_WORKSPACE_CONFIG
    when it creates its handle, so setting it later has no effect. An existing
    CUBLAS_WORKSPACE_CONFIG is the job's choice and is kept. PYTHONHASHSEED only
    takes effect at interpreter start, so it is reported, not set. The first call
    costs about two seconds on torch 2.13, because use_deterministic_algorithms
    imports torch._inductor's config to make compiled kernels deterministic too.
    """
    if not 0 <= seed < _MAX_SEED:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    applied = {"seed": str(seed)}
    random.seed(seed)
    applied["random"] = "seeded"

    numpy = _optional_module("numpy")
    if numpy is not None:
        numpy.random.seed(seed)
    applied["numpy"] = "seeded" if numpy is not None else "absent"

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    applied["env.CUBLAS_WORKSPACE_CONFIG"] = os.environ["CUBLAS_WORKSPACE_CONFIG"]
    applied["env.PYTHONHASHSEED"] = os.environ.get("PYTHONHASHSEED", "unset")

    torch = _optional_module("torch")
    if torch is None:
        applied["torch"] = "absent"
        return applied
    applied.update(_enable_torch(torch, seed=seed, warn_only=warn_only))
    return applied


def _enable_torch(torch: Any, *, seed: int, warn_only: bool) -> dict[str, str]:
    """Seeds torch's CPU and CUDA generators and selects deterministic kernels."""
    # manual_seed covers the CPU generator and, lazily, every CUDA device.
    torch.manual_seed(seed)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.manual_seed_all(seed)
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.backends.cudnn.deterministic = True
    # Autotuning picks kernels by timing, which differs from run to run.
    torch.backends.cudnn.benchmark = False
    return {
        "torch": "seeded",
        "torch.cuda": f"seeded {torch.cuda.device_count()} devices" if cuda else "unavailable",
        "torch.deterministic_algorithms": "true",
        "torch.deterministic_warn_only": "true" if warn_only else "false",
        "torch.cudnn.deterministic": "true",
        "torch.cudnn.benchmark": "false",
    }
