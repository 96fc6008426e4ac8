"""Empty means empty: an artifact with no content fails `empty`, whatever its format."""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path
from typing import Any

import blake3
import pytest

from shard_client.checks import CheckResult, verify_artifact
from tests.sdk.test_checks import _gradient, _jpeg, _npy_bytes, _png, _safetensors, _torch_bytes


def _verify(root: Path, name: str, data: bytes, **kwargs: Any) -> CheckResult:
    """Writes data under root and verifies it against a record that matches it exactly."""
    (root / name).write_bytes(data)
    digest = blake3.blake3(data).hexdigest()
    return verify_artifact(
        root=root, path=name, expected_size=len(data), expected_blake3=digest, **kwargs
    )


def _npz_bytes(**arrays: Any) -> bytes:
    np = pytest.importorskip("numpy")
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _png_of(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    rows = b"\x00" * height  # one filter byte per row, no pixels
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


def test_zero_bytes_is_empty(tmp_path: Path) -> None:
    result = _verify(tmp_path, "out.bin", b"")
    assert (result.reason, result.detail) == ("empty", "artifact is zero bytes long")


def test_npy_of_zero_elements_is_empty_and_names_its_dtype_and_shape(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    result = _verify(tmp_path, "out.npy", _npy_bytes(np.zeros((0, 3), dtype=np.float32)))
    assert (result.passed, result.reason) == (False, "empty")
    assert result.detail == "0-element array float32 (0, 3)"
    assert _verify(tmp_path, "one.npy", _npy_bytes(np.zeros((1, 3), dtype=np.float32))).passed


def test_npy_of_zero_structured_records_is_empty(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    records = np.zeros(0, dtype=[("x", "f4"), ("y", "i4")])
    assert _verify(tmp_path, "out.npy", _npy_bytes(records)).reason == "empty"


def test_npz_whose_arrays_all_have_zero_elements_is_empty(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    data = _npz_bytes(a=np.zeros((0, 3), dtype=np.float32), b=np.zeros(0))
    result = _verify(tmp_path, "out.npz", data)
    assert (result.passed, result.reason) == (False, "empty")
    assert "'a' float32 (0, 3)" in result.detail and "'b' float64 (0,)" in result.detail


def test_npz_without_arrays_is_empty(tmp_path: Path) -> None:
    pytest.importorskip("numpy")
    result = _verify(tmp_path, "out.npz", _npz_bytes())
    assert (result.reason, result.detail) == ("empty", ".npz file holds no arrays")


def test_npz_with_one_nonempty_array_passes(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    assert _verify(tmp_path, "out.npz", _npz_bytes(a=np.zeros(0), b=np.ones(2))).passed


def test_safetensors_without_tensors_is_empty(tmp_path: Path) -> None:
    result = _verify(tmp_path, "out.safetensors", _safetensors({}))
    assert (result.reason, result.detail) == ("empty", "safetensors file holds no tensors")


def test_safetensors_of_only_zero_element_tensors_is_empty(tmp_path: Path) -> None:
    data = _safetensors({"w": ("F32", [0, 4], b""), "b": ("F16", [0], b"")})
    result = _verify(tmp_path, "out.safetensors", data)
    assert (result.passed, result.reason) == (False, "empty")
    assert "'w' F32 (0, 4)" in result.detail
    nonempty = _safetensors({"w": ("F32", [0, 4], b""), "b": ("F32", [1], b"\0\0\x80\x3f")})
    assert _verify(tmp_path, "ok.safetensors", nonempty).passed


def test_torch_file_of_zero_element_tensors_is_empty(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    result = _verify(tmp_path, "out.pt", _torch_bytes({"w": torch.zeros(0, 4)}))
    assert (result.reason, result.detail) == ("empty", "0-element tensor ['w'] float32 (0, 4)")
    both = {"w": torch.zeros(0, 4), "layers": [torch.zeros(0)]}
    assert _verify(tmp_path, "both.pt", _torch_bytes(both)).reason == "empty"


@pytest.mark.parametrize("obj", [{}, [], None])
def test_torch_file_holding_nothing_is_empty(tmp_path: Path, obj: object) -> None:
    pytest.importorskip("torch")
    result = _verify(tmp_path, "out.pt", _torch_bytes(obj))
    assert (result.reason, result.detail) == ("empty", "torch file holds no tensors")


def test_torch_file_with_a_tensor_or_only_metadata_passes(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    assert _verify(tmp_path, "w.pt", _torch_bytes({"w": torch.ones(2), "e": torch.zeros(0)})).passed
    assert _verify(tmp_path, "meta.pt", _torch_bytes({"step": 3})).passed


@pytest.mark.parametrize("text", ["{}", "[]", "null", " null\n", '""'])
def test_json_that_holds_nothing_is_empty(tmp_path: Path, text: str) -> None:
    result = _verify(tmp_path, "out.json", text.encode())
    assert (result.passed, result.reason) == (False, "empty")
    assert json.loads(text) is None or "holds nothing" in result.detail


def test_empty_json_declared_by_media_type_is_empty(tmp_path: Path) -> None:
    assert _verify(tmp_path, "out.dat", b"{}", media_type="application/json").reason == "empty"
    assert _verify(tmp_path, "out.dat", b"{}").passed  # undeclared bytes are not JSON


@pytest.mark.parametrize("text", ["0", "false", '{"a": null}', "[[]]"])
def test_json_with_a_value_passes(tmp_path: Path, text: str) -> None:
    assert _verify(tmp_path, "out.json", text.encode()).passed


def test_jsonl_without_a_record_is_empty(tmp_path: Path) -> None:
    result = _verify(tmp_path, "out.jsonl", b"\n  \n\n")
    assert (result.reason, result.detail) == ("empty", "no JSON records, only blank lines")


@pytest.mark.parametrize(("width", "height"), [(0, 4), (4, 0), (0, 0)])
def test_png_of_zero_pixels_is_empty(tmp_path: Path, width: int, height: int) -> None:
    result = _verify(tmp_path, "out.png", _png_of(width, height))
    assert (result.reason, result.detail) == ("empty", f"PNG of zero pixels ({width}x{height})")
    assert _verify(tmp_path, "ok.png", _png(_gradient)).passed


def test_jpeg_of_zero_width_is_empty(tmp_path: Path) -> None:
    data = bytearray(_jpeg(_gradient))
    sof = next(i for i in range(2, len(data)) if data[i] == 0xFF and data[i + 1] == 0xC0)
    data[sof + 7 : sof + 9] = b"\0\0"  # marker, length, precision, height, then width
    result = _verify(tmp_path, "out.jpg", bytes(data))
    assert (result.reason, result.detail) == ("empty", "JPEG of zero pixels (0x16)")


@pytest.mark.parametrize("name", ["out.txt", "out.csv", "out.log"])
@pytest.mark.parametrize("text", [b" ", b"\n\n\t \r\n", b"\xef\xbb\xbf\n"])
def test_text_of_only_whitespace_is_empty(tmp_path: Path, name: str, text: bytes) -> None:
    result = _verify(tmp_path, name, text)
    assert (result.reason, result.detail) == ("empty", "text of only whitespace")


def test_any_text_media_type_selects_the_whitespace_check(tmp_path: Path) -> None:
    assert _verify(tmp_path, "out.md", b" \n", media_type="text/markdown").reason == "empty"
    assert _verify(tmp_path, "out.md", b" \n").passed  # neither extension nor media type says text


def test_text_with_one_visible_character_passes(tmp_path: Path) -> None:
    big = b" " * (3 << 20) + b"x"  # past the first read
    assert _verify(tmp_path, "out.log", big).passed
    assert _verify(tmp_path, "out.csv", b"a\n").passed
