"""A local S3 endpoint (moto in server mode) for tests, the storage demo and the benchmark.

``python -m shardledger_cli.s3local`` serves S3 on 127.0.0.1 on a free port,
prints the port on stdout and runs until its stdin closes (so it never outlives
the process that started it). :func:`local_s3` starts one as a subprocess and
yields the environment a client needs to reach it: dummy credentials and
``AWS_ENDPOINT_URL``, the standard variable botocore reads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Final

__all__ = ["S3_ENV_KEYS", "local_s3", "main"]

S3_ENV_KEYS: Final = (
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_DEFAULT_REGION",
)


def main() -> None:
    """Serves S3 until stdin closes."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        sys.exit("shardledger: a local S3 endpoint needs moto[server] (pip install 'moto[server]')")
    # One line per request on stderr would drown the demo's output.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    print(server.get_host_and_port()[1], flush=True)
    sys.stdin.read()
    server.stop()


@contextlib.contextmanager
def local_s3(bucket: str, *, versioned: bool = True) -> Iterator[dict[str, str]]:
    """Starts a local S3 endpoint with one bucket; yields the environment that reaches it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardledger_cli.s3local"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = proc.stdout.readline().strip()
        if not port.isdigit():
            raise RuntimeError("the local S3 endpoint did not start (is moto[server] installed?)")
        env = {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            # moto accepts any credentials; these are dummies, never real ones.
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        _make_bucket(env, bucket, versioned=versioned)
        yield env
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _make_bucket(env: dict[str, str], bucket: str, *, versioned: bool) -> None:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )
    client.create_bucket(Bucket=bucket)
    if versioned:
        client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})


if __name__ == "__main__":
    main()
