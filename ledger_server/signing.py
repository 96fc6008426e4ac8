"""Ed25519 signed tree heads, and inclusion proof bundles a third party checks offline.

A tree head commits the server's key to the Merkle root of one run's ledger at
one size and time. The signed bytes are ``TREE_HEAD_DOMAIN`` followed by the
canonical JSON (sorted keys, no spaces, UTF-8) of every field except the
signature, so a signature for anything else can never pass as a tree head.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Final, TypeVar

import blake3
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from ledger_server.merkle import leaf_hash, verify_inclusion
from shard_client.atomic import fsync_directory
from shard_client.canonical import canonical_json_bytes

__all__ = [
    "TREE_HEAD_DOMAIN",
    "InclusionProofBundle",
    "SigningKey",
    "TreeHead",
    "check_inclusion_bundle",
    "load_public_key",
    "public_key_id",
    "sign_tree_head",
    "verify_tree_head",
]

TREE_HEAD_DOMAIN: Final = b"shardledger-tree-head-v1\n"

_LOWER_HEX_RE: Final = re.compile(r"(?:[0-9a-f]{2})*")

_T = TypeVar("_T")


def _key_id(public_raw: bytes) -> str:
    """Returns the first 16 hex characters of blake3 over the raw 32-byte public key."""
    return blake3.blake3(public_raw).hexdigest()[:16]


def _raw_public(public_key: Ed25519PublicKey) -> bytes:
    """Returns the raw 32-byte encoding of an Ed25519 public key."""
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _decode_hex(value: str) -> bytes | None:
    """Returns the bytes of lowercase, even-length hex, or None for anything else."""
    # bytes.fromhex alone accepts spaces and upper case, so one value would have many spellings.
    if not isinstance(value, str) or _LOWER_HEX_RE.fullmatch(value) is None:
        return None
    return bytes.fromhex(value)


def load_public_key(public_key_pem: str) -> Ed25519PublicKey:
    """Returns the Ed25519 public key in a PEM SubjectPublicKeyInfo, or raises ValueError."""
    try:
        key = serialization.load_pem_public_key(public_key_pem.encode("ascii"))
    except (ValueError, TypeError, UnicodeEncodeError, UnsupportedAlgorithm) as exc:
        raise ValueError(f"not a PEM public key: {exc}") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"public key is {type(key).__name__}, not Ed25519")
    return key


def public_key_id(public_key_pem: str) -> str:
    """Returns the key id of a PEM Ed25519 public key, as tree heads name it."""
    return _key_id(_raw_public(load_public_key(public_key_pem)))


class SigningKey:
    """Holds the server's Ed25519 private key and signs with it."""

    __slots__ = ("_key_id", "_private_key")

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        self._key_id = _key_id(_raw_public(private_key.public_key()))

    def __repr__(self) -> str:
        return f"SigningKey(key_id={self._key_id!r})"

    @classmethod
    def generate(cls) -> SigningKey:
        """Returns a fresh random key that lives only in memory."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_pem(cls, pem: bytes) -> SigningKey:
        """Returns the key in an unencrypted PEM PKCS8 private key, or raises ValueError."""
        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            raise ValueError(f"not an unencrypted PEM private key: {exc}") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"private key is {type(key).__name__}, not Ed25519")
        return cls(key)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> SigningKey:
        """Returns the key stored at path, first creating it (mode 0600) when absent."""
        target = Path(path)
        try:
            return cls.from_pem(target.read_bytes())
        except FileNotFoundError:
            pass
        _publish_new_file(target, cls.generate()._private_pem())
        # Reading back, not returning the generated key: a concurrent first start may
        # have published its key first, and the file is what every later start loads.
        return cls.from_pem(target.read_bytes())

    @property
    def key_id(self) -> str:
        """Returns the first 16 hex characters of blake3 over the raw public key."""
        return self._key_id

    def public_key_pem(self) -> str:
        """Returns the public key as a PEM SubjectPublicKeyInfo."""
        pem = self._private_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return pem.decode("ascii")

    def sign(self, message: bytes) -> bytes:
        """Returns the 64-byte Ed25519 signature of message."""
        return self._private_key.sign(message)

    def _private_pem(self) -> bytes:
        """Returns the private key as an unencrypted PEM PKCS8."""
        return self._private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )


def _publish_new_file(target: Path, data: bytes) -> None:
    """Writes data to target as a whole, mode 0600 file, never replacing an existing one."""
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # os.link and os.replace are atomic only within one filesystem, so the temp file lives beside the target.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), 0o600)
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            # A hard link publishes the finished file like a rename but refuses to replace
            # an existing one, so two servers starting at once cannot swap keys under each other.
            os.link(tmp_name, target)
        except FileExistsError:
            pass
        except OSError:
            # Filesystems without hard links get a plain rename; only there can a race clobber.
            os.replace(tmp_name, target)
        # Some filesystems cannot fsync a directory (EINVAL); the key file itself is
        # fsynced, and a start must not fail for want of the directory flush.
        with contextlib.suppress(OSError):
            fsync_directory(target.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)


@dataclass(frozen=True, slots=True)
class TreeHead:
    """Commits a key to the Merkle root of one run's ledger at one size and time."""

    namespace: str
    run_id: str
    tree_size: int
    root_hex: str
    timestamp_ms: int
    key_id: str
    signature_hex: str

    def signed_message(self) -> bytes:
        """Returns the domain-separated canonical bytes that the signature covers."""
        body = {name: value for name, value in self.to_json().items() if name != "signature_hex"}
        return TREE_HEAD_DOMAIN + canonical_json_bytes(body)

    def to_json(self) -> dict[str, str | int]:
        """Returns the head as a JSON-ready mapping."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TreeHead:
        """Returns the head in a JSON mapping, or raises ValueError when a field is missing or mistyped."""
        _require_exact_keys(data, {f.name for f in fields(cls)}, what="tree head")
        return cls(
            namespace=_require(data, "namespace", str),
            run_id=_require(data, "run_id", str),
            tree_size=_require(data, "tree_size", int),
            root_hex=_require(data, "root_hex", str),
            timestamp_ms=_require(data, "timestamp_ms", int),
            key_id=_require(data, "key_id", str),
            signature_hex=_require(data, "signature_hex", str),
        )


def _require_exact_keys(data: Mapping[str, Any], expected: set[str], *, what: str) -> None:
    """Raises ValueError unless data has exactly the expected keys."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{what} is {type(data).__name__}, not a JSON object")
    missing, unknown = expected - data.keys(), data.keys() - expected
    if missing or unknown:
        raise ValueError(f"{what} lacks {sorted(missing)} and has unknown {sorted(unknown)}")


def _require(data: Mapping[str, Any], name: str, kind: type[_T]) -> _T:
    """Returns data[name] when it has the given JSON type, else raises ValueError."""
    value = data[name]
    # bool is an int subclass in Python, but true is no tree size in JSON.
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{name} is {type(value).__name__}, not {kind.__name__}")
    return value


def sign_tree_head(
    key: SigningKey,
    *,
    namespace: str,
    run_id: str,
    tree_size: int,
    root: bytes,
    timestamp_ms: int,
) -> TreeHead:
    """Returns the tree head for root at tree_size, signed by key."""
    if tree_size < 0:
        raise ValueError(f"tree_size is {tree_size}, not a size")
    unsigned = TreeHead(
        namespace=namespace,
        run_id=run_id,
        tree_size=tree_size,
        root_hex=root.hex(),
        timestamp_ms=timestamp_ms,
        key_id=key.key_id,
        signature_hex="",
    )
    return replace(unsigned, signature_hex=key.sign(unsigned.signed_message()).hex())


def _tree_head_problem(head: TreeHead, public_key: Ed25519PublicKey) -> str | None:
    """Returns why head is not validly signed by public_key, or None when it is."""
    expected_id = _key_id(_raw_public(public_key))
    if head.key_id != expected_id:
        return f"tree head names key {head.key_id!r}, but the given public key is {expected_id!r}"
    signature = _decode_hex(head.signature_hex)
    if signature is None:
        return "tree head signature is not lowercase hex"
    try:
        public_key.verify(signature, head.signed_message())
    except (InvalidSignature, ValueError, TypeError):
        # ValueError/TypeError: fields of the wrong type or unencodable text, i.e. a head never signed.
        return "tree head signature does not verify under the given public key"
    return None


def verify_tree_head(head: TreeHead, public_key_pem: str) -> bool:
    """Returns whether head carries a valid signature by the PEM key; raises ValueError for a bad PEM."""
    return _tree_head_problem(head, load_public_key(public_key_pem)) is None


@dataclass(frozen=True, slots=True)
class InclusionProofBundle:
    """Carries everything a third party needs to check one ledger row against a signed head."""

    head: TreeHead
    leaf_index: int
    leaf_hex: str  # The leaf DATA (the canonical row bytes), not its leaf hash.
    proof_hex: list[str]

    def to_json(self) -> dict[str, Any]:
        """Returns the bundle as a JSON-ready mapping."""
        return {
            "head": self.head.to_json(),
            "leaf_index": self.leaf_index,
            "leaf_hex": self.leaf_hex,
            "proof_hex": list(self.proof_hex),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> InclusionProofBundle:
        """Returns the bundle in a JSON mapping, or raises ValueError when a field is missing or mistyped."""
        _require_exact_keys(data, {f.name for f in fields(cls)}, what="inclusion proof bundle")
        proof_hex = _require(data, "proof_hex", list)
        if not all(isinstance(item, str) for item in proof_hex):
            raise ValueError("proof_hex holds a value that is not a string")
        return cls(
            head=TreeHead.from_json(_require(data, "head", dict)),
            leaf_index=_require(data, "leaf_index", int),
            leaf_hex=_require(data, "leaf_hex", str),
            proof_hex=[str(item) for item in proof_hex],
        )


def check_inclusion_bundle(bundle: InclusionProofBundle, public_key_pem: str) -> tuple[bool, str]:
    """Returns whether the bundle's row is in its signed tree, with the reason; raises ValueError for a bad PEM."""
    head = bundle.head
    problem = _tree_head_problem(head, load_public_key(public_key_pem))
    if problem is not None:
        return False, problem
    root = _decode_hex(head.root_hex)
    if root is None:
        return False, "signed root_hex is not lowercase hex"
    leaf = _decode_hex(bundle.leaf_hex)
    if leaf is None:
        return False, "leaf_hex is not lowercase hex"
    proof: list[bytes] = []
    for position, item in enumerate(bundle.proof_hex):
        node = _decode_hex(item)
        if node is None:
            return False, f"proof_hex[{position}] is not lowercase hex"
        proof.append(node)
    if not 0 <= bundle.leaf_index < head.tree_size:
        return (
            False,
            f"leaf index {bundle.leaf_index} is outside the signed tree of size {head.tree_size}",
        )
    included = verify_inclusion(
        leaf_hash=leaf_hash(leaf),
        index=bundle.leaf_index,
        size=head.tree_size,
        proof=proof,
        root=root,
    )
    if not included:
        return False, f"proof does not lead from leaf {bundle.leaf_index} to the signed root"
    return True, (
        f"leaf {bundle.leaf_index} is in {head.namespace}/{head.run_id} at tree size "
        f"{head.tree_size}, signed by key {head.key_id}"
    )
