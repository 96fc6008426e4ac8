"""`verify` for artifacts in object storage: re-read through the storage seam, then the local checks.

The object's metadata is read first (HEAD: missing, version_mismatch when the
version id differs from the commit's, size_mismatch); then its bytes are
streamed, hashed chunk by chunk, into a scratch file (memory stays at one chunk)
and the same checks as for a local file run on it (digest, empty, truncation,
content checks, validators). Failures that describe the verifier's access to the
store (no backend installed, store unreachable, access denied) are not recorded:
their reasons are in VERIFIER_REASONS.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import PurePosixPath
from urllib.parse import urlsplit

import blake3

from shard_client.checks import CheckResult, Validator, verify_artifact
from shard_client.storage import CredentialsRefused, StorageThrottled, store_for

__all__ = ["verify_object"]


def _fail(reason: str, detail: str) -> CheckResult:
    return CheckResult(passed=False, reason=reason, detail=detail)


def _access(exc: OSError, url: str) -> CheckResult:
    """Returns the not-recorded result for a failure of the verifier's access to the store."""
    if isinstance(exc, CredentialsRefused):
        return _fail("credentials_refused", str(exc))
    if isinstance(exc, PermissionError):
        return _fail("permission_denied", f"the verifier may not read {url}: {exc}")
    if isinstance(exc, StorageThrottled):
        return _fail("storage_throttled", str(exc))
    return _fail("storage_unreachable", f"cannot read {url}: {exc}")


def verify_object(
    *,
    url: str,
    expected_size: int,
    expected_blake3: str,
    version_id: str = "",
    media_type: str = "",
    validators: Mapping[str, Validator] | None = None,
    scratch_dir: str | None = None,
) -> CheckResult:
    """Checks one committed object against its ledger record, its content rules and validators."""
    try:
        store = store_for(url)
        info = store.info(url)
    except ImportError as exc:
        return _fail("storage_unreachable", str(exc))
    except OSError as exc:
        return _access(exc, url)
    except ValueError as exc:
        return _fail("storage_unreachable", f"cannot read {url}: {exc}")
    if info is None:
        return _fail("missing", f"no object at {url}")
    if version_id and info.version_id != version_id:
        return _fail(
            "version_mismatch",
            f"{url} is version {info.version_id or '(none)'}, the commit recorded {version_id}"
            " (replaced or deleted and rewritten after the commit)",
        )
    if info.size_bytes != expected_size:
        return _fail("size_mismatch", f"expected {expected_size} bytes, found {info.size_bytes}")
    suffix = PurePosixPath(urlsplit(url).path).suffix
    fd, scratch = tempfile.mkstemp(prefix=".shardledger-verify-", suffix=suffix, dir=scratch_dir)
    try:
        hasher = blake3.blake3()
        with os.fdopen(fd, "wb") as out:
            try:
                for chunk in store.iter_bytes(url, version_id=info.version_id):
                    hasher.update(chunk)
                    out.write(chunk)
            except FileNotFoundError:
                return _fail("missing", f"{url} disappeared while it was read")
            except OSError as exc:
                return _access(exc, url)
        digest = hasher.hexdigest()
        if digest != expected_blake3.strip().lower():
            return _fail("digest_mismatch", f"expected blake3 {expected_blake3}, found {digest}")
        # The same checks as a local file: the scratch copy holds exactly the bytes hashed.
        result = verify_artifact(
            root=os.path.dirname(scratch),
            path=scratch,
            expected_size=expected_size,
            expected_blake3=expected_blake3,
            media_type=media_type,
            validators=validators,
        )
        return CheckResult(result.passed, result.reason, result.detail.replace(scratch, url))
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(scratch)
