"""Behaviour of the atomic commit recipe on a real filesystem."""

from __future__ import annotations

import io
import os
import stat
import time
from pathlib import Path

import blake3
import pytest

from shard_client import atomic
from shard_client.atomic import (
    FAILPOINTS,
    MMAP_HASH_THRESHOLD,
    TEMP_PREFIX,
    CommitInfo,
    atomic_replace,
    atomic_write,
    cleanup_orphans,
    commit_file,
    hash_file,
    reserve_temp_path,
)


class InjectedFault(Exception):
    """Raised by a test failpoint."""


def temp_files(directory: Path) -> list[str]:
    """Returns the names of leftover temp files in a directory."""
    return sorted(name for name in os.listdir(directory) if name.startswith(TEMP_PREFIX))


def digest(data: bytes) -> str:
    """Returns the BLAKE3 hex digest of bytes."""
    return blake3.blake3(data).hexdigest()


def test_atomic_write_commits_bytes_and_reports_size_and_digest(tmp_path: Path) -> None:
    seen: list[CommitInfo] = []
    target = tmp_path / "out.bin"
    payload = os.urandom(300_000)

    with atomic_write(target, on_commit=seen.append) as f:
        f.write(payload[:1000])
        f.write(memoryview(payload)[1000:])

    expected = CommitInfo(path=str(target), size_bytes=len(payload), blake3_hex=digest(payload))
    assert target.read_bytes() == payload
    assert seen == [expected]
    assert f.commit_info == expected
    assert hash_file(target) == (len(payload), digest(payload))
    assert temp_files(tmp_path) == []


def test_digest_follows_the_file_whatever_mix_of_chunks_is_written(tmp_path: Path) -> None:
    # Large bytes chunks may hash after their write returns; a reused bytearray must
    # be hashed before it is refilled; small writes go through the buffer. The digest
    # must be the file's in every interleaving.
    target = tmp_path / "mixed.bin"
    chunks = [os.urandom(n) for n in (10, 300_000, 5, 1 << 20, 700_000, 3)]
    reused = bytearray(400_000)
    expected = bytearray()
    with atomic_write(target) as f:
        for round_ in range(12):
            for chunk in chunks:
                f.write(chunk)
                expected += chunk
            reused[:] = bytes([round_]) * len(reused)
            f.write(reused)
            expected += reused
            wide = memoryview(chunks[3]).cast("I")  # nbytes, not len, decides the path
            f.write(wide)
            expected += chunks[3]
    assert target.read_bytes() == expected
    assert f.commit_info.size_bytes == len(expected)
    assert f.commit_info.blake3_hex == digest(bytes(expected))


def test_large_text_writes_hash_the_encoded_bytes(tmp_path: Path) -> None:
    target = tmp_path / "big.txt"
    text = "ledger-\u00e9\u4e2d " * 200_000
    with atomic_write(target, mode="w") as f:
        f.write(text)
        f.write(text)
    data = (text + text).encode("utf-8")
    assert target.read_bytes() == data
    assert f.commit_info.blake3_hex == digest(data)


def test_atomic_write_reports_absolute_normalized_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)

    with atomic_write("sub/../sub/./x.bin") as f:
        f.write(b"x")

    assert f.commit_info.path == str(tmp_path / "sub" / "x.bin")


def test_text_mode_writes_utf8_and_hashes_the_encoded_bytes(tmp_path: Path) -> None:
    target = tmp_path / "notes.txt"

    with atomic_write(target, mode="w") as f:
        f.write("grüße\n")

    encoded = "grüße\n".encode()
    assert target.read_bytes() == encoded
    assert f.commit_info.size_bytes == len(encoded)
    assert f.commit_info.blake3_hex == digest(encoded)


def test_empty_write_commits_an_empty_file(tmp_path: Path) -> None:
    with atomic_write(tmp_path / "empty") as f:
        pass

    assert (tmp_path / "empty").read_bytes() == b""
    assert f.commit_info.blake3_hex == digest(b"")


def test_target_keeps_old_contents_until_the_block_exits(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_bytes(b"old")

    with atomic_write(target) as f:
        f.write(b"new contents")
        f.flush()
        assert target.read_bytes() == b"old"

    assert target.read_bytes() == b"new contents"


def test_exception_in_block_removes_temp_keeps_old_file_and_skips_on_commit(
    tmp_path: Path,
) -> None:
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    seen: list[CommitInfo] = []

    with pytest.raises(InjectedFault), atomic_write(target, on_commit=seen.append) as f:
        f.write(b"partial")
        raise InjectedFault

    assert target.read_bytes() == b"old"
    assert seen == []
    assert temp_files(tmp_path) == []
    with pytest.raises(RuntimeError, match="not committed"):
        _ = f.commit_info


@pytest.mark.parametrize("point", ["after_write", "after_fsync"])
def test_fault_before_rename_removes_temp_and_skips_on_commit(tmp_path: Path, point: str) -> None:
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    seen: list[CommitInfo] = []

    def fail(name: str) -> None:
        if name == point:
            raise InjectedFault(name)

    with (
        pytest.raises(InjectedFault, match=point),
        atomic_write(target, on_commit=seen.append, failpoint=fail) as f,
    ):
        f.write(b"new")

    assert target.read_bytes() == b"old"
    assert seen == []
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize("point", ["after_rename", "after_dir_fsync"])
def test_fault_after_rename_leaves_complete_file_but_reports_no_commit(
    tmp_path: Path, point: str
) -> None:
    target = tmp_path / "out.bin"
    seen: list[CommitInfo] = []

    def fail(name: str) -> None:
        if name == point:
            raise InjectedFault(name)

    with (
        pytest.raises(InjectedFault),
        atomic_write(target, on_commit=seen.append, failpoint=fail) as f,
    ):
        f.write(b"new")

    assert target.read_bytes() == b"new"
    assert seen == []
    assert temp_files(tmp_path) == []


def test_failpoints_fire_in_recipe_order(tmp_path: Path) -> None:
    fired: list[str] = []

    with atomic_write(tmp_path / "x", failpoint=fired.append) as f:
        f.write(b"x")

    assert tuple(fired) == FAILPOINTS


def test_rename_onto_existing_directory_fails_cleanly(tmp_path: Path) -> None:
    target = tmp_path / "occupied"
    target.mkdir()
    seen: list[CommitInfo] = []

    with pytest.raises(IsADirectoryError), atomic_write(target, on_commit=seen.append) as f:
        f.write(b"data")

    assert target.is_dir()
    assert seen == []
    assert temp_files(tmp_path) == []


def test_missing_directory_raises_without_creating_anything(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError), atomic_write(tmp_path / "nope" / "x"):
        pytest.fail("block must not run")

    assert os.listdir(tmp_path) == []


def test_on_commit_error_propagates_after_the_file_is_committed(tmp_path: Path) -> None:
    target = tmp_path / "x"

    def explode(info: CommitInfo) -> None:
        raise InjectedFault(info.path)

    with pytest.raises(InjectedFault), atomic_write(target, on_commit=explode) as f:
        f.write(b"done")

    assert target.read_bytes() == b"done"
    assert f.commit_info.size_bytes == 4


def test_closing_the_handle_inside_the_block_still_commits(tmp_path: Path) -> None:
    with atomic_write(tmp_path / "x") as f:
        f.write(b"abc")
        f.close()

    assert (tmp_path / "x").read_bytes() == b"abc"
    assert f.commit_info.size_bytes == 3


def test_handle_refuses_to_seek_because_the_digest_follows_the_stream(tmp_path: Path) -> None:
    with atomic_write(tmp_path / "x") as f:
        f.write(b"abc")
        assert f.tell() == 3
        assert not f.seekable()
        with pytest.raises(io.UnsupportedOperation):
            f.seek(0)


def test_committed_file_gets_umask_permissions_not_mkstemp_0600(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        with atomic_write(tmp_path / "x") as f:
            f.write(b"x")
    finally:
        os.umask(old)

    assert stat.S_IMODE((tmp_path / "x").stat().st_mode) == 0o640


def test_unsupported_mode_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="modes"), atomic_write(tmp_path / "x", mode="ab"):
        pass


@pytest.mark.parametrize("size", [0, 1, MMAP_HASH_THRESHOLD - 1, MMAP_HASH_THRESHOLD + 12345])
def test_hash_file_matches_blake3_of_contents_on_both_read_paths(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    path = tmp_path / "blob"
    path.write_bytes(data)

    assert hash_file(path) == (size, digest(data))


def test_commit_file_hashes_existing_file_and_reports_it(tmp_path: Path) -> None:
    path = tmp_path / "written-by-someone-else.bin"
    path.write_bytes(b"payload")
    seen: list[CommitInfo] = []

    info = commit_file(path, on_commit=seen.append)

    assert info == CommitInfo(path=str(path), size_bytes=7, blake3_hex=digest(b"payload"))
    assert seen == [info]


def test_atomic_replace_moves_temp_over_target_and_reports_commit(tmp_path: Path) -> None:
    final = tmp_path / "model.pt"
    final.write_bytes(b"old")
    tmp = reserve_temp_path(final)
    Path(tmp).write_bytes(b"new model")
    seen: list[CommitInfo] = []

    info = atomic_replace(tmp, final, on_commit=seen.append)

    assert final.read_bytes() == b"new model"
    assert not os.path.exists(tmp)
    assert seen == [info]
    assert info == CommitInfo(path=str(final), size_bytes=9, blake3_hex=digest(b"new model"))


def test_atomic_replace_failure_keeps_temp_for_the_caller(tmp_path: Path) -> None:
    final = tmp_path / "occupied"
    final.mkdir()
    tmp = reserve_temp_path(final)
    seen: list[CommitInfo] = []

    with pytest.raises(IsADirectoryError):
        atomic_replace(tmp, final, on_commit=seen.append)

    assert os.path.exists(tmp)
    assert seen == []


def test_reserve_temp_path_creates_prefixed_file_beside_target(tmp_path: Path) -> None:
    tmp = reserve_temp_path(tmp_path / ("long" * 80 + ".pt"))

    assert os.path.dirname(tmp) == str(tmp_path)
    assert os.path.basename(tmp).startswith(TEMP_PREFIX)
    assert os.path.getsize(tmp) == 0


def test_a_long_utf8_name_that_fits_name_max_is_written(tmp_path: Path) -> None:
    # 81 CJK characters: 243 bytes, a valid name; a stem cut by characters overflowed.
    target = tmp_path / ("检" * 81)
    assert len(os.fsencode(target.name)) == 243
    with atomic_write(target) as f:
        f.write(b"data")
    assert target.read_bytes() == b"data"
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


def test_cleanup_orphans_removes_only_temp_files(tmp_path: Path) -> None:
    orphan = tmp_path / f"{TEMP_PREFIX}ckpt.pt.abc123"
    orphan.write_bytes(b"torn")
    (tmp_path / "ckpt.pt").write_bytes(b"keep")
    (tmp_path / f"{TEMP_PREFIX}dir").mkdir()
    (tmp_path / f"{TEMP_PREFIX}link").symlink_to(tmp_path / "ckpt.pt")

    removed = cleanup_orphans(tmp_path)

    assert removed == [str(orphan)]
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["ckpt.pt", f"{TEMP_PREFIX}dir", f"{TEMP_PREFIX}link"]
    )


def test_cleanup_orphans_spares_recent_temp_files_when_asked(tmp_path: Path) -> None:
    old = tmp_path / f"{TEMP_PREFIX}old"
    old.write_bytes(b"")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    fresh = tmp_path / f"{TEMP_PREFIX}fresh"
    fresh.write_bytes(b"")

    assert cleanup_orphans(tmp_path, older_than_s=60) == [str(old)]
    assert fresh.exists()


def test_makedirs_durable_fsyncs_each_new_directory_into_its_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real = atomic.fsync_directory

    def recording(directory: str | os.PathLike[str]) -> None:
        synced.append(os.fspath(directory))
        real(directory)

    monkeypatch.setattr(atomic, "fsync_directory", recording)
    target = tmp_path / "a" / "b" / "c"
    atomic.makedirs_durable(target)
    assert target.is_dir()
    # Outermost first, so each entry is durable before anything is made inside it.
    assert synced == [str(tmp_path), str(tmp_path / "a"), str(tmp_path / "a" / "b")]
    synced.clear()
    atomic.makedirs_durable(target)  # already there: nothing to make durable again
    assert synced == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError):
        atomic.makedirs_durable(tmp_path / "file")
