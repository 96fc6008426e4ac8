"""`shardledger demo --storage s3`: the same night with artifacts in a local S3 endpoint.

The demo starts its own endpoint (moto in server mode on 127.0.0.1), the workers
commit to it, and the object-storage forms are injected on top of the local ones:
a worker SIGKILLed mid-upload, an object replaced and one deleted after commit.
It runs once, small, as a subprocess with --json.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from shardledger_cli.demo.faults import (
    DELETED_OBJECT,
    EXPECTED_REASON,
    REPLACED_OBJECT,
    STORAGE_FORMS,
    TORN_UPLOAD,
)
from shardledger_cli.demo.report import render

pytestmark = pytest.mark.s3  # the demo starts its own local S3 endpoint

ARGS = ["--storage", "s3", "--shards", "20", "--workers", "2", "--steps", "2", "--seed", "3"]


@pytest.fixture(scope="module")
def night() -> tuple[int, dict[str, Any]]:
    """Runs the s3 demo once for the module; returns its exit code and JSON report."""
    done = subprocess.run(
        [sys.executable, "-m", "shardledger_cli", "demo", *ARGS, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout)


def test_s3_night_finds_every_injected_fault_and_the_rerun_completes(
    night: tuple[int, dict[str, Any]],
) -> None:
    code, report = night
    # Each failed check with its problems, so a failure says why.
    failed = [c for c in report["ground_truth"]["checks"] if not c["ok"]]
    assert [(c["name"], c.get("problems")) for c in failed] == []
    assert report["after"]["check"]["ok"]
    assert report["summary_after"]["completion_rate"] == 1.0
    assert code == 0


def test_torn_upload_replaced_and_deleted_objects_are_each_found_with_their_reason(
    night: tuple[int, dict[str, Any]],
) -> None:
    _, report = night
    for form in STORAGE_FORMS:
        [row] = report["faults"][form]
        assert row["found"] == EXPECTED_REASON[form], (form, row)
    assert EXPECTED_REASON[TORN_UPLOAD] == "failed:timeout"
    # Only objects carry version ids: the artifacts really were in the bucket.
    failures = report["verify_before"]["failures"]
    assert failures["version_mismatch"] == 1 == failures["missing"]
    assert {EXPECTED_REASON[REPLACED_OBJECT], EXPECTED_REASON[DELETED_OBJECT]} <= set(
        report["ground_truth"]["found"].values()
    )


def test_s3_report_explains_the_object_storage_forms(
    night: tuple[int, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    _, report = night
    render(report)
    out = capsys.readouterr().out
    for label in ("torn upload (S3)", "object replaced (S3)", "object deleted (S3)"):
        assert label in out
    assert "every injected fault was found" in out
