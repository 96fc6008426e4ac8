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
  python -m tools.bench.storage                       # 256 MiB, 5 repeats
  python -m tools.bench.storage --mib 8 --repeat 1 --out /tmp/storage.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
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

    from shard_client.storage import store_for

    data = os.urandom(args.mib * 1024 * 1024)
    fs = s3fs.S3FileSystem()
    kinds = ["raw", "commit", "commit_digest"]
    times: dict[str, list[float]] = {kind: [] for kind in [*kinds, "read_back_digest"]}
    store = store_for(f"s3://{BUCKET}/x")
    for i in range(args.repeat):
        # Rotating the order spreads the machine's drift over all three kinds.
        for kind in kinds[i % 3 :] + kinds[: i % 3]:
            url = f"s3://{BUCKET}/{kind}/{i}.bin"
            start = time.perf_counter()
            if kind == "raw":
                fs.pipe_file(url, data)
            else:
                _commit(url, data, digest=kind == "commit_digest", staging=staging)
            times[kind].append(time.perf_counter() - start)
            if kind == "commit":
                # The full read-back alone: one GET of the object, streamed through BLAKE3.
                start = time.perf_counter()
                store.digest(url)
                times["read_back_digest"].append(time.perf_counter() - start)
            # The endpoint keeps objects in memory: dropping each keeps it as fast as at the start.
            fs.rm_file(url)
    median = {k: statistics.median(v) for k, v in times.items()}
    mib = args.mib
    return {
        "artifact_mib": mib,
        "repeat": args.repeat,
        "seconds": {k: round(v, 4) for k, v in median.items()},
        "mib_per_s": {k: round(mib / v, 1) for k, v in median.items()},
        "note": "local moto endpoint on a shared machine; medians of interleaved runs",
        "ratio_commit_to_raw": round(median["commit"] / median["raw"], 3),
        "ratio_commit_digest_to_raw": round(median["commit_digest"] / median["raw"], 3),
        "full_digest_read_back_s": round(median["read_back_digest"], 4),
        "ratio_read_back_digest_to_raw": round(median["read_back_digest"] / median["raw"], 3),
        "target_ratio": 1.25,
        "all_seconds": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and writes its JSON result."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.storage",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--mib", type=int, default=256, help="artifact size in MiB (default 256)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each kind (default 5)")
    parser.add_argument("--out", default="bench-results/storage.json", help="JSON result file")
    args = parser.parse_args(argv)
    if args.mib < 1 or args.repeat < 1:
        parser.error("--mib and --repeat must be at least 1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from shardledger_cli.s3local import local_s3

    # Unversioned, so a deleted object frees the endpoint's memory (the version id
    # an upload returns costs nothing to read).
    with local_s3(BUCKET, versioned=False) as env, tempfile.TemporaryDirectory() as staging:
        os.environ.update(env)
        result = _measure(args, staging)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
