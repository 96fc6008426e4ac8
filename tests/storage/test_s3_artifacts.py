"""Artifacts in object storage against a real S3 endpoint: commit, read back, races, tampering, verify."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import blake3
import pytest
import s3fs

from shard_client import Ledger
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from shard_client.errors import NotFound
from shard_client.ids import plan_events
from shard_client.remote import NotConfirmed, UploadPolicy
from shard_client.storage import ObjectExists
from tests.builders import plan_entries, run_cli
from tests.storage.conftest import BUCKET

RUN = "s3-night"
REPO = Path(__file__).resolve().parents[2]
FAST = UploadPolicy(first_delay_s=0.01, max_delay_s=0.05, attempts=4)


def plan(client: LedgerClient, *shard_ids: str, run: str = RUN) -> None:
    """Registers shards that expect one artifact, "weights"."""
    client.append(plan_events(run, plan_entries(shard_ids, output="weights")))


def events(client: LedgerClient, kind: str, run: str = RUN) -> list[pb.ShardEvent]:
    """Returns the run's events of one kind."""
    return [e for e in client.list_events(run) if e.WhichOneof("payload") == kind]


def url_of(shard_id: str, name: str = "weights.bin") -> str:
    """Returns the artifact URL of a shard in the test bucket."""
    return f"s3://{BUCKET}/{RUN}/{shard_id}/{name}"


def key_of(url: str) -> str:
    """Returns the key part of a test URL."""
    return url.split("/", 3)[3]


def verify(
    capsys: pytest.CaptureFixture[str], target: str, run: str = RUN
) -> tuple[int, dict[str, Any]]:
    """Runs `shardledger verify RUN --json` and returns its exit code and report."""
    code, out, _ = run_cli(capsys, "verify", run, "--json", "--server", target)
    return code, json.loads(out)


def reasons(client: LedgerClient, run: str = RUN) -> list[str]:
    """Returns the reasons of the run's verdicts, in log order ("" for PASSED)."""
    return [e.verified.reason for e in events(client, "verified", run)]


def test_atomic_write_to_s3_records_url_size_digest_version_and_etag_after_read_back(
    ledger: Ledger, client: LedgerClient, s3: Any, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    plan(client, "a")
    data = os.urandom(200_000)
    with (
        ledger.shard(RUN, "a", fingerprint=False) as shard,
        shard.atomic_write(url_of("a"), name="weights") as f,
    ):
        f.write(data)
    [commit] = events(client, "artifact_committed")
    a = commit.artifact_committed
    head = s3.head_object(Bucket=BUCKET, Key=key_of(url_of("a")))
    assert (a.path, a.size_bytes, a.blake3_hex) == (
        url_of("a"),
        len(data),
        blake3.blake3(data).hexdigest(),
    )
    assert (a.version_id, a.etag) == (head["VersionId"], head["ETag"].strip('"'))
    assert a.read_back == "digest"  # small files are re-read in full
    code, report = verify(capsys, target)
    assert code == 0, report
    assert reasons(client) == [""]
    assert events(client, "verified")[0].verified.version_id == a.version_id


def test_large_artifact_goes_up_in_parts_and_is_confirmed_by_size_and_etag(
    ledger: Ledger, client: LedgerClient, s3: Any, tmp_path: Path
) -> None:
    plan(client, "big")
    staging = tmp_path / "staging"
    staging.mkdir()
    policy = UploadPolicy(
        part_size=5 * 1024 * 1024, digest_under_bytes=1024, staging_dir=str(staging)
    )
    data = os.urandom(12 * 1024 * 1024)
    with (
        ledger.shard(RUN, "big", fingerprint=False) as shard,
        shard.atomic_write(url_of("big"), name="weights", upload=policy) as f,
    ):
        f.write(data)
    a = events(client, "artifact_committed")[0].artifact_committed
    assert a.etag.endswith("-3")  # three parts
    assert a.read_back == "size_etag"
    body = s3.get_object(Bucket=BUCKET, Key=key_of(url_of("big")))["Body"].read()
    assert blake3.blake3(body).hexdigest() == a.blake3_hex
    assert os.listdir(staging) == []  # the staged file is gone once confirmed


def test_job_killed_mid_upload_leaves_nothing_at_the_key_and_nothing_committed(
    client: LedgerClient, s3: Any, target: str, tmp_path: Path
) -> None:
    plan(client, "torn")
    marker = tmp_path / "uploading"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "SHARDLEDGER_SERVER": target,
        "SHARDLEDGER_SPOOL_DIR": str(tmp_path / "spool"),
    }
    helper = REPO / "tests" / "helpers" / "s3_torn_upload.py"
    with subprocess.Popen(
        [sys.executable, str(helper), RUN, "torn", url_of("torn"), str(marker)], env=env
    ) as proc:
        deadline = time.monotonic() + 60
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the helper never reached the upload"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{RUN}/torn/")
    # The incomplete multipart upload is invisible to readers (a lifecycle rule reclaims it).
    uploads = s3.list_multipart_uploads(Bucket=BUCKET, Prefix=f"{RUN}/torn/").get("Uploads", [])
    assert [u["Key"] for u in uploads] == [key_of(url_of("torn"))]
    assert events(client, "artifact_committed") == []
    assert len(events(client, "started")) == 1


def test_two_attempts_racing_to_one_key_record_exactly_one_winner(
    ledger: Ledger, client: LedgerClient, s3: Any
) -> None:
    plan(client, "race")
    url = url_of("race")
    with pytest.raises(ObjectExists), ledger.shard(RUN, "race", fingerprint=False) as first:
        writer = first.atomic_write(url, name="weights")
        writer.__enter__().write(b"first attempt's bytes")
        # A second attempt (a retry racing a zombie) closes its file first: the store
        # accepts its upload, and the first attempt's conditional write is refused.
        with (
            ledger.shard(RUN, "race", fingerprint=False) as second,
            second.atomic_write(url, name="weights") as g,
        ):
            g.write(b"second attempt's bytes")
        writer.__exit__(None, None, None)
    winners = [
        (e.attempt_id, e.artifact_committed.path) for e in events(client, "artifact_committed")
    ]
    assert winners == [(second.attempt_id, url)]
    body = s3.get_object(Bucket=BUCKET, Key=key_of(url))["Body"].read()
    assert body == b"second attempt's bytes"
    [failed] = events(client, "failed")
    assert failed.attempt_id == first.attempt_id
    assert "already exists: another attempt committed it first" in failed.failed.message


def test_replaced_and_deleted_objects_fail_verify_with_version_mismatch_and_missing(
    ledger: Ledger, client: LedgerClient, s3: Any, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    plan(client, "kept", "swapped", "gone")
    for shard_id in ("kept", "swapped", "gone"):
        with (
            ledger.shard(RUN, shard_id, fingerprint=False) as shard,
            shard.atomic_write(url_of(shard_id), name="weights") as f,
        ):
            f.write(f"weights of {shard_id}".encode())
    s3.put_object(Bucket=BUCKET, Key=key_of(url_of("swapped")), Body=b"someone else's bytes")
    s3.delete_object(Bucket=BUCKET, Key=key_of(url_of("gone")))
    code, _ = verify(capsys, target)
    assert code == 1
    found = {e.shard_id: e.verified.reason for e in events(client, "verified")}
    assert found == {"kept": "", "swapped": "version_mismatch", "gone": "missing"}


class StaleS3(s3fs.S3FileSystem):  # type: ignore[misc]
    """s3fs whose first read-backs see a stale object: an old ETag, then old bytes.

    `stale_heads` HEADs answer with another ETag and size; then `stale_gets` GETs
    serve the bytes of `stale_key` instead of the object asked for.
    """

    stale_heads = 0
    stale_gets = 0
    stale_key = ""
    calls: ClassVar[list[str]] = []

    async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        type(self).calls.append(method)
        if method == "head_object" and type(self).stale_heads > 0:
            type(self).stale_heads -= 1
            answer = await super()._call_s3(method, *args, **kwargs)
            return {
                **answer,
                "ETag": '"0123456789abcdef"',
                "ContentLength": answer["ContentLength"] // 2,
            }
        if method == "get_object" and type(self).stale_gets > 0:
            type(self).stale_gets -= 1
            return await super()._call_s3(method, Bucket=kwargs["Bucket"], Key=type(self).stale_key)
        return await super()._call_s3(method, *args, **kwargs)


@pytest.fixture
def stale_s3(s3: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[type[StaleS3]]:
    """Routes s3:// through StaleS3 for one test."""
    # fsspec.registry is a read-only view; the module's _registry is what lookups consult.
    monkeypatch.setitem(sys.modules["fsspec.registry"]._registry, "s3", StaleS3)
    StaleS3.calls = []
    s3.put_object(Bucket=BUCKET, Key="stale/old.bin", Body=b"an older, shorter object")
    StaleS3.stale_key = "stale/old.bin"
    yield StaleS3
    StaleS3.stale_heads = StaleS3.stale_gets = 0
    StaleS3.clear_instance_cache()


def test_stale_read_back_is_retried_with_backoff_and_committed_only_when_it_matches(
    ledger: Ledger, client: LedgerClient, stale_s3: type[StaleS3]
) -> None:
    plan(client, "eventual")
    stale_s3.stale_heads, stale_s3.stale_gets = 2, 1
    with (
        ledger.shard(RUN, "eventual", fingerprint=False) as shard,
        shard.atomic_write(url_of("eventual"), name="weights", upload=FAST) as f,
    ):
        f.write(b"the new weights")
    # Two stale HEADs, a good HEAD with a stale GET, then a good HEAD and GET.
    reads = [c for c in stale_s3.calls if c in ("head_object", "get_object")]
    assert reads == ["head_object"] * 3 + ["get_object", "head_object", "get_object"]
    a = events(client, "artifact_committed")[0].artifact_committed
    assert (a.read_back, a.blake3_hex) == ("digest", blake3.blake3(b"the new weights").hexdigest())


def test_read_back_that_never_matches_gives_up_commits_nothing_and_keeps_the_staged_bytes(
    ledger: Ledger, client: LedgerClient, stale_s3: type[StaleS3], tmp_path: Path
) -> None:
    plan(client, "never")
    stale_s3.stale_heads = 100
    policy = UploadPolicy(
        first_delay_s=0.01, max_delay_s=0.05, attempts=4, staging_dir=str(tmp_path)
    )
    with (
        pytest.raises(NotConfirmed, match="not confirmed after 4 read-backs") as caught,
        ledger.shard(RUN, "never", fingerprint=False) as shard,
        shard.atomic_write(url_of("never"), name="weights", upload=policy) as f,
    ):
        f.write(b"bytes the store will not show")
    assert events(client, "artifact_committed") == []
    assert "not confirmed" in events(client, "failed")[0].failed.message
    staged = caught.value.staged_path
    assert Path(staged).read_bytes() == b"bytes the store will not show"
    # The store catches up: a new attempt commits the kept bytes without recomputing them.
    stale_s3.stale_heads = 0
    with ledger.shard(RUN, "never", fingerprint=False) as retry:
        info = retry.commit(url_of("never"), name="weights", source=staged, upload=policy)
    assert info.blake3_hex == blake3.blake3(b"bytes the store will not show").hexdigest()
    assert not Path(staged).exists()  # committed: the staged copy is no longer needed
    assert len(events(client, "artifact_committed")) == 1


def test_commit_of_an_object_the_job_uploaded_itself_reads_it_in_full(
    ledger: Ledger, client: LedgerClient, s3: Any
) -> None:
    plan(client, "own")
    s3.put_object(Bucket=BUCKET, Key=key_of(url_of("own")), Body=b"uploaded by the job's own code")
    with ledger.shard(RUN, "own", fingerprint=False) as shard:
        shard.commit(url_of("own"), name="weights")
        with pytest.raises(FileNotFoundError, match="no such object"):
            shard.commit(url_of("own", "absent.bin"), name="other")
    a = events(client, "artifact_committed")[0].artifact_committed
    assert a.blake3_hex == blake3.blake3(b"uploaded by the job's own code").hexdigest()
    assert a.read_back == "digest"


def test_plan_reads_object_inputs_from_a_manifest_and_a_prefix(
    client: LedgerClient, s3: Any, capsys: pytest.CaptureFixture[str], target: str, tmp_path: Path
) -> None:
    for name in ("a.bin", "b.bin", "notes.txt"):
        s3.put_object(Bucket=BUCKET, Key=f"inputs/{name}", Body=f"input {name}".encode())
    code, _, err = run_cli(
        capsys,
        "plan",
        "from-prefix",
        "--inputs",
        f"s3://{BUCKET}/inputs/",
        "--glob",
        "*.bin",
        "--server",
        target,
        "--json",
    )
    assert code == 0, err
    plans = events(client, "planned", "from-prefix")
    assert [p.planned.input_ref for p in plans] == [
        f"s3://{BUCKET}/inputs/a.bin",
        f"s3://{BUCKET}/inputs/b.bin",
    ]
    head = s3.head_object(Bucket=BUCKET, Key="inputs/a.bin")
    first = plans[0].planned
    assert (first.input_bytes, first.input_blake3) == (
        len(b"input a.bin"),
        blake3.blake3(b"input a.bin").hexdigest(),
    )
    assert first.input_version_id == head["VersionId"]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(
        json.dumps({"input": f"s3://{BUCKET}/inputs/notes.txt"})
        + "\n"
        + json.dumps({"input": f"s3://{BUCKET}/inputs/absent.bin"})
        + "\n"
    )
    code, _, err = run_cli(
        capsys, "plan", "from-manifest", "--manifest", str(manifest), "--server", target
    )
    assert code == 5
    assert "line 2: input s3://night/inputs/absent.bin: no such object" in err
    with pytest.raises(NotFound):  # nothing was sent: the run does not even exist
        events(client, "planned", "from-manifest")


def test_a_job_writing_locally_imports_no_object_storage_library(tmp_path: Path) -> None:
    code = f"""
import sys
from shard_client import atomic, shard, storage
with atomic.atomic_write({str(tmp_path / "out.bin")!r}) as f:
    f.write(b"local bytes")
assert not storage.is_remote({str(tmp_path / "out.bin")!r})
print(sorted(m for m in sys.modules if m.split(".")[0] in ("fsspec", "s3fs", "botocore", "gcsfs")))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


class LostAnswerS3(s3fs.S3FileSystem):  # type: ignore[misc]
    """s3fs whose PutObject lands at the store but whose answer never reaches the job."""

    async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        answer = await super()._call_s3(method, *args, **kwargs)
        if method == "put_object":
            raise OSError("connection reset while reading the answer")
        return answer


def test_an_upload_whose_answer_was_lost_commits_only_because_the_bytes_are_there(
    ledger: Ledger, client: LedgerClient, s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan(client, "lost", "other")
    monkeypatch.setitem(sys.modules["fsspec.registry"]._registry, "s3", LostAnswerS3)
    with (
        ledger.shard(RUN, "lost", fingerprint=False) as shard,
        shard.atomic_write(url_of("lost"), name="weights", read_back_digest=False) as f,
    ):
        f.write(b"bytes that did land")
    a = events(client, "artifact_committed")[0].artifact_committed
    assert (a.read_back, a.size_bytes) == ("digest", len(b"bytes that did land"))
    # Other bytes at the key are no such excuse: the refused write is what the job sees.
    s3.put_object(Bucket=BUCKET, Key=key_of(url_of("other")), Body=b"older bytes")
    with (
        pytest.raises(ObjectExists),
        ledger.shard(RUN, "other", fingerprint=False) as shard,
        shard.atomic_write(url_of("other"), name="weights") as f,
    ):
        f.write(b"new bytes")
    assert len(events(client, "artifact_committed")) == 1


class UnreachableS3(s3fs.S3FileSystem):  # type: ignore[misc]
    """s3fs for a store that cannot be reached."""

    async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("could not connect to the endpoint URL")


def test_verify_records_nothing_for_objects_it_cannot_reach_and_exits_5(
    ledger: Ledger,
    client: LedgerClient,
    s3: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    target: str,
) -> None:
    plan(client, "far")
    with (
        ledger.shard(RUN, "far", fingerprint=False) as shard,
        shard.atomic_write(url_of("far"), name="weights") as f,
    ):
        f.write(b"good bytes")
    monkeypatch.setitem(sys.modules["fsspec.registry"]._registry, "s3", UnreachableS3)
    code, out, err = run_cli(capsys, "verify", RUN, "--server", target)
    assert code == 5, out
    assert "storage_unreachable" in err and "nothing was" in err
    assert events(client, "verified") == []


def test_verify_with_its_endpoint_stopped_says_so_per_object_exits_5_and_records_nothing(
    ledger: Ledger,
    client: LedgerClient,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    target: str,
) -> None:
    # An endpoint of the test's own, really stopped before verify: botocore's
    # EndpointConnectionError (no OSError) once escaped as a traceback, exit 1.
    from shardledger_cli.s3local import local_s3

    with local_s3(BUCKET, versioned=True) as env:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()
        plan(client, "gone-a", "gone-b")
        for shard_id in ("gone-a", "gone-b"):
            with (
                ledger.shard(RUN, shard_id, fingerprint=False) as shard,
                shard.atomic_write(url_of(shard_id), name="weights") as f,
            ):
                f.write(b"bytes")
    s3fs.S3FileSystem.clear_instance_cache()
    before = len(list(client.list_events(RUN)))
    code, out, err = run_cli(capsys, "verify", RUN, "--recheck", "--server", target)
    assert code == 5, out + err
    assert "Traceback" not in err and "raise " not in err
    unreachable = [line for line in (out + err).splitlines() if "storage_unreachable" in line]
    assert len(unreachable) >= 2, out + err  # one line per object, naming the reason
    assert all("cannot reach the store" in line for line in unreachable)
    assert len(list(client.list_events(RUN))) == before  # nothing recorded


class RefusingS3(s3fs.S3FileSystem):  # type: ignore[misc]
    """s3fs whose every call the store answers with CODE, as s3fs hands such answers on."""

    CODE: ClassVar[str] = ""

    async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        from botocore.exceptions import ClientError
        from s3fs.errors import translate_boto_error

        answer = {"Error": {"Code": self.CODE, "Message": f"{self.CODE} (injected)"}}
        raise translate_boto_error(ClientError(answer, method))


@pytest.mark.parametrize(
    ("code", "reason", "words"),
    [
        ("InvalidAccessKeyId", "credentials_refused", "refused the credentials"),
        ("SlowDown", "storage_throttled", "throttling requests"),
        ("AccessDenied", "permission_denied", "may not read"),
    ],
)
def test_verify_names_each_kind_of_storage_refusal_and_records_nothing(
    ledger: Ledger,
    client: LedgerClient,
    s3: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    target: str,
    code: str,
    reason: str,
    words: str,
) -> None:
    plan(client, "refused")
    with (
        ledger.shard(RUN, "refused", fingerprint=False) as shard,
        shard.atomic_write(url_of("refused"), name="weights") as f,
    ):
        f.write(b"good bytes")
    monkeypatch.setattr(RefusingS3, "CODE", code)
    monkeypatch.setitem(sys.modules["fsspec.registry"]._registry, "s3", RefusingS3)
    exit_code, out, err = run_cli(capsys, "verify", RUN, "--recheck", "--server", target)
    assert exit_code == 5, out + err
    assert "Traceback" not in err
    lines = [line for line in (out + err).splitlines() if reason in line]
    assert lines and words in lines[0], out + err
    assert events(client, "verified") == []


def test_verify_with_nothing_left_to_check_still_says_its_store_is_away(
    ledger: Ledger,
    client: LedgerClient,
    s3: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    target: str,
) -> None:
    plan(client, "done")
    with (
        ledger.shard(RUN, "done", fingerprint=False) as shard,
        shard.atomic_write(url_of("done"), name="weights") as f,
    ):
        f.write(b"checked once")
    assert verify(capsys, target)[0] == 0
    with socket.socket() as probe:  # a port nothing listens on: the endpoint is away
        probe.bind(("127.0.0.1", 0))
        away = f"http://127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", away)
    s3fs.S3FileSystem.clear_instance_cache()
    code, out, err = run_cli(capsys, "verify", RUN, "--server", target)
    assert code == 0, out + err  # nothing was left to judge
    assert "1 skipped as they already have a verdict" in out
    assert f"nothing was left to check, but s3://{BUCKET} cannot be read now" in err
    assert "cannot reach the store" in err and "Traceback" not in err
