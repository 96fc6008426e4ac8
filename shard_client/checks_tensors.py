"""Content checks for tensor files (torch, numpy, safetensors): readable, not empty, no NaN or Inf.

A file is empty when it holds no tensor or every tensor it holds has zero elements.

Registered into `shard_client.checks.CONTENT_CHECKS` on import, after the zip
check (``.pt`` and ``.npz`` files are zip archives); `shard_client.checks`
imports this module, so importing that one is enough.
"""

from __future__ import annotations

import json
import math
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from shard_client.checks_registry import CheckResult, content_check

__all__: list[str] = []


def _fail(reason: str, detail: str) -> CheckResult:
    return CheckResult(passed=False, reason=reason, detail=detail)


def _key_paths(obj: object, key: str = "") -> Iterator[tuple[str, object]]:
    # Bracketed keys, because state-dict keys themselves contain dots.
    if isinstance(obj, Mapping):
        for name, value in obj.items():
            yield from _key_paths(value, f"{key}[{name!r}]")
    elif isinstance(obj, list | tuple):
        for index, value in enumerate(obj):
            yield from _key_paths(value, f"{key}[{index}]")
    else:
        yield key or "<root>", obj


def _all_empty(
    kind: str, noun: str, tensors: list[tuple[str, str, tuple[int, ...]]]
) -> CheckResult | None:
    """Fails a file whose tensors (key, dtype, shape) are none, or all of zero elements."""
    if not tensors:
        return _fail("empty", f"{kind} holds no {noun}s")
    if any(math.prod(shape) for _, _, shape in tensors):
        return None
    if len(tensors) == 1:
        key, dtype, shape = tensors[0]
        where = "" if key == "<root>" else f" {key}"
        return _fail("empty", f"0-element {noun}{where} {dtype} {shape}")
    shown = ", ".join(f"{key} {dtype} {shape}" for key, dtype, shape in tensors[:3])
    more = f" and {len(tensors) - 3} more" if len(tensors) > 3 else ""
    return _fail("empty", f"every {noun} in the {kind} has 0 elements: {shown}{more}")


def _first_nonfinite(counts: Iterable[tuple[str, int]]) -> CheckResult | None:
    # Counts are lazy, so scanning stops at the first tensor holding a NaN or Inf.
    key, bad = next(((key, bad) for key, bad in counts if bad), ("", 0))
    if not bad:
        return None
    # "<root>" is a bare tensor (torch.save(tensor)), not a key the reader would know.
    where = "the tensor" if key == "<root>" else f"tensor {key}"
    return _fail("nan_or_inf", f"{bad} NaN/Inf value{'s' if bad != 1 else ''} in {where}")


@content_check("tensor_unreadable", ext=".pt .pth .ckpt", media="application/x-torch")
def _check_torch(path: Path) -> CheckResult | None:
    try:
        import torch
    except ImportError:
        return CheckResult(True, "ok", "torch not installed, tensors not checked")
    # mmap keeps multi-gigabyte checkpoints out of RAM; only the zip format supports it.
    loaded = torch.load(path, weights_only=True, map_location="cpu", mmap=zipfile.is_zipfile(path))
    leaves = list(_key_paths(loaded))
    found = [
        (key, str(value.dtype).removeprefix("torch."), tuple(value.shape))
        for key, value in leaves
        if isinstance(value, torch.Tensor)
    ]
    # Metadata without tensors (a step counter) is content; nothing at all, or only empty tensors, is not.
    if found or not leaves or leaves == [("<root>", None)]:
        empty = _all_empty("torch file", "tensor", found)
        if empty is not None:
            return empty
    tensors = (
        (key, value)
        for key, value in _key_paths(loaded)
        if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())
    )
    return _first_nonfinite((key, int(torch.isfinite(t).logical_not().sum())) for key, t in tensors)


def _numpy_nonfinite(arrays: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, int]]:
    import numpy as np

    for key, array in arrays:
        for field in array.dtype.names or ():
            yield from _numpy_nonfinite([(f"{key}[{field!r}]", array[field])])
        if array.dtype.kind in "fc":
            yield key, int(array.size - np.count_nonzero(np.isfinite(array)))


@content_check(
    "tensor_unreadable", ext=".npy .npz", media="application/x-npy", magic=(b"\x93NUMPY",)
)
def _check_numpy(path: Path) -> CheckResult | None:
    try:
        import numpy as np
    except ImportError:
        return CheckResult(True, "ok", "numpy not installed, arrays not checked")
    loaded = np.load(path, allow_pickle=False, mmap_mode="r")
    if isinstance(loaded, np.ndarray):
        return _all_empty(".npy file", "array", [("<root>", str(loaded.dtype), loaded.shape)]) or (
            _first_nonfinite(_numpy_nonfinite([("<root>", loaded)]))
        )
    with loaded:
        # A member's header alone gives its shape, so the emptiness pass reads no array data.
        shapes = [(repr(n), *_npz_member_shape(loaded, n)) for n in loaded.files]
        return _all_empty(".npz file", "array", shapes) or _first_nonfinite(
            _numpy_nonfinite((repr(n), loaded[n]) for n in loaded.files)
        )


def _npz_member_shape(archive: Any, name: str) -> tuple[str, tuple[int, ...]]:
    import numpy as np

    fmt = np.lib.format
    readers = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}
    member = f"{name}.npy" if f"{name}.npy" in archive.zip.namelist() else name
    with archive.zip.open(member) as fh:
        reader = readers.get(fmt.read_magic(fh))
        if reader is not None:
            shape, _, dtype = reader(fh)
            return str(dtype), tuple(shape)
    array = archive[name]  # a newer header version: load it to learn its shape
    return str(array.dtype), tuple(array.shape)


# Bytes per element of each safetensors dtype.
_SAFETENSORS_WIDTH = {
    **dict.fromkeys(("F64", "I64", "U64"), 8),
    **dict.fromkeys(("F32", "I32", "U32"), 4),
    **dict.fromkeys(("F16", "BF16", "I16", "U16"), 2),
    **dict.fromkeys(("F8_E5M2", "F8_E4M3", "I8", "U8", "BOOL"), 1),
}

# An element is NaN or Inf exactly when every bit of the mask is set (E4M3 has no Inf).
_SAFETENSORS_NONFINITE_MASKS = {
    "F64": ("<u8", 0x7FF0_0000_0000_0000),
    "F32": ("<u4", 0x7F80_0000),
    "F16": ("<u2", 0x7C00),
    "BF16": ("<u2", 0x7F80),
    "F8_E5M2": ("u1", 0x7C),
    "F8_E4M3": ("u1", 0x7F),
}


@content_check("tensor_unreadable", ext=".safetensors", media="application/x-safetensors")
def _check_safetensors(path: Path) -> CheckResult | None:
    size = path.stat().st_size
    with path.open("rb") as fh:
        base = 8 + int.from_bytes(fh.read(8), "little")
        if size < 8 or base > size:
            return _fail("truncated", "safetensors header runs past the end of the file")
        header = json.loads(fh.read(base - 8))
    header.pop("__metadata__", None)
    spans = {repr(name): (info["dtype"], *info["data_offsets"]) for name, info in header.items()}
    for name, (_, begin, end) in spans.items():
        if not 0 <= begin <= end or base + end > size:
            return _fail("truncated", f"tensor {name} runs past the end of the file")
    for name, info in header.items():
        width = _SAFETENSORS_WIDTH.get(info["dtype"])
        begin, end = info["data_offsets"]
        need = None if width is None else math.prod(info["shape"]) * width
        if need is not None and need != end - begin:
            return _fail(
                "tensor_unreadable",
                f"tensor {name!r}: shape {info['shape']} of {info['dtype']} needs"
                f" {need} bytes, the header gives {end - begin}",
            )
    empty = _all_empty(
        "safetensors file",
        "tensor",
        [(repr(n), info["dtype"], tuple(info["shape"])) for n, info in header.items()],
    )
    if empty is not None:
        return empty
    try:
        import numpy as np
    except ImportError:
        return CheckResult(True, "ok", "numpy not installed, tensor values not checked")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    return _first_nonfinite(
        (name, _count_nonfinite_bits(data[base + begin : base + end], dtype))
        for name, (dtype, begin, end) in spans.items()
    )


def _count_nonfinite_bits(raw: Any, dtype: str) -> int:
    if dtype not in _SAFETENSORS_NONFINITE_MASKS:
        return 0
    view_dtype, mask = _SAFETENSORS_NONFINITE_MASKS[dtype]
    return int(((raw.view(view_dtype) & mask) == mask).sum())
