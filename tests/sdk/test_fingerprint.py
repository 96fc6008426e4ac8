"""Behaviour of the environment fingerprint; NVML is faked only at the NvmlSeam boundary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import blake3
import pynvml
import pytest
import torch

from shard_client import environment
from shard_client.environment import Fingerprint, NvmlSeam, PynvmlSeam, fingerprint

REPO = Path(__file__).resolve().parents[2]


class FakeNvml:
    """An NvmlSeam with scripted GPUs and optional failures."""

    def __init__(
        self,
        devices: list[dict[str, str]],
        *,
        fail_init: Exception | None = None,
        fail_count: Exception | None = None,
        failing_device: int | None = None,
    ) -> None:
        self.devices = devices
        self.fail_init = fail_init
        self.fail_count = fail_count
        self.failing_device = failing_device
        self.shutdowns = 0

    def init(self) -> None:
        if self.fail_init is not None:
            raise self.fail_init

    def shutdown(self) -> None:
        self.shutdowns += 1

    def driver_version(self) -> str:
        return "550.54.15"

    def cuda_driver_version(self) -> str:
        return "12.4"

    def device_count(self) -> int:
        if self.fail_count is not None:
            raise self.fail_count
        return len(self.devices)

    def device(self, index: int) -> dict[str, str]:
        if index == self.failing_device:
            raise RuntimeError("GPU is lost")
        return self.devices[index]


H100 = {"name": "NVIDIA H100", "uuid": "GPU-1", "memory_total_bytes": "85899345920"}


def two_gpus() -> NvmlSeam:
    """Returns a fake with two identical GPUs."""
    return FakeNvml([H100, {**H100, "uuid": "GPU-2"}])


@pytest.fixture
def cudnn_benchmark_restored() -> Iterator[None]:
    """Puts cudnn.benchmark back after a test flips it."""
    saved = torch.backends.cudnn.benchmark
    yield
    torch.backends.cudnn.benchmark = saved


def test_gpus_driver_and_environment_become_flat_string_fields() -> None:
    fp = fingerprint(nvml=two_gpus(), env={"SHARDLEDGER_IMAGE_DIGEST": "sha256:abc"})

    assert fp.fields["nvml"] == "ok"
    assert fp.fields["driver.version"] == "550.54.15"
    assert fp.fields["cuda.driver_version"] == "12.4"
    assert fp.fields["gpu.count"] == "2"
    assert fp.fields["gpu.1.uuid"] == "GPU-2"
    assert fp.fields["gpu.0.memory_total_bytes"] == "85899345920"
    assert fp.fields["image.digest"] == "sha256:abc"
    assert fp.fields["env.CUBLAS_WORKSPACE_CONFIG"] == "unset"
    assert fp.fields["torch.version"] == torch.__version__
    assert all(isinstance(v, str) for v in fp.fields.values())


def test_digest_is_blake3_of_canonical_sorted_compact_json_without_gpu_identity() -> None:
    fp = fingerprint(nvml=two_gpus(), env={})

    kept = {k: v for k, v in fp.fields.items() if not k.endswith(".uuid")}
    canonical = json.dumps(kept, sort_keys=True, separators=(",", ":")).encode()
    assert fp.digest == blake3.blake3(canonical).hexdigest()
    assert fingerprint(nvml=two_gpus(), env={}).digest == fp.digest


def test_identical_nodes_share_a_digest_whatever_their_boards_and_ecc_counts() -> None:
    board = {**H100, "ecc.volatile_uncorrected": "0", "ecc.aggregate_uncorrected": "0"}
    node_a = fingerprint(nvml=FakeNvml([board]), env={})
    after_ecc = {**board, "uuid": "GPU-other", "ecc.volatile_uncorrected": "1"}
    node_b = fingerprint(nvml=FakeNvml([after_ecc]), env={})

    assert node_a.fields["gpu.0.uuid"] != node_b.fields["gpu.0.uuid"]  # still recorded
    assert node_b.fields["gpu.0.ecc.volatile_uncorrected"] == "1"
    assert node_a.digest == node_b.digest
    other_model = fingerprint(nvml=FakeNvml([{**board, "name": "NVIDIA A100"}]), env={})
    assert other_model.digest != node_a.digest


def test_a_changed_matmul_precision_policy_changes_the_digest() -> None:
    before = fingerprint(nvml=two_gpus(), env={})
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if previous != "high" else "highest")
    try:
        after = fingerprint(nvml=two_gpus(), env={})
    finally:
        torch.set_float32_matmul_precision(previous)

    assert after.fields["torch.float32_matmul_precision"] != previous
    assert before.digest != after.digest


def test_any_recorded_difference_changes_the_digest() -> None:
    base = fingerprint(nvml=two_gpus(), env={})
    other_image = fingerprint(nvml=two_gpus(), env={"SHARDLEDGER_IMAGE_DIGEST": "sha256:x"})
    other_gpus = fingerprint(nvml=FakeNvml([H100]), env={})

    assert len({base.digest, other_image.digest, other_gpus.digest}) == 3


def test_missing_image_digest_is_recorded_as_unknown() -> None:
    assert fingerprint(nvml=two_gpus(), env={}).fields["image.digest"] == "unknown"


def test_nvml_init_failure_means_no_gpus_and_never_raises() -> None:
    fake = FakeNvml([H100], fail_init=OSError("libnvidia-ml.so.1: cannot open"))

    fp = fingerprint(nvml=fake, env={})

    assert fp.fields["gpu.count"] == "0"
    assert fp.fields["nvml"] == "unavailable: OSError: libnvidia-ml.so.1: cannot open"
    assert "gpu.0.name" not in fp.fields


def test_failure_after_init_still_shuts_nvml_down() -> None:
    fake = FakeNvml([H100], fail_count=RuntimeError("driver hung"))

    fp = fingerprint(nvml=fake, env={})

    assert fp.fields["nvml"] == "unavailable: RuntimeError: driver hung"
    assert fp.fields["gpu.count"] == "0"
    assert fake.shutdowns == 1


def test_one_broken_gpu_is_recorded_without_hiding_the_others() -> None:
    fake = FakeNvml([H100, H100], failing_device=1)

    fp = fingerprint(nvml=fake, env={})

    assert fp.fields["gpu.count"] == "2"
    assert fp.fields["gpu.0.name"] == "NVIDIA H100"
    assert fp.fields["gpu.1.error"] == "RuntimeError: GPU is lost"


def test_torch_determinism_switches_are_part_of_the_fingerprint(
    cudnn_benchmark_restored: None,
) -> None:
    torch.backends.cudnn.benchmark = False
    before = fingerprint(nvml=two_gpus(), env={})
    torch.backends.cudnn.benchmark = True
    after = fingerprint(nvml=two_gpus(), env={})

    assert before.fields["torch.cudnn.benchmark"] == "false"
    assert after.fields["torch.cudnn.benchmark"] == "true"
    assert before.digest != after.digest
    assert before.fields["torch.deterministic_algorithms"] == (
        "true" if torch.are_deterministic_algorithms_enabled() else "false"
    )


def test_real_nvml_without_a_driver_degrades_to_no_gpu() -> None:
    fp = fingerprint()

    if fp.fields["nvml"] == "ok":
        pytest.skip("this machine has a working NVML driver")
    assert fp.fields["nvml"].startswith("unavailable: NVMLError")
    assert fp.fields["gpu.count"] == "0"


def test_real_nvml_with_a_driver_describes_every_gpu() -> None:
    fp = fingerprint()

    if fp.fields["nvml"] != "ok":
        pytest.skip("no NVML driver on this machine")
    for index in range(int(fp.fields["gpu.count"])):
        assert fp.fields[f"gpu.{index}.uuid"].startswith("GPU-")


def test_without_pynvml_or_torch_installed_the_fingerprint_still_completes() -> None:
    # None in sys.modules makes the import fail as if the package were not installed.
    code = (
        "import sys, json; sys.modules['pynvml'] = None; sys.modules['torch'] = None;"
        "from shard_client.environment import fingerprint;"
        "print(json.dumps(fingerprint().fields))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=True)

    fields = json.loads(out.stdout)
    assert fields["torch"] == "absent"
    # Without NVML's library pynvml is not even tried; with it, its absence is recorded.
    assert fields["nvml"].startswith(
        ("unavailable: NVMLError_LibraryNotFound", "unavailable: ModuleNotFoundError")
    )
    assert fields["gpu.count"] == "0"


def fingerprint_in_a_fresh_process(before: str = "") -> dict[str, Any]:
    """Returns the default fingerprint's fields, and whether torch got imported, from a new interpreter."""
    code = (
        "import sys, json;" + before + "from shard_client import fingerprint;"
        "fields = fingerprint().fields;"
        "print(json.dumps({'fields': fields, 'torch_imported': 'torch' in sys.modules}))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=True)
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def test_a_job_that_never_imported_torch_gets_the_installed_build_without_importing_it() -> None:
    plain = fingerprint_in_a_fresh_process()

    assert plain["torch_imported"] is False
    fields = plain["fields"]
    assert fields["torch.source"] == "installed"
    # The values an import would give: torch takes both from the same build file.
    assert fields["torch.version"] == torch.__version__
    assert fields["torch.cuda"] == str(torch.version.cuda or "none")
    assert "torch.deterministic_algorithms" not in fields  # never read, so never claimed


def test_a_job_that_imported_torch_records_its_runtime_switches_and_groups_apart() -> None:
    plain = fingerprint_in_a_fresh_process()["fields"]
    with_torch = fingerprint_in_a_fresh_process("import torch;")["fields"]

    assert with_torch["torch.source"] == "imported"
    assert with_torch["torch.deterministic_algorithms"] == "false"
    # The build agrees whichever way it was read ...
    assert with_torch["torch.version"] == plain["torch.version"]
    assert with_torch["torch.cuda"] == plain["torch.cuda"]
    # ... and the two are different knowledge, so they never share a digest (docs/concepts.md).
    assert Fingerprint.from_fields(plain).digest != Fingerprint.from_fields(with_torch).digest


def test_the_fingerprint_rereads_torchs_switches_but_not_what_a_process_cannot_change(
    monkeypatch: pytest.MonkeyPatch, cudnn_benchmark_restored: None
) -> None:
    reads: list[int] = []

    def counted() -> dict[str, str]:
        reads.append(1)
        return {"nvml": "ok", "gpu.count": "0"}

    monkeypatch.setattr(environment, "_default_gpu_fields", counted)
    monkeypatch.setattr(environment, "_CACHE", environment._ProcessCache())
    torch.backends.cudnn.benchmark = False
    first = fingerprint(env={})
    torch.backends.cudnn.benchmark = True
    second = fingerprint(env={"SHARDLEDGER_IMAGE_DIGEST": "sha256:new"})

    assert len(reads) == 1  # NVML once per process (per NVML_MAX_AGE_S)
    assert (first.fields["torch.cudnn.benchmark"], second.fields["torch.cudnn.benchmark"]) == (
        "false",
        "true",
    )
    assert second.fields["image.digest"] == "sha256:new"
    monkeypatch.setattr(environment, "NVML_MAX_AGE_S", 0.0)
    fingerprint(env={})
    assert len(reads) == 2


def fake_pynvml(*, ecc: Exception | None) -> Any:
    """Returns a stand-in for the pynvml module: one GPU, using pynvml's real error classes."""

    def total_ecc_errors(handle: object, error_type: int, counter: int) -> int:
        if ecc is not None:
            raise ecc
        return 3 if counter == pynvml.NVML_VOLATILE_ECC else 7

    return SimpleNamespace(
        NVMLError=pynvml.NVMLError,
        NVMLError_NotSupported=pynvml.NVMLError_NotSupported,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        NVML_VOLATILE_ECC=pynvml.NVML_VOLATILE_ECC,
        NVML_AGGREGATE_ECC=pynvml.NVML_AGGREGATE_ECC,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: b"535.104.05",
        nvmlSystemGetCudaDriverVersion=lambda: 12020,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda index: ("handle", index),
        nvmlDeviceGetName=lambda handle: b"Tesla T4",
        nvmlDeviceGetUUID=lambda handle: "GPU-t4",
        nvmlDeviceGetMemoryInfo=lambda handle: SimpleNamespace(total=16 * 2**30),
        nvmlDeviceGetTotalEccErrors=total_ecc_errors,
    )


def test_pynvml_seam_decodes_versions_and_reads_ecc_counters() -> None:
    seam = PynvmlSeam(fake_pynvml(ecc=None))
    seam.init()

    assert seam.driver_version() == "535.104.05"
    assert seam.cuda_driver_version() == "12.2"
    assert seam.device(0) == {
        "name": "Tesla T4",
        "uuid": "GPU-t4",
        "memory_total_bytes": str(16 * 2**30),
        "ecc.volatile_uncorrected": "3",
        "ecc.aggregate_uncorrected": "7",
    }


def test_pynvml_seam_records_unsupported_ecc_instead_of_failing() -> None:
    seam = PynvmlSeam(fake_pynvml(ecc=pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)))

    fields = fingerprint(nvml=seam, env={}).fields

    assert fields["gpu.0.ecc.volatile_uncorrected"] == "not_supported"
    assert fields["gpu.0.ecc.aggregate_uncorrected"] == "not_supported"


def test_pynvml_seam_records_other_ecc_errors_as_values() -> None:
    seam = PynvmlSeam(fake_pynvml(ecc=pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)))
    seam.init()

    assert seam.device(0)["ecc.volatile_uncorrected"] == "error: Unknown Error"


def test_from_fields_copies_the_mapping_it_is_given() -> None:
    source = {"a": "1"}
    fp = Fingerprint.from_fields(source)
    source["a"] = "2"

    assert fp.fields == {"a": "1"}
