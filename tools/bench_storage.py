"""Object-storage commit cost: shard_client's S3 commit vs a raw s3fs upload of the same bytes.

Against a local S3 endpoint (moto in server mode, started here on 127.0.0.1),
in the same run, interleaved, each repeated --repeat times (medians reported):

  raw            s3fs ``pipe_file`` of the bytes (multipart, concurrent parts): the baseline
  commit         the SDK's commit: stage to a local temp while hashing (BLAKE3),
                 conditional upload (If-None-Match: *), read back size + ETag + version
  commit_digest  the same, plus the full read-back: the object re-read and its BLAKE3 compared

Ratios are to ``raw`` (target for ``commit``: at most 1.25). The ledger append
that follows a commit (one small gRPC call) is not part of either figure.

examples:
  python -m tools.bench_storage                       # 256 MiB, 3 repeats
  python -m tools.bench_storage --mib 8 --repeat 1 --out /tmp/storage.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

BUCKET = "bench"
CHUNK = 8 * 1024 * 1024


def _commit(url: str, data: bytes, *, digest: bool, staging: str) -> None:
    from shard_client.remote import UploadPolicy, remote_write

    policy = UploadPolicy(staging_dir=staging)
    with remote_write(url, read_back_digest=digest, policy=policy) as f:
        view = memoryview(data)
        for offset in range(0, len(data), CHUNK):
            f.write(bytes(view[offset : offset + CHUNK]))


def _measure(args: argparse.Namespace, staging: str) -> dict[str, Any]:
    import s3fs

    data = os.urandom(args.mib * 1024 * 1024)
    fs = s3fs.S3FileSystem()
    times: dict[str, list[float]] = {"raw": [], "commit": [], "commit_digest": []}
    for i in range(args.repeat):
        for kind in times:
            url = f"s3://{BUCKET}/{kind}/{i}.bin"
            start = time.perf_counter()
            if kind == "raw":
                fs.pipe_file(url, data)
            else:
                _commit(url, data, digest=kind == "commit_digest", staging=staging)
            times[kind].append(time.perf_counter() - start)
    median = {k: statistics.median(v) for k, v in times.items()}
    mib = args.mib
    return {
        "artifact_mib": mib,
        "repeat": args.repeat,
        "seconds": {k: round(v, 4) for k, v in median.items()},
        "mib_per_s": {k: round(mib / v, 1) for k, v in median.items()},
        "ratio_commit_to_raw": round(median["commit"] / median["raw"], 3),
        "ratio_commit_digest_to_raw": round(median["commit_digest"] / median["raw"], 3),
        "full_digest_read_back_s": round(median["commit_digest"] - median["commit"], 4),
        "target_ratio": 1.25,
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and writes its JSON result."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench_storage",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--mib", type=int, default=256, help="artifact size in MiB (default 256)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each kind (default 3)")
    parser.add_argument("--out", default="bench-results/storage.json", help="JSON result file")
    args = parser.parse_args(argv)
    if args.mib < 1 or args.repeat < 1:
        parser.error("--mib and --repeat must be at least 1")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from shardledger_cli.s3local import local_s3

    staging = Path(args.out).resolve().parent / ".bench-storage-staging"
    staging.mkdir(parents=True, exist_ok=True)
    with local_s3(BUCKET, versioned=True) as env:
        os.environ.update(env)
        result = _measure(args, str(staging))
    staging.rmdir()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
