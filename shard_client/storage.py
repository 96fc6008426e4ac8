"""The storage seam: artifact locations as URLs, object stores through fsspec.

A location is a bare path or ``file://`` URL (the local filesystem, handled by
:mod:`shard_client.atomic` as before) or an object-store URL such as
``s3://bucket/key`` or ``gs://bucket/key``. Only the latter import fsspec, and
only when one is used: a job that writes locally pulls none of it (install
``shardledger[s3]`` or ``shardledger[gcs]`` for the others).

S3 goes through s3fs's botocore client (its credential chain: environment,
profile, instance role; ``AWS_ENDPOINT_URL`` for MinIO and other S3-compatible
stores) with the calls the guarantees need: a conditional ``PutObject`` /
``CompleteMultipartUpload`` (``If-None-Match: *``) and ``HeadObject`` for the
read-back of size, ETag and version id. Other fsspec backends get what fsspec
offers: an upload, an ``info()`` read-back and a streamed re-read; no
conditional write (see docs/storage.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import unquote, urlsplit

import blake3

__all__ = [
    "READ_CHUNK",
    "CredentialsRefused",
    "ObjectExists",
    "ObjectInfo",
    "ObjectStore",
    "StorageThrottled",
    "StorageUnreachable",
    "Uploaded",
    "is_remote",
    "local_path",
    "store_for",
]

READ_CHUNK: Final = 1024 * 1024
# S3's minimum part size is 5 MiB; 16 MiB parts keep a 256 MiB upload at 16 requests.
PART_SIZE: Final = 16 * 1024 * 1024
MAX_PARTS_IN_FLIGHT: Final = 4
# S3 object keys are at most 1024 bytes; a URL longer than that is refused early.
_GS_SCHEMES: Final = ("gs", "gcs")


def is_remote(location: str | os.PathLike[str]) -> bool:
    """Returns whether a location names an object store (a URL other than file://)."""
    text = os.fspath(location)
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    return bool(scheme) and scheme != "file"


def local_path(location: str | os.PathLike[str]) -> str:
    """Returns the local path of a bare path or ``file://`` URL."""
    text = os.fspath(location)
    if text.lower().startswith("file://"):
        return unquote(urlsplit(text).path)
    return text


class StorageUnreachable(ConnectionError):
    """The store's endpoint could not be reached (refused, timed out, connection lost)."""


class CredentialsRefused(PermissionError):
    """The store has no usable credentials, or refused the ones it was given."""


class StorageThrottled(OSError):
    """The store asked the client to slow down (SlowDown, Throttling, 503)."""


# ClientError codes by what they say about the verifier's access, not about the object.
_CREDENTIAL_CODES: Final = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "InvalidClientTokenId",
        "UnrecognizedClientException",
    }
)
_THROTTLE_CODES: Final = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "RequestThrottled",
        "ServiceUnavailable",
        "503",
    }
)
# botocore's (and aiohttp's) errors that mean the endpoint was not reached, by name:
# botocore is imported only where object storage is used.
_UNREACHABLE_ERRORS: Final = frozenset(
    {
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ProxyConnectionError",
        "HTTPClientError",
        "ClientConnectorError",
        "ServerDisconnectedError",
        "ClientPayloadError",
        "ClientOSError",
    }
)
_CREDENTIAL_ERRORS: Final = frozenset(
    {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}
)


def storage_error(exc: BaseException, url: str) -> OSError | None:
    """Returns the typed error for a store's failure, or None when it is none of these.

    s3fs turns an HTTP error answer into an OSError (its ClientError as the cause) but
    lets botocore's own errors through (an endpoint that refuses connections is an
    EndpointConnectionError, no OSError): both are sorted here by what they say.
    """
    cause = exc.__cause__ if isinstance(exc, OSError) and exc.__cause__ is not None else exc
    response = getattr(cause, "response", None)
    code = str((response or {}).get("Error", {}).get("Code", "")) if response else ""
    names = {klass.__name__ for klass in type(cause).__mro__}
    if code in _CREDENTIAL_CODES or names & _CREDENTIAL_ERRORS:
        return CredentialsRefused(f"{url}: the store refused the credentials ({code or cause})")
    if code in _THROTTLE_CODES:
        return StorageThrottled(f"{url}: the store is throttling requests ({code})")
    if names & _UNREACHABLE_ERRORS:
        return StorageUnreachable(f"{url}: cannot reach the store ({cause})")
    return None


class ObjectExists(FileExistsError):
    """A conditional write found an object at the key: another writer committed it first."""

    def __init__(self, url: str) -> None:
        super().__init__(
            f"{url} already exists: another attempt committed it first"
            " (the conditional write If-None-Match: * was refused)"
        )
        self.url = url


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What the store says of one object: size, ETag (quotes stripped), version id."""

    url: str
    size_bytes: int
    etag: str
    version_id: str


@dataclass(frozen=True, slots=True)
class Uploaded:
    """What the store answered to an upload."""

    url: str
    size_bytes: int
    etag: str
    version_id: str
    conditional: bool


def _etag(raw: Any) -> str:
    return str(raw or "").strip('"')


def _version(raw: Any) -> str:
    # S3 names the version of an object in an unversioned bucket "null" (some answers
    # say so, others leave it out): both mean no version id.
    text = str(raw or "")
    return "" if text == "null" else text


class ObjectStore:
    """One fsspec filesystem and the few operations the ledger needs of it."""

    def __init__(self, fs: Any, scheme: str) -> None:
        self.fs = fs
        self.scheme = scheme
        self.is_s3 = scheme in ("s3", "s3a")

    def _split(self, url: str) -> tuple[str, str]:
        parts = urlsplit(url)
        key = parts.path.lstrip("/")
        if not parts.netloc or not key:
            raise ValueError(f"{url!r} must name a bucket and a key: {self.scheme}://BUCKET/KEY")
        return parts.netloc, key

    def check_url(self, url: str) -> None:
        """Raises ValueError when the URL names no object (no bucket or no key)."""
        if self.is_s3:
            self._split(url)

    def _call(self, method: str, **kwargs: Any) -> Any:
        # Through _call_s3 itself (s3fs's call_s3 wraps the base class's function), so a
        # subclass registered for s3:// (a proxy, a test's fault injector) sees every call.
        try:
            return _run(self.fs, self.fs._call_s3(method, **kwargs))
        except Exception as exc:
            typed = storage_error(exc, f"s3://{kwargs.get('Bucket', '')}/{kwargs.get('Key', '')}")
            if typed is None:
                raise
            raise typed from exc

    # --- metadata ---------------------------------------------------------------

    def info(self, url: str) -> ObjectInfo | None:
        """Returns the object's size, ETag and version id; None when there is none."""
        if not self.is_s3:
            try:
                found = self.fs.info(url)
            except FileNotFoundError:
                return None
            version = str(found.get("generation") or found.get("VersionId") or "")
            etag = _etag(found.get("ETag") or found.get("etag") or found.get("md5Hash"))
            return ObjectInfo(url, int(found.get("size") or 0), etag, version)
        bucket, key = self._split(url)
        try:
            head = self._call("head_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return None
        return ObjectInfo(
            url,
            int(head["ContentLength"]),
            _etag(head.get("ETag")),
            _version(head.get("VersionId")),
        )

    def list(self, prefix: str, pattern: str) -> list[ObjectInfo]:
        """Returns the objects under ``prefix`` whose key relative to it matches ``pattern``."""
        base = prefix.rstrip("/")
        out = []
        for path, found in sorted(self.fs.find(base, detail=True).items()):
            relative = path[len(urlsplit(base).netloc + urlsplit(base).path) :].lstrip("/")
            if found.get("type") == "directory" or not fnmatch.fnmatchcase(relative, pattern):
                continue
            url = f"{self.scheme}://{path}"
            info = self.info(url)
            if info is not None:
                out.append(info)
        return out

    # --- bytes ------------------------------------------------------------------

    def iter_bytes(self, url: str, *, version_id: str = "") -> Iterator[bytes]:
        """Yields the object's bytes in chunks (memory stays at one chunk)."""
        if not self.is_s3:
            with self.fs.open(url, "rb") as fh:
                while chunk := fh.read(READ_CHUNK):
                    yield chunk
            return
        bucket, key = self._split(url)
        extra = {"VersionId": version_id} if version_id else {}
        response = self._call("get_object", Bucket=bucket, Key=key, **extra)
        body = response["Body"]

        async def read() -> bytes:
            return bytes(await body.read(READ_CHUNK))

        try:
            while chunk := _run(self.fs, read()):
                yield chunk
        except Exception as exc:
            typed = storage_error(exc, url)
            if typed is None:
                raise
            raise typed from exc
        finally:
            body.close()

    def digest(self, url: str, *, version_id: str = "") -> tuple[int, str]:
        """Returns (size, blake3) of the object's bytes, streamed."""
        hasher, size = blake3.blake3(), 0
        for chunk in self.iter_bytes(url, version_id=version_id):
            hasher.update(chunk)
            size += len(chunk)
        return size, hasher.hexdigest()

    # --- upload -----------------------------------------------------------------

    def upload(
        self, source: str, url: str, *, if_absent: bool = True, part_size: int = PART_SIZE
    ) -> Uploaded:
        """Uploads a local file to ``url``; with ``if_absent`` only if nothing is there yet.

        Raises :class:`ObjectExists` when the conditional write is refused. A
        multipart upload that fails is aborted, so no part lingers at the key.
        """
        size = os.path.getsize(source)
        if not self.is_s3:
            if if_absent and self.fs.exists(url):
                raise ObjectExists(url)
            self.fs.put_file(source, url)
            found = self.info(url)
            etag, version = (found.etag, found.version_id) if found else ("", "")
            return Uploaded(url, size, etag, version, conditional=False)
        bucket, key = self._split(url)
        match = {"IfNoneMatch": "*"} if if_absent else {}
        try:
            if size <= part_size:
                with open(source, "rb") as fh:
                    body = fh.read()
                answer = self._call("put_object", Bucket=bucket, Key=key, Body=body, **match)
            else:
                answer = _run(self.fs, self._multipart(source, bucket, key, part_size, match))
        except FileExistsError:
            raise ObjectExists(url) from None
        return Uploaded(
            url, size, _etag(answer.get("ETag")), _version(answer.get("VersionId")), bool(match)
        )

    async def _multipart(
        self, source: str, bucket: str, key: str, part_size: int, match: dict[str, str]
    ) -> Any:
        call = self.fs._call_s3
        upload = await call("create_multipart_upload", Bucket=bucket, Key=key)
        upload_id = upload["UploadId"]
        gate = asyncio.Semaphore(MAX_PARTS_IN_FLIGHT)

        async def part(number: int, offset: int) -> dict[str, Any]:
            async with gate:
                # Read under the gate: memory stays at MAX_PARTS_IN_FLIGHT parts.
                with open(source, "rb") as fh:
                    fh.seek(offset)
                    body = fh.read(part_size)
                done = await call(
                    "upload_part",
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=body,
                )
            return {"PartNumber": number, "ETag": done["ETag"]}

        size = os.path.getsize(source)
        try:
            parts = await asyncio.gather(
                *(part(i + 1, offset) for i, offset in enumerate(range(0, size, part_size)))
            )
            return await call(
                "complete_multipart_upload",
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": list(parts)},
                **match,
            )
        except BaseException:
            # An aborted upload leaves nothing at the key; a killed process leaves an
            # invisible incomplete upload for the bucket's lifecycle rule to reclaim. The
            # abort's own failure (say, a completion that did land, its answer lost) must
            # not hide the error that matters, which propagates.
            with contextlib.suppress(Exception):
                await call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            raise

    def delete(self, url: str) -> None:
        """Removes the object (its latest version; older versions stay)."""
        self.fs.rm_file(url)


def _run(fs: Any, coro: Any) -> Any:
    """Runs a coroutine on the filesystem's own event loop (fsspec's IO thread)."""
    from fsspec.asyn import sync

    return sync(fs.loop, lambda: coro)


def store_for(url: str) -> ObjectStore:
    """Returns the object store a URL names, through fsspec (imported here, on first use).

    Credentials and the endpoint come from the backend's standard chain (for S3:
    environment, profile, instance role, ``AWS_ENDPOINT_URL``); nothing here takes
    or logs them.
    """
    scheme = url.split("://", 1)[0].lower()
    try:
        import fsspec
    except ImportError:
        raise ImportError(
            f"{url}: object storage needs fsspec; install shardledger[s3] or shardledger[gcs]"
        ) from None
    try:
        fs = fsspec.filesystem("gcs" if scheme in _GS_SCHEMES else scheme)
    except (ImportError, ValueError) as exc:
        raise ImportError(
            f"{url}: no fsspec backend for {scheme}:// ({exc}); install shardledger[s3] or [gcs]"
        ) from None
    return ObjectStore(fs, scheme)
