"""Behaviour of the server signing key, signed tree heads and inclusion proof bundles."""

from __future__ import annotations

import json
import os
import stat
import threading
from dataclasses import replace
from pathlib import Path

import blake3
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ledger_server.merkle import MerkleTree
from ledger_server.signing import (
    TREE_HEAD_DOMAIN,
    InclusionProofBundle,
    SigningKey,
    TreeHead,
    check_inclusion_bundle,
    public_key_id,
    sign_tree_head,
    verify_tree_head,
)

ROWS = [f'{{"seq":{i},"kind":"committed"}}'.encode() for i in range(13)]


@pytest.fixture(scope="module")
def key() -> SigningKey:
    return SigningKey.generate()


@pytest.fixture(scope="module")
def tree() -> MerkleTree:
    tree = MerkleTree()
    for row in ROWS:
        tree.append(row)
    return tree


@pytest.fixture(scope="module")
def head(key: SigningKey, tree: MerkleTree) -> TreeHead:
    return sign_tree_head(
        key,
        namespace="vision",
        run_id="run-7",
        tree_size=tree.size,
        root=tree.root(),
        timestamp_ms=1_700_000_000_123,
    )


def bundle_for(head: TreeHead, tree: MerkleTree, index: int) -> InclusionProofBundle:
    return InclusionProofBundle(
        head=head,
        leaf_index=index,
        leaf_hex=ROWS[index].hex(),
        proof_hex=[node.hex() for node in tree.inclusion_proof(index, head.tree_size)],
    )


def test_load_or_create_writes_a_0600_pkcs8_pem_once_and_reloads_the_same_key(
    tmp_path: Path,
) -> None:
    path = tmp_path / "keys" / "ledger.pem"
    old_umask = os.umask(0)
    try:
        created = SigningKey.load_or_create(path)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    pem = path.read_bytes()
    assert pem.startswith(b"-----BEGIN PRIVATE KEY-----\n")
    assert [p.name for p in path.parent.iterdir()] == ["ledger.pem"]

    reloaded = SigningKey.load_or_create(str(path))
    assert path.read_bytes() == pem
    assert reloaded.key_id == created.key_id
    assert reloaded.public_key_pem() == created.public_key_pem()
    assert reloaded.sign(b"m") == created.sign(b"m")  # Ed25519 signatures are deterministic.


def test_concurrent_first_starts_agree_on_one_key(tmp_path: Path) -> None:
    path = tmp_path / "ledger.pem"
    barrier = threading.Barrier(8)
    key_ids: list[str] = []

    def start() -> None:
        barrier.wait()
        key_ids.append(SigningKey.load_or_create(path).key_id)

    threads = [threading.Thread(target=start) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(key_ids) == 8
    assert set(key_ids) == {SigningKey.load_or_create(path).key_id}
    assert [p.name for p in tmp_path.iterdir()] == ["ledger.pem"]


def test_a_corrupt_or_non_ed25519_key_file_is_refused(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"not a key")
    with pytest.raises(ValueError, match="PEM"):
        SigningKey.load_or_create(garbage)
    ec_pem = tmp_path / "ec.pem"
    ec_pem.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(ValueError, match="not Ed25519"):
        SigningKey.load_or_create(ec_pem)


def test_key_id_is_the_first_16_hex_of_blake3_of_the_raw_public_key(key: SigningKey) -> None:
    public = serialization.load_pem_public_key(key.public_key_pem().encode())
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert key.key_id == blake3.blake3(raw).hexdigest()[:16]
    assert public_key_id(key.public_key_pem()) == key.key_id
    assert key.key_id in repr(key)


def test_a_signed_tree_head_verifies_under_its_key(
    key: SigningKey, head: TreeHead, tree: MerkleTree
) -> None:
    assert verify_tree_head(head, key.public_key_pem())
    assert head.key_id == key.key_id
    assert head.root_hex == tree.root().hex()
    assert len(bytes.fromhex(head.signature_hex)) == 64


@pytest.mark.parametrize(
    "change",
    [
        {"namespace": "audio"},
        {"run_id": "run-8"},
        {"tree_size": 12},
        {"root_hex": "00" * 32},
        {"timestamp_ms": 1_700_000_000_124},
        {"signature_hex": "00" * 64},
        {"signature_hex": "ab"},
        {"signature_hex": "not hex"},
        {"signature_hex": ""},
        {"key_id": "0123456789abcdef"},
    ],
)
def test_any_change_to_a_signed_tree_head_fails_verification(
    key: SigningKey, head: TreeHead, change: dict[str, object]
) -> None:
    assert not verify_tree_head(replace(head, **change), key.public_key_pem())  # type: ignore[arg-type]


def test_every_bit_of_the_signature_matters(key: SigningKey, head: TreeHead) -> None:
    signature = bytes.fromhex(head.signature_hex)
    for bit in range(0, len(signature) * 8, 7):
        flipped = bytearray(signature)
        flipped[bit // 8] ^= 1 << (bit % 8)
        assert not verify_tree_head(
            replace(head, signature_hex=flipped.hex()), key.public_key_pem()
        )


def test_a_head_fails_under_another_key(head: TreeHead) -> None:
    assert not verify_tree_head(head, SigningKey.generate().public_key_pem())


def test_malformed_public_key_pem_raises_value_error(head: TreeHead) -> None:
    ec_public = ec.generate_private_key(ec.SECP256R1()).public_key()
    ec_pem = ec_public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()
    for pem in ["", "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n", ec_pem, "ключ"]:
        with pytest.raises(ValueError):
            verify_tree_head(head, pem)


def test_signed_message_is_domain_separated_canonical_json_without_the_signature() -> None:
    head = TreeHead(
        namespace="vision",
        run_id="run-7",
        tree_size=3,
        root_hex="ab" * 2,
        timestamp_ms=5,
        key_id="0123456789abcdef",
        signature_hex="ff",
    )
    assert head.signed_message() == TREE_HEAD_DOMAIN + (
        b'{"key_id":"0123456789abcdef","namespace":"vision","root_hex":"abab",'
        b'"run_id":"run-7","timestamp_ms":5,"tree_size":3}'
    )
    assert replace(head, signature_hex="00").signed_message() == head.signed_message()
    assert TREE_HEAD_DOMAIN == b"shardledger-tree-head-v1\n"


def test_tree_head_round_trips_through_json_text(key: SigningKey, head: TreeHead) -> None:
    restored = TreeHead.from_json(json.loads(json.dumps(head.to_json())))
    assert restored == head
    assert verify_tree_head(restored, key.public_key_pem())


@pytest.mark.parametrize(
    "mangle",
    [
        lambda d: {k: v for k, v in d.items() if k != "root_hex"},
        lambda d: {**d, "extra": 1},
        lambda d: {**d, "tree_size": True},
        lambda d: {**d, "tree_size": "13"},
        lambda d: {**d, "namespace": 7},
        lambda d: [d],
    ],
)
def test_tree_head_from_json_rejects_missing_unknown_and_mistyped_fields(
    head: TreeHead, mangle: object
) -> None:
    with pytest.raises(ValueError):
        TreeHead.from_json(mangle(head.to_json()))  # type: ignore[operator]


def test_signing_a_negative_tree_size_is_refused(key: SigningKey) -> None:
    with pytest.raises(ValueError, match="tree_size"):
        sign_tree_head(
            key, namespace="n", run_id="r", tree_size=-1, root=b"\x00" * 32, timestamp_ms=0
        )


def test_an_honest_bundle_checks_for_every_leaf(
    key: SigningKey, head: TreeHead, tree: MerkleTree
) -> None:
    for index in range(tree.size):
        ok, reason = check_inclusion_bundle(bundle_for(head, tree, index), key.public_key_pem())
        assert ok, reason
        assert f"leaf {index} " in reason
        assert "vision/run-7" in reason


def test_a_bundle_for_an_older_signed_head_checks(key: SigningKey, tree: MerkleTree) -> None:
    old_head = sign_tree_head(
        key, namespace="vision", run_id="run-7", tree_size=5, root=tree.root(5), timestamp_ms=1
    )
    ok, reason = check_inclusion_bundle(bundle_for(old_head, tree, 4), key.public_key_pem())
    assert ok, reason


def test_bundle_round_trips_through_json_text(
    key: SigningKey, head: TreeHead, tree: MerkleTree
) -> None:
    bundle = bundle_for(head, tree, 6)
    restored = InclusionProofBundle.from_json(json.loads(json.dumps(bundle.to_json())))
    assert restored == bundle
    assert check_inclusion_bundle(restored, key.public_key_pem())[0]


@pytest.mark.parametrize(
    ("mangle", "reason_part"),
    [
        (lambda b: replace(b, leaf_hex=ROWS[7].hex()), "does not lead"),
        (lambda b: replace(b, leaf_index=7), "does not lead"),
        (lambda b: replace(b, leaf_index=13), "outside the signed tree"),
        (lambda b: replace(b, leaf_index=-1), "outside the signed tree"),
        (lambda b: replace(b, proof_hex=[*b.proof_hex[:-1], "00" * 32]), "does not lead"),
        (lambda b: replace(b, proof_hex=b.proof_hex[:-1]), "does not lead"),
        (lambda b: replace(b, proof_hex=[*b.proof_hex, "00" * 32]), "does not lead"),
        (
            lambda b: replace(b, proof_hex=["XYZ", *b.proof_hex[1:]]),
            "proof_hex[0] is not lowercase hex",
        ),
        (lambda b: replace(b, leaf_hex="ZZ"), "leaf_hex is not lowercase hex"),
        (lambda b: replace(b, head=replace(b.head, tree_size=12)), "signature does not verify"),
        (
            lambda b: replace(b, head=replace(b.head, root_hex="11" * 32)),
            "signature does not verify",
        ),
    ],
)
def test_a_tampered_bundle_fails_with_a_reason(
    key: SigningKey, head: TreeHead, tree: MerkleTree, mangle: object, reason_part: str
) -> None:
    bundle = mangle(bundle_for(head, tree, 6))  # type: ignore[operator]
    ok, reason = check_inclusion_bundle(bundle, key.public_key_pem())
    assert not ok
    assert reason_part in reason


def test_a_bundle_fails_under_another_key_naming_both_key_ids(
    key: SigningKey, head: TreeHead, tree: MerkleTree
) -> None:
    other = SigningKey.generate()
    ok, reason = check_inclusion_bundle(bundle_for(head, tree, 0), other.public_key_pem())
    assert not ok
    assert key.key_id in reason and other.key_id in reason


def test_a_head_signed_with_an_unhexable_root_fails_the_bundle_check(
    key: SigningKey, tree: MerkleTree
) -> None:
    # The signature is genuine, but the signed root itself cannot be read as a digest.
    unsigned = TreeHead(
        namespace="vision", run_id="run-7", tree_size=tree.size, root_hex="NOPE",
        timestamp_ms=1, key_id=key.key_id, signature_hex="",
    )  # fmt: skip
    head = replace(unsigned, signature_hex=key.sign(unsigned.signed_message()).hex())
    ok, reason = check_inclusion_bundle(bundle_for(head, tree, 0), key.public_key_pem())
    assert (ok, reason) == (False, "signed root_hex is not lowercase hex")


def test_bundle_from_json_rejects_non_string_proof_nodes(head: TreeHead) -> None:
    data = {"head": head.to_json(), "leaf_index": 0, "leaf_hex": "", "proof_hex": [1]}
    with pytest.raises(ValueError, match="proof_hex"):
        InclusionProofBundle.from_json(data)


def test_bundle_check_with_a_malformed_public_key_raises_value_error(
    head: TreeHead, tree: MerkleTree
) -> None:
    with pytest.raises(ValueError):
        check_inclusion_bundle(bundle_for(head, tree, 0), "not a pem")
