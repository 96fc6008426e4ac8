"""A real local S3 endpoint (moto in server mode on 127.0.0.1) with a versioned bucket."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from shardledger_cli.s3local import local_s3

BUCKET = "night"


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[dict[str, str]]:
    """Starts one endpoint per module; yields the environment that reaches it."""
    with local_s3(BUCKET, versioned=True) as env:
        yield env


@pytest.fixture
def s3(s3_endpoint: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Points botocore at the endpoint (dummy credentials) for one test; yields a boto3 client."""
    import boto3
    import s3fs

    for key, value in s3_endpoint.items():
        monkeypatch.setenv(key, value)
    # s3fs caches filesystems (and their endpoint) across tests: start from none.
    s3fs.S3FileSystem.clear_instance_cache()
    client = boto3.client("s3")
    yield client
    s3fs.S3FileSystem.clear_instance_cache()
