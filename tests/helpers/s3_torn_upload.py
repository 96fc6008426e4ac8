"""Commits a multipart artifact to S3 and stops itself mid-upload, for a test to SIGKILL.

argv: run_id shard_id url marker_path. The second part's upload writes the
marker and then blocks; the test kills the process while parts are in flight.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import fsspec
import s3fs

from shard_client import Ledger
from shard_client.remote import UploadPolicy


class StallingS3(s3fs.S3FileSystem):  # type: ignore[misc]
    """s3fs that blocks forever on the second part of a multipart upload."""

    async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "upload_part" and kwargs.get("PartNumber") == 2:
            Path(sys.argv[4]).write_text("uploading")
            await asyncio.sleep(3600)
        return await super()._call_s3(method, *args, **kwargs)


def main() -> None:
    run_id, shard_id, url = sys.argv[1:4]
    fsspec.register_implementation("s3", StallingS3, clobber=True)
    with (
        Ledger(os.environ["SHARDLEDGER_SERVER"]) as ledger,
        ledger.shard(run_id, shard_id, fingerprint=False) as shard,
    ):
        policy = UploadPolicy(part_size=5 * 1024 * 1024)
        with shard.atomic_write(url, name="weights", upload=policy) as f:
            f.write(os.urandom(16 * 1024 * 1024))


if __name__ == "__main__":
    main()
