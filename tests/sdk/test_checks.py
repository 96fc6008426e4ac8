"""Behaviour of artifact verification: containment, record checks, content checks, validators."""

from __future__ import annotations

import gzip
import io
import json
import os
import struct
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shard_client import checks
from shard_client.checks import (
    CheckResult,
    PathOutsideRoot,
    Validator,
    content_check,
    load_entry_point_validators,
    resolve_within_root,
    verify_artifact,
)

Pixel = tuple[int, int, int]


def _digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def _write(root: Path, name: str, data: bytes) -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _verify(root: Path, name: str, data: bytes, **kwargs: Any) -> CheckResult:
    """Writes data under root and verifies it against a record that matches it exactly."""
    _write(root, name, data)
    return verify_artifact(
        root=root, path=name, expected_size=len(data), expected_blake3=_digest(data), **kwargs
    )


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png(pixel: Callable[[int, int], Pixel], *, size: int = 4, idat: bytes | None = None) -> bytes:
    """Builds an 8-bit RGB PNG by hand, so making test images needs no Pillow."""
    ihdr = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)
    rows = (b"\x00" + bytes(c for x in range(size) for c in pixel(x, y)) for y in range(size))
    data = zlib.compress(b"".join(rows)) if idat is None else idat
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", data)
        + _png_chunk(b"IEND", b"")
    )


def _gradient(x: int, y: int) -> Pixel:
    return (x * 60, y * 60, 128)


def _jpeg(pixel: Callable[[int, int], Pixel]) -> bytes:
    image_module = pytest.importorskip("PIL.Image")
    image = image_module.new("RGB", (16, 16))
    image.putdata([pixel(x, y) for y in range(16) for x in range(16)])
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG")
    return buffer.getvalue()


def _torch_bytes(obj: object, **kwargs: Any) -> bytes:
    torch = pytest.importorskip("torch")
    buffer = io.BytesIO()
    torch.save(obj, buffer, **kwargs)
    return buffer.getvalue()


def _npy_bytes(array: Any) -> bytes:
    np = pytest.importorskip("numpy")
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _safetensors(tensors: dict[str, tuple[str, list[int], bytes]]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset, payload = 0, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset, payload = offset + len(raw), payload + raw
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + payload


@pytest.fixture
def without_pillow(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes `import PIL` raise ImportError, as if it were absent.
    monkeypatch.setitem(sys.modules, "PIL", None)


# --- containment -------------------------------------------------------------------------


def test_relative_path_resolves_inside_root(tmp_path: Path) -> None:
    assert resolve_within_root(tmp_path, "a/b/../c.txt") == tmp_path.resolve() / "a" / "c.txt"


def test_absolute_path_inside_root_is_accepted(tmp_path: Path) -> None:
    inside = tmp_path / "out" / "x.bin"
    assert resolve_within_root(str(tmp_path), str(inside)) == inside.resolve()


@pytest.mark.parametrize("path", ["../escape.txt", "a/../../escape.txt", "/etc/passwd"])
def test_paths_escaping_root_are_refused(tmp_path: Path, path: str) -> None:
    with pytest.raises(PathOutsideRoot) as raised:
        resolve_within_root(tmp_path / "root", path)
    assert isinstance(raised.value, ValueError)
    assert raised.value.root == (tmp_path / "root").resolve()


def test_symlink_inside_root_pointing_outside_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    _write(tmp_path, "secret.txt", b"secret")
    (root / "link.txt").symlink_to(tmp_path / "secret.txt")
    (root / "dir").symlink_to(tmp_path)
    for path in ("link.txt", "dir/secret.txt", str(root / "link.txt")):
        with pytest.raises(PathOutsideRoot):
            resolve_within_root(root, path)


def test_symlink_inside_root_pointing_inside_is_followed(tmp_path: Path) -> None:
    _write(tmp_path, "real.txt", b"data")
    (tmp_path / "alias.txt").symlink_to(tmp_path / "real.txt")
    assert resolve_within_root(tmp_path, "alias.txt") == (tmp_path / "real.txt").resolve()


@pytest.mark.parametrize("escape", ["../outside.json", "ABSOLUTE", "link.json", "dangling.json"])
def test_verify_reports_outside_root_for_every_escape(tmp_path: Path, escape: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    outside = _write(tmp_path, "outside.json", b"{}")
    (root / "link.json").symlink_to(outside)
    (root / "dangling.json").symlink_to(tmp_path / "nowhere.json")
    path = str(outside) if escape == "ABSOLUTE" else escape
    result = verify_artifact(root=root, path=path, expected_size=2, expected_blake3=_digest(b"{}"))
    assert (result.passed, result.reason) == (False, "outside_root")


# --- the ledger record: existence, size, digest, emptiness -----------------------------------


def test_matching_record_passes_and_names_the_checks_run(tmp_path: Path) -> None:
    result = _verify(tmp_path, "data/out.bin", b"payload")
    assert result == CheckResult(passed=True, reason="ok", detail="checked size, blake3")


def test_missing_file_is_reported_missing(tmp_path: Path) -> None:
    result = verify_artifact(root=tmp_path, path="gone.bin", expected_size=1, expected_blake3="00")
    assert (result.passed, result.reason) == (False, "missing")


@pytest.mark.parametrize("path", ["subdir", "", "bad\x00name", "fifo", "loop"])
def test_directory_or_unusable_path_is_not_a_file(tmp_path: Path, path: str) -> None:
    (tmp_path / "subdir").mkdir()
    os.mkfifo(tmp_path / "fifo")  # reading a FIFO would block; it must be refused unread
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    result = verify_artifact(root=tmp_path, path=path, expected_size=0, expected_blake3="")
    assert (result.passed, result.reason) == (False, "not_a_file")


def test_wrong_size_is_reported_before_digest(tmp_path: Path) -> None:
    _write(tmp_path, "a.bin", b"12345")
    result = verify_artifact(root=tmp_path, path="a.bin", expected_size=4, expected_blake3="00")
    assert (result.passed, result.reason) == (False, "size_mismatch")
    assert "expected 4 bytes, found 5" in result.detail


def test_same_size_different_bytes_is_a_digest_mismatch(tmp_path: Path) -> None:
    _write(tmp_path, "a.bin", b"12345")
    digest = _digest(b"54321")
    result = verify_artifact(root=tmp_path, path="a.bin", expected_size=5, expected_blake3=digest)
    assert (result.passed, result.reason) == (False, "digest_mismatch")


def test_digest_comparison_ignores_case_and_whitespace(tmp_path: Path) -> None:
    _write(tmp_path, "a.bin", b"x")
    digest = f" {_digest(b'x').upper()}\n"
    result = verify_artifact(root=tmp_path, path="a.bin", expected_size=1, expected_blake3=digest)
    assert result.passed


def test_large_file_is_hashed_through_mmap_and_checked(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)
    assert _verify(tmp_path, "big.bin", data).passed
    flipped = data[:-1] + bytes([data[-1] ^ 1])
    _write(tmp_path, "big.bin", flipped)
    result = verify_artifact(
        root=tmp_path, path="big.bin", expected_size=len(data), expected_blake3=_digest(data)
    )
    assert result.reason == "digest_mismatch"


@pytest.mark.parametrize("name", ["empty.bin", "empty.json", "empty.png"])
def test_zero_byte_artifact_never_passes_even_with_matching_digest(
    tmp_path: Path, name: str
) -> None:
    result = _verify(tmp_path, name, b"")
    assert (result.passed, result.reason) == (False, "empty")


# --- JSON and JSON Lines -----------------------------------------------------------------


def test_valid_json_passes(tmp_path: Path) -> None:
    result = _verify(tmp_path, "metrics.json", b'{"loss": 0.25, "step": [1, 2]}')
    assert result.passed
    assert "json" in result.detail


def test_garbage_json_is_invalid(tmp_path: Path) -> None:
    result = _verify(tmp_path, "metrics.json", b'{"loss": 0.2')
    assert (result.passed, result.reason) == (False, "json_invalid")


def test_media_type_selects_the_json_check_for_any_extension(tmp_path: Path) -> None:
    result = _verify(
        tmp_path, "metrics.txt", b"not json", media_type="application/json; charset=utf-8"
    )
    assert result.reason == "json_invalid"


@pytest.mark.parametrize(
    ("name", "body", "where"),
    [
        ("metrics.json", b'{"loss": NaN, "step": 3}', "NaN"),
        ("metrics.json", b'{"loss": -Infinity}', "-Infinity"),
        ("metrics.json", b'{"loss": 1e999}', "1e999"),
        ("rows.jsonl", b'{"loss": 0.5}\n{"loss": Infinity}\n', "line 2: Infinity"),
    ],
)
def test_json_with_a_nan_or_infinite_number_fails_nan_or_inf(
    tmp_path: Path, name: str, body: bytes, where: str
) -> None:
    # Python's json.dumps writes a diverged loss as NaN; json.loads reads it back happily.
    result = _verify(tmp_path, name, body)
    assert (result.passed, result.reason) == (False, "nan_or_inf")
    assert where in result.detail


def test_jsonl_of_only_blank_lines_is_empty(tmp_path: Path) -> None:
    result = _verify(tmp_path, "rows.jsonl", b"\n\n  \n")
    assert (result.passed, result.reason) == (False, "empty")


def test_jsonl_with_blank_and_trailing_lines_passes(tmp_path: Path) -> None:
    assert _verify(tmp_path, "rows.jsonl", b'{"a": 1}\n\n{"a": 2}\n').passed


def test_jsonl_with_a_torn_last_line_names_the_line(tmp_path: Path) -> None:
    result = _verify(tmp_path, "rows.jsonl", b'{"a": 1}\n{"a": 2}\n{"a": ')
    assert (result.reason, result.detail.startswith("line 3")) == ("json_invalid", True)


def test_known_media_type_overrides_the_extension(tmp_path: Path) -> None:
    data = b'{"a": 1}\n{"a": 2}\n'
    assert not _verify(tmp_path, "rows.json", data).passed
    assert _verify(tmp_path, "rows.json", data, media_type="application/x-ndjson").passed


# --- images ------------------------------------------------------------------------------


def test_png_without_pillow_passes_on_structure_alone(tmp_path: Path, without_pillow: None) -> None:
    result = _verify(tmp_path, "img.png", _png(_gradient))
    assert result.passed
    assert "Pillow not installed" in result.detail


@pytest.mark.parametrize("cut", [1, 12, 40])
def test_truncated_png_is_truncated(tmp_path: Path, cut: int) -> None:
    result = _verify(tmp_path, "img.png", _png(_gradient)[:-cut])
    assert (result.passed, result.reason) == (False, "truncated")


def test_png_with_bytes_after_iend_is_truncated(tmp_path: Path) -> None:
    assert _verify(tmp_path, "img.png", _png(_gradient) + b"junk").reason == "truncated"


def test_png_magic_is_checked_whatever_the_extension(tmp_path: Path) -> None:
    assert _verify(tmp_path, "img.bin", _png(_gradient)[:-5]).reason == "truncated"


def test_png_named_file_without_signature_is_undecodable(tmp_path: Path) -> None:
    assert _verify(tmp_path, "img.png", b"GIF89a not a png").reason == "image_undecodable"


def test_png_decodes_with_pillow(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    result = _verify(tmp_path, "img.png", _png(_gradient))
    assert result == CheckResult(passed=True, reason="ok", detail="checked size, blake3, png")


def test_png_with_corrupt_pixel_data_is_undecodable_with_pillow(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    result = _verify(tmp_path, "img.png", _png(_gradient, idat=b"not a zlib stream"))
    assert (result.passed, result.reason) == (False, "image_undecodable")


@pytest.mark.parametrize("colour", [(0, 0, 0), (255, 255, 255), (17, 99, 200)])
def test_constant_png_is_degenerate_with_pillow(tmp_path: Path, colour: Pixel) -> None:
    pytest.importorskip("PIL")
    result = _verify(tmp_path, "img.png", _png(lambda x, y: colour))
    assert (result.passed, result.reason) == (False, "image_degenerate")


def test_jpeg_without_pillow_needs_start_and_end_markers(
    tmp_path: Path, without_pillow: None
) -> None:
    assert _verify(tmp_path, "a.jpg", b"\xff\xd8\xff\xe0 body \xff\xd9").passed
    assert _verify(tmp_path, "a.jpg", b"\xff\xd8\xff\xe0 body").reason == "truncated"
    assert _verify(tmp_path, "a.jpg", b"\x00 body \xff\xd9").reason == "image_undecodable"


def test_real_jpeg_passes_and_its_truncation_is_caught(tmp_path: Path) -> None:
    data = _jpeg(_gradient)
    assert _verify(tmp_path, "a.jpeg", data).passed
    assert _verify(tmp_path, "a.jpeg", data[: len(data) // 2]).reason == "truncated"


def test_jpeg_with_scrambled_body_is_undecodable(tmp_path: Path) -> None:
    data = _jpeg(_gradient)
    scrambled = data[:4] + b"\x00" * (len(data) - 6) + data[-2:]
    assert _verify(tmp_path, "a.jpg", scrambled).reason == "image_undecodable"


def test_solid_jpeg_is_degenerate(tmp_path: Path) -> None:
    assert _verify(tmp_path, "a.jpg", _jpeg(lambda x, y: (0, 0, 0))).reason == "image_degenerate"


# --- compressed containers -----------------------------------------------------------------


def test_gzip_passes_and_truncated_or_corrupt_gzip_fails(tmp_path: Path) -> None:
    data = gzip.compress(os.urandom(5000))
    assert _verify(tmp_path, "a.gz", data).passed
    assert _verify(tmp_path, "a.gz", data[:-4]).reason == "truncated"
    corrupt_crc = data[:-8] + bytes(b ^ 0xFF for b in data[-8:-4]) + data[-4:]
    assert _verify(tmp_path, "a.bin", corrupt_crc).reason == "truncated"


def _zip_bytes(members: dict[str, bytes], *, compression: int = zipfile.ZIP_DEFLATED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=compression) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def test_zip_passes_and_loses_its_central_directory_when_truncated(tmp_path: Path) -> None:
    data = _zip_bytes({"a.txt": b"a" * 1000, "b.txt": os.urandom(100)})
    assert "zip" in _verify(tmp_path, "a.zip", data).detail
    assert _verify(tmp_path, "a.zip", data[:-30]).reason == "truncated"


def test_zip_member_with_bad_crc_is_truncated(tmp_path: Path) -> None:
    data = bytearray(_zip_bytes({"a.txt": b"hello world"}, compression=zipfile.ZIP_STORED))
    data[30 + len("a.txt")] ^= 0xFF  # the first stored byte, just past the local header
    assert _verify(tmp_path, "a.zip", bytes(data)).reason == "truncated"


# --- tensors -----------------------------------------------------------------------------


def test_finite_torch_state_dict_passes_zip_and_torch_checks(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    state = {"model": {"w": torch.ones(3), "step": torch.tensor(7)}, "ids": [torch.zeros(2)]}
    result = _verify(tmp_path, "ckpt.pt", _torch_bytes(state))
    assert result == CheckResult(
        passed=True, reason="ok", detail="checked size, blake3, zip, torch"
    )


@pytest.mark.parametrize("legacy", [False, True])
def test_nan_in_nested_torch_tensor_names_its_key_path(tmp_path: Path, legacy: bool) -> None:
    torch = pytest.importorskip("torch")
    bad = torch.tensor([1.0, float("nan"), float("inf")])
    state = {"model": {"layer.weight": bad}, "ok": torch.ones(2)}
    data = _torch_bytes(state, _use_new_zipfile_serialization=not legacy)
    result = _verify(tmp_path, "ckpt.pth", data)
    assert (result.passed, result.reason) == (False, "nan_or_inf")
    assert result.detail == "2 NaN/Inf values in tensor ['model']['layer.weight']"


def test_inf_inside_a_list_of_tensors_is_found(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    data = _torch_bytes([torch.ones(2), (torch.tensor([float("-inf")], dtype=torch.bfloat16),)])
    result = _verify(tmp_path, "t.bin", data, media_type="application/x-torch")
    assert (result.reason, result.detail) == ("nan_or_inf", "1 NaN/Inf value in tensor [1][0]")


def test_truncated_torch_file_fails_the_zip_check(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    data = _torch_bytes({"w": torch.ones(100)})
    assert _verify(tmp_path, "ckpt.pt", data[:-100]).reason == "truncated"


def test_unloadable_torch_files_are_tensor_unreadable(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    assert _verify(tmp_path, "ckpt.ckpt", b"\x80\x02garbage").reason == "tensor_unreadable"
    # weights_only refuses arbitrary classes, so a pickled object is unreadable, never run.
    result = _verify(tmp_path, "ckpt.pt", _torch_bytes({"obj": zipfile.ZipInfo("x")}))
    assert (result.reason, "raised UnpicklingError" in result.detail) == ("tensor_unreadable", True)


def test_torch_file_passes_with_a_note_when_torch_is_absent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _torch_bytes({"w": pytest.importorskip("torch").ones(1)})
    monkeypatch.setitem(sys.modules, "torch", None)
    result = _verify(tmp_path, "ckpt.pt", data)
    assert result.passed
    assert "torch not installed" in result.detail


def test_npy_arrays_pass_when_finite_and_fail_on_nan(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    assert _verify(tmp_path, "a.npy", _npy_bytes(np.arange(6, dtype=np.float32))).passed
    assert _verify(tmp_path, "i.npy", _npy_bytes(np.arange(6))).passed
    result = _verify(tmp_path, "b.npy", _npy_bytes(np.array([1.0, np.nan])))
    assert (result.reason, result.detail) == ("nan_or_inf", "1 NaN/Inf value in the tensor")


def test_npy_with_nonfinite_structured_field_names_the_field(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    array = np.array([(1, np.inf)], dtype=[("step", "i4"), ("loss", "f8")])
    assert _verify(tmp_path, "s.npy", _npy_bytes(array)).detail.endswith("<root>['loss']")


def test_truncated_or_pickled_npy_is_tensor_unreadable(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    data = _npy_bytes(np.ones(100))
    assert _verify(tmp_path, "a.npy", data[:-10]).reason == "tensor_unreadable"
    assert _verify(tmp_path, "o.npy", _npy_bytes(np.array([{}, 1]))).reason == "tensor_unreadable"


def test_npz_member_with_inf_is_named(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    buffer = io.BytesIO()
    np.savez(buffer, good=np.ones(3), bad=np.array([np.inf]))
    result = _verify(tmp_path, "arrays.npz", buffer.getvalue())
    assert (result.reason, result.detail) == ("nan_or_inf", "1 NaN/Inf value in tensor 'bad'")


def test_safetensors_with_finite_values_passes(tmp_path: Path) -> None:
    data = _safetensors(
        {"w": ("F32", [2], struct.pack("<2f", 1.0, -2.5)), "ids": ("I64", [1], b"\xff" * 8)}
    )
    assert "safetensors" in _verify(tmp_path, "model.safetensors", data).detail


@pytest.mark.parametrize(
    ("dtype", "raw"),
    [
        ("F32", struct.pack("<2f", 1.0, float("nan"))),
        ("F16", struct.pack("<2e", 1.0, float("inf"))),
        ("BF16", b"\x80\x3f\x80\xff"),  # 1.0, -inf
        ("F64", struct.pack("<d", float("-inf"))),
    ],
)
def test_safetensors_nonfinite_values_are_found(tmp_path: Path, dtype: str, raw: bytes) -> None:
    shape = [len(raw) // {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}[dtype]]
    data = _safetensors({"ok": ("F32", [1], struct.pack("<f", 0.0)), "bad": (dtype, shape, raw)})
    result = _verify(tmp_path, "model.safetensors", data)
    assert (result.reason, result.detail.endswith("'bad'")) == ("nan_or_inf", True)


def test_truncated_or_garbled_safetensors_fail(tmp_path: Path) -> None:
    data = _safetensors({"w": ("F32", [4], struct.pack("<4f", 1, 2, 3, 4))})
    assert _verify(tmp_path, "m.safetensors", data[:-4]).reason == "truncated"
    garbled = struct.pack("<Q", 5) + b"{oops"
    assert _verify(tmp_path, "m.safetensors", garbled).reason == "tensor_unreadable"


def test_safetensors_whose_shape_needs_more_bytes_than_its_data_fails(tmp_path: Path) -> None:
    # The header claims four F32 values; the file holds two.
    data = _safetensors({"w": ("F32", [4], struct.pack("<2f", 1, 2))})
    result = _verify(tmp_path, "m.safetensors", data)
    assert (result.passed, result.reason) == (False, "tensor_unreadable")
    assert "shape [4] of F32 needs 16 bytes, the header gives 8" in result.detail


# --- user validators and the registry ---------------------------------------------------------


def _refuse_small(path: Path) -> CheckResult | None:
    return None if path.stat().st_size > 4 else CheckResult(False, "too_small", "under 5 bytes")


def _explode(path: Path) -> CheckResult | None:
    raise RuntimeError(f"validator blew up on {path.name}")


def _not_a_result(path: Path) -> Any:
    return True


def test_validators_run_after_builtins_and_report_under_their_name(tmp_path: Path) -> None:
    validators: dict[str, Validator] = {"size_floor": _refuse_small}
    assert _verify(tmp_path, "a.json", b"[1,2,3]", validators=validators).detail.endswith(
        "json, validator:size_floor"
    )
    result = _verify(tmp_path, "b.json", b"[1]", validators=validators)
    assert result == CheckResult(False, "validator:size_floor", "too_small: under 5 bytes")
    assert _verify(tmp_path, "c.json", b"[", validators=validators).reason == "json_invalid"


def test_raising_or_misbehaving_validator_fails_loudly(tmp_path: Path) -> None:
    result = _verify(tmp_path, "a.bin", b"data", validators={"boom": _explode})
    assert result == CheckResult(
        False, "validator:boom", "raised RuntimeError: validator blew up on a.bin"
    )
    wrong = _verify(tmp_path, "a.bin", b"data", validators={"bad": _not_a_result})
    assert (wrong.reason, "expected CheckResult or None" in wrong.detail) == ("validator:bad", True)


def test_validator_notes_on_passing_results_reach_the_detail(tmp_path: Path) -> None:
    note = CheckResult(True, "ok", "looked at it")
    result = _verify(tmp_path, "a.bin", b"data", validators={"n": lambda path: note})
    assert result.detail == "checked size, blake3, validator:n; looked at it"


def test_registered_content_check_is_selected_by_extension(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # The registry is one list every checks module appends to: restore it afterwards.
    registered = list(checks.CONTENT_CHECKS)
    request.addfinalizer(lambda: checks.CONTENT_CHECKS.__setitem__(slice(None), registered))

    @content_check("csv_ragged", ext=".CSV", media="text/csv")
    def _check_csv(path: Path) -> CheckResult | None:
        widths = {line.count(b",") for line in path.read_bytes().splitlines()}
        return None if len(widths) == 1 else CheckResult(False, "csv_ragged", str(widths))

    assert _verify(tmp_path, "t.csv", b"a,b\n1,2\n").detail.endswith("csv")
    assert _verify(tmp_path, "t.csv", b"a,b\n1\n").reason == "csv_ragged"
    assert _verify(tmp_path, "t.dat", b"a,b\n1\n", media_type="text/csv").reason == "csv_ragged"


_FAKE_MODULE = """
from shard_client.checks import CheckResult

def refuse_txt(path):
    if path.suffix == ".txt":
        return CheckResult(False, "no_text", "text artifacts are not allowed")

NOT_CALLABLE = 3
"""
_FAKE_ENTRY_POINTS = """
[shardledger.validators]
no_text = shardledger_fake_validators:refuse_txt
ghost = shardledger_fake_validators_missing:check
inert = shardledger_fake_validators:NOT_CALLABLE

[shardledger.test_duplicates]
dup = shardledger_fake_validators:refuse_txt
"""


def _dist_info(site: Path, name: str, entry_points: str) -> None:
    info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    _write(info, "METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode())
    _write(info, "entry_points.txt", entry_points.encode())


@pytest.fixture
def fake_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Puts two real distributions with entry points, and the module they name, on sys.path."""
    site = tmp_path / "site"
    _write(site, "shardledger_fake_validators.py", _FAKE_MODULE.encode())
    _dist_info(site, "shardledger-fake-validators", _FAKE_ENTRY_POINTS)
    _dist_info(
        site, "shardledger-other-validators", "[shardledger.test_duplicates]\ndup = os:path\n"
    )
    monkeypatch.syspath_prepend(str(site))
    yield site
    sys.modules.pop("shardledger_fake_validators", None)


def test_entry_point_validators_load_from_installed_distributions(
    tmp_path: Path, fake_distribution: Path
) -> None:
    validators = load_entry_point_validators()
    assert {"no_text", "ghost", "inert"} <= validators.keys()
    result = _verify(tmp_path, "notes.txt", b"hello", validators={"no_text": validators["no_text"]})
    assert result == CheckResult(
        False, "validator:no_text", "no_text: text artifacts are not allowed"
    )
    assert _verify(
        tmp_path, "a.bin", b"hello", validators={"no_text": validators["no_text"]}
    ).passed


def test_broken_entry_points_fail_every_artifact_instead_of_vanishing(
    tmp_path: Path, fake_distribution: Path
) -> None:
    validators = load_entry_point_validators()
    ghost = _verify(tmp_path, "a.bin", b"x", validators={"ghost": validators["ghost"]})
    assert ghost.reason == "validator:ghost"
    assert "ModuleNotFoundError" in ghost.detail
    inert = _verify(tmp_path, "a.bin", b"x", validators={"inert": validators["inert"]})
    assert (inert.reason, "not callable" in inert.detail) == ("validator:inert", True)


def test_entry_point_name_claimed_by_two_distributions_fails(
    tmp_path: Path, fake_distribution: Path
) -> None:
    validators = load_entry_point_validators("shardledger.test_duplicates")
    result = _verify(tmp_path, "a.bin", b"x", validators=validators)
    assert (result.reason, "registered twice" in result.detail) == ("validator:dup", True)


def test_unknown_entry_point_group_loads_nothing() -> None:
    assert load_entry_point_validators("shardledger.no_such_group") == {}


# --- robustness --------------------------------------------------------------------------

_NAMES = ["a.bin", "a.json", "a.jsonl", "a.png", "a.jpg", "a.gz", "a.zip", "a.pt", "a.ckpt"]
_NAMES += ["a.npy", "a.npz", "a.safetensors"]
_MAGICS = [b"", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"\x1f\x8b", b"PK\x03\x04", b"\x93NUMPY"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    magic=st.sampled_from(_MAGICS),
    body=st.binary(max_size=512),
    name=st.sampled_from(_NAMES),
    media_type=st.sampled_from(["", "application/json", "image/png", "application/x-torch"]),
    honest_record=st.booleans(),
)
def test_random_bytes_never_crash_verification(
    magic: bytes, body: bytes, name: str, media_type: str, honest_record: bool
) -> None:
    data = magic + body
    with tempfile.TemporaryDirectory() as root:
        _write(Path(root), name, data)
        result = verify_artifact(
            root=root,
            path=name,
            expected_size=len(data) if honest_record else len(data) + 1,
            expected_blake3=_digest(data),
            media_type=media_type,
        )
    assert isinstance(result, CheckResult)
    assert result.reason == "ok" if result.passed else result.reason != "ok"
