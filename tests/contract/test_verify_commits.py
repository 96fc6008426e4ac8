"""Verdicts belong to one commit, and a verifier's own mistakes record nothing (real server, files, reruns)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import blake3
import pytest

from shard_client import Ledger, LedgerClient, plan_events
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.checks import CheckResult, verify_artifact
from shardledger_cli.commands import verify as verify_command
from tests.builders import event, plan_entries, run_cli, started

RUN = "night-17"
np = pytest.importorskip("numpy")


pytestmark = pytest.mark.usefixtures("spool_in_tmp")


@pytest.fixture
def out(tmp_path: Path) -> Path:
    """The directory the jobs write into."""
    path = tmp_path / "out"
    path.mkdir()
    return path


def plan(client: LedgerClient, *shard_ids: str) -> None:
    """Plans shards that each must commit `weights`."""
    client.append(plan_events(RUN, plan_entries(shard_ids, output="weights")))


def weights(shard_id: str, shape: tuple[int, ...] = (4, 3)) -> bytes:
    """Returns a deterministic job's result: the same bytes every time it runs."""
    buffer = io.BytesIO()
    seed = sum(shard_id.encode())
    np.save(buffer, np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + seed)
    return buffer.getvalue()


def run_job(ledger: Ledger, out: Path, shard_id: str, data: bytes | None = None) -> Path:
    """Runs one attempt of a shard through the SDK; it writes weights.npy and commits it."""
    path = out / shard_id / "weights.npy"
    with (
        ledger.shard(RUN, shard_id, fingerprint=False, output_dir=path.parent) as shard,
        shard.atomic_write(path, name="weights") as fh,
    ):
        fh.write(weights(shard_id) if data is None else data)
    return path


def verify(
    capsys: pytest.CaptureFixture[str], target: str, root: Path | str, *extra: str
) -> tuple[int, dict[str, Any], str]:
    """Runs `shardledger verify RUN --root ROOT --json`; returns (exit code, report, stderr)."""
    code, stdout, stderr = run_cli(
        capsys, "verify", RUN, "--root", str(root), "--json", "--server", target, *extra
    )
    return code, (json.loads(stdout) if stdout else {}), stderr


def states(client: LedgerClient) -> dict[str, str]:
    """Returns shard id -> state, as `shardledger shards` shows it."""
    return {s.shard_id: s.state for s in client.shards(RUN)}


def resume(capsys: pytest.CaptureFixture[str], target: str) -> list[str]:
    """Returns the resume list as `shardledger resume --format ids` prints it."""
    _, stdout, _ = run_cli(capsys, "resume", RUN, "--format", "ids", "--server", target)
    return stdout.split()


def verdicts(client: LedgerClient) -> list[pb.ShardEvent]:
    """Returns the run's verified events."""
    return [e for e in client.list_events(RUN) if e.HasField("verified")]


def status(capsys: pytest.CaptureFixture[str], target: str) -> dict[str, Any]:
    """Returns `shardledger status RUN --json`."""
    _, stdout, _ = run_cli(capsys, "status", RUN, "--json", "--server", target)
    return dict(json.loads(stdout))


# --- observation 1: a correct rerun inherits no old failure --------------------------------


@pytest.mark.parametrize("damage", ["truncate", "bit-flip"])
def test_a_rerun_of_identical_bytes_after_corruption_is_checked_and_passes(
    ledger: Ledger,
    client: LedgerClient,
    target: str,
    out: Path,
    capsys: pytest.CaptureFixture[str],
    damage: str,
) -> None:
    plan(client, "s0", "s1")
    path = run_job(ledger, out, "s0")
    run_job(ledger, out, "s1")
    good = path.read_bytes()
    # The file rotted after its job ended.
    path.write_bytes(good[:-7] if damage == "truncate" else good[:-1] + bytes([good[-1] ^ 1]))
    code, report, _ = verify(capsys, target, out)
    assert code == 1
    [failure] = report["failures"]
    reason = "size_mismatch" if damage == "truncate" else "digest_mismatch"
    assert (failure["shard_id"], failure["reason"]) == ("s0", reason)
    assert states(client)["s0"] == "verify_failed"
    assert resume(capsys, target) == ["s0"]

    assert run_job(ledger, out, "s0").read_bytes() == good  # the rerun: same bytes, same path
    code, report, _ = verify(capsys, target, out)
    assert code == 0, report["failures"]
    assert (report["checked"], report["passed"], report["skipped"]) == (1, 1, 2)
    assert (report["skipped_failed"], report["older_failed"]) == (0, 1)
    rerun = [e for e in verdicts(client) if e.shard_id == "s0"][-1]
    assert rerun.verified.result == pb.VERIFICATION_RESULT_PASSED
    assert rerun.attempt_id not in ("", failure["attempt_id"])
    assert states(client) == {"s0": "verified", "s1": "verified"}
    assert status(capsys, target)["verified"] == 2
    assert resume(capsys, target) == []
    code, report, _ = verify(capsys, target, out)  # and it stays so
    assert (code, report["checked"], report["skipped"]) == (0, 0, 3)


def test_recheck_reads_commits_that_already_have_a_verdict(
    ledger: Ledger,
    client: LedgerClient,
    target: str,
    out: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    plan(client, "s0")
    path = run_job(ledger, out, "s0")
    assert verify(capsys, target, out)[0] == 0
    path.write_bytes(b"\0" + path.read_bytes()[1:])  # bit rot after the first verify
    code, report, _ = verify(capsys, target, out)
    assert (code, report["checked"], report["skipped"]) == (0, 0, 1)  # no read without --recheck
    code, report, _ = verify(capsys, target, out, "--recheck")
    assert (code, report["checked"], report["failures"][0]["reason"]) == (1, 1, "digest_mismatch")
    assert states(client)["s0"] == "verify_failed"


def test_two_attempts_committing_identical_bytes_get_one_read_and_a_verdict_each(
    client: LedgerClient, target: str, out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A zombie and its retry both rename the same deterministic bytes onto one path.
    plan(client, "s0")
    data = weights("s0")
    (out / "w.npy").write_bytes(data)
    digest = blake3.blake3(data).hexdigest()
    commit = pb.ArtifactCommitted(
        name="weights", path="w.npy", size_bytes=len(data), blake3_hex=digest
    )
    for attempt in ("a1", "a2"):
        client.append(
            [started(RUN, "s0", attempt), event(RUN, "s0", attempt, artifact_committed=commit)]
        )
    code, report, _ = verify(capsys, target, out)
    assert (code, report["checked"], report["read"], report["appended"]) == (0, 2, 1, 2)
    assert sorted(e.attempt_id for e in verdicts(client)) == ["a1", "a2"]
    assert verify(capsys, target, out)[1]["appended"] == 0  # idempotent


def test_a_recommit_of_the_same_bytes_by_the_same_attempt_needs_its_own_verdict(
    client: LedgerClient, target: str, out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan(client, "s0")
    data = weights("s0")
    (out / "w.npy").write_bytes(data)
    digest = blake3.blake3(data).hexdigest()
    commit = pb.ArtifactCommitted(
        name="weights", path="w.npy", size_bytes=len(data), blake3_hex=digest
    )
    client.append([started(RUN, "s0", "a1"), event(RUN, "s0", "a1", artifact_committed=commit)])
    assert verify(capsys, target, out)[1]["appended"] == 1
    client.append([event(RUN, "s0", "a1", artifact_committed=commit)])
    code, report, _ = verify(capsys, target, out)
    assert (code, report["checked"], report["appended"]) == (0, 1, 1)


def test_an_older_attempts_failure_does_not_fail_verify_once_a_later_commit_passes(
    ledger: Ledger,
    client: LedgerClient,
    target: str,
    out: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    plan(client, "s0")
    first = run_job(ledger, out, "s0", data=weights("s0", (0, 3)))  # empty: a silent error
    second = out / "s0-rerun" / "weights.npy"
    with (
        ledger.shard(RUN, "s0", fingerprint=False, output_dir=second.parent) as shard,
        shard.atomic_write(second, name="weights") as fh,
    ):
        fh.write(weights("s0"))
    code, report, _ = verify(capsys, target, out)
    assert code == 0
    [older] = report["failures"]
    assert (older["path"], older["reason"], older["current"]) == (str(first), "empty", False)
    _, text, _ = run_cli(capsys, "verify", RUN, "--root", str(out), "--server", target)
    assert "1 failed commits replaced by a later commit" in text
    assert "use --recheck" not in text


def test_a_legacy_verdict_without_an_attempt_covers_only_the_commits_before_it(
    client: LedgerClient, target: str, out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan(client, "s0")
    data = weights("s0")
    (out / "w.npy").write_bytes(data)
    digest = blake3.blake3(data).hexdigest()
    commit = pb.ArtifactCommitted(
        name="weights", path="w.npy", size_bytes=len(data), blake3_hex=digest
    )
    legacy = pb.ArtifactVerified(
        name="weights", path="w.npy", blake3_hex=digest, result=pb.VERIFICATION_RESULT_PASSED
    )
    client.append([started(RUN, "s0", "a1"), event(RUN, "s0", "a1", artifact_committed=commit)])
    client.append([event(RUN, "s0", "", verified=legacy)])
    client.append([started(RUN, "s0", "a2"), event(RUN, "s0", "a2", artifact_committed=commit)])
    code, report, _ = verify(capsys, target, out)
    assert (code, report["checked"], report["skipped"]) == (0, 1, 1)
    assert [e.attempt_id for e in verdicts(client)] == ["", "a2"]


# --- observation 2: a verifier's own mistakes record nothing ---------------------------------


@pytest.mark.parametrize("wrong", ["missing-dir", "empty-dir", "a-file"])
def test_a_wrong_root_records_nothing_and_the_right_root_then_verifies_everything(
    ledger: Ledger,
    client: LedgerClient,
    target: str,
    out: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    wrong: str,
) -> None:
    plan(client, "s0", "s1", "s2")
    for shard_id in ("s0", "s1", "s2"):
        run_job(ledger, out, shard_id)
    root = tmp_path / "wrong"
    if wrong == "empty-dir":
        root.mkdir()
    elif wrong == "a-file":
        root.write_text("not a directory")
    code, report, stderr = verify(capsys, target, root)
    assert code == 5
    assert verdicts(client) == []
    said = {
        "missing-dir": "does not exist",
        "a-file": "is not a directory",
        # The SDK records absolute paths, so each lies outside a root elsewhere.
        "empty-dir": "holds none of the run's 3 artifact files (3 commits): is it the right"
        " directory? (all 3 lie"
        f" outside it, under {out})",
    }
    assert said[wrong] in stderr
    assert status(capsys, target)["verified"] == 0
    assert set(states(client).values()) == {"unverified"}
    assert resume(capsys, target) == ["s0", "s1", "s2"]  # unverified, never verify-failed

    code, report, _ = verify(capsys, target, out)
    assert (code, report["checked"], report["passed"]) == (0, 3, 3)
    assert status(capsys, target)["verified"] == 3
    assert resume(capsys, target) == []


def test_a_root_holding_none_of_the_runs_relative_paths_is_refused(
    client: LedgerClient, target: str, out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan(client, "s0", "s1")
    for shard_id in ("s0", "s1"):
        data = weights(shard_id)
        (out / f"{shard_id}.npy").write_bytes(data)
        digest = blake3.blake3(data).hexdigest()
        commit = pb.ArtifactCommitted(
            name="weights", path=f"{shard_id}.npy", size_bytes=len(data), blake3_hex=digest
        )
        client.append(
            [started(RUN, shard_id, "a1"), event(RUN, shard_id, "a1", artifact_committed=commit)]
        )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code, report, stderr = verify(capsys, target, elsewhere)
    assert (code, report) == (5, {})
    assert (
        f"--root {elsewhere} holds none of the run's 2 artifact files (2 commits): is it the"
        " right directory?" in stderr
    )
    assert verdicts(client) == []
    assert verify(capsys, target, out)[0] == 0


def test_an_artifact_outside_the_root_is_not_checked_and_gets_no_verdict(
    ledger: Ledger,
    client: LedgerClient,
    target: str,
    out: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    plan(client, "s0", "s1")
    run_job(ledger, out, "s0")
    # A FIFO outside the root: opening it would hang, so a verify that returns never read it.
    fifo = tmp_path / "elsewhere" / "s1.fifo"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    digest = "c" * 64
    commit = pb.ArtifactCommitted(name="weights", path=str(fifo), size_bytes=3, blake3_hex=digest)
    client.append([started(RUN, "s1", "a1"), event(RUN, "s1", "a1", artifact_committed=commit)])
    code, report, stderr = verify(capsys, target, out)
    assert code == 5
    assert (report["passed"], report["failed"], report["not_checked"]) == (1, 0, 1)
    [unchecked] = report["unchecked"]
    assert (unchecked["shard_id"], unchecked["reason"]) == ("s1", "outside_root")
    assert [e.shard_id for e in verdicts(client)] == ["s0"]
    assert f"they lie under {fifo.parent}" in stderr and "nothing was recorded" in stderr
    assert states(client)["s1"] == "unverified"
    _, text, _ = run_cli(
        capsys, "verify", RUN, "--root", str(out), "--server", target, "--format", "table"
    )
    assert f"NOT CHECKED s1 a1 weights {fifo} outside_root" in text
    _, text, _ = run_cli(capsys, "verify", RUN, "--root", str(out), "--server", target)
    assert f"NOT CHECKED\ts1\ta1\tweights\t{fifo}\toutside_root\t" in text


def test_outside_root_verdicts_of_an_older_verifier_are_read_again(
    client: LedgerClient, target: str, out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan(client, "s0")
    data = weights("s0")
    (out / "w.npy").write_bytes(data)
    digest = blake3.blake3(data).hexdigest()
    commit = pb.ArtifactCommitted(
        name="weights", path="w.npy", size_bytes=len(data), blake3_hex=digest
    )
    poisoned = pb.ArtifactVerified(
        name="weights",
        path="w.npy",
        blake3_hex=digest,
        result=pb.VERIFICATION_RESULT_FAILED,
        reason="outside_root",
    )
    client.append([started(RUN, "s0", "a1"), event(RUN, "s0", "a1", artifact_committed=commit)])
    client.append([event(RUN, "s0", "", verified=poisoned)])
    code, report, _ = verify(capsys, target, out)
    assert (code, report["checked"], report["skipped"]) == (0, 1, 0)
    assert states(client)["s0"] == "verified"


def test_an_unreadable_root_is_refused_before_anything_is_recorded(
    ledger: Ledger,
    client: LedgerClient,
    target: str,
    out: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan(client, "s0")
    run_job(ledger, out, "s0")
    real_scandir = os.scandir

    def denied(path: Any = ".") -> Any:
        # chmod cannot stop root, who runs these tests in CI, so the kernel's answer is staged.
        if os.fspath(path) == str(out):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", denied)
    code, _, stderr = verify(capsys, target, out)
    assert code == 5
    assert f"--root {out} cannot be read: Permission denied" in stderr
    assert verdicts(client) == []


def test_an_artifact_the_verifier_may_not_read_is_not_checked(
    ledger: Ledger,
    client: LedgerClient,
    target: str,
    out: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan(client, "s0", "s1")
    run_job(ledger, out, "s0")
    locked = run_job(ledger, out, "s1")
    real = verify_artifact

    def as_another_user(**kwargs: Any) -> CheckResult:
        if kwargs["path"] == str(locked):
            return CheckResult(False, "permission_denied", f"may not read {locked}")
        return real(**kwargs)

    monkeypatch.setattr(verify_command, "verify_artifact", as_another_user)
    code, report, _ = verify(capsys, target, out)
    assert (code, report["passed"], report["not_checked"]) == (5, 1, 1)
    assert [e.shard_id for e in verdicts(client)] == ["s0"]


# --- observation 3: an empty result fails ---------------------------------------------------


def test_a_committed_zero_element_npy_is_verify_failed_empty(
    ledger: Ledger,
    client: LedgerClient,
    target: str,
    out: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    plan(client, "s0")
    run_job(ledger, out, "s0", data=weights("s0", (0, 3)))
    code, report, _ = verify(capsys, target, out)
    assert code == 1
    [failure] = report["failures"]
    assert (failure["reason"], failure["detail"]) == ("empty", "0-element array float32 (0, 3)")
    assert states(client)["s0"] == "verify_failed"
    _, stdout, _ = run_cli(capsys, "resume", RUN, "--json", "--server", target)
    assert json.loads(stdout)["reason"] == "verify_failed:empty"
