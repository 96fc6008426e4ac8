"""Behaviour of the RFC 6962 Merkle tree, its proofs and the RFC 9162 proof checks."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger_server.merkle import (
    MerkleTree,
    ProofError,
    blake3_hasher,
    empty_root,
    leaf_hash,
    node_hash,
    sha256_hasher,
    verify_consistency,
    verify_inclusion,
)

RefHash = Callable[[bytes], bytes]

# The Certificate Transparency reference leaves, and the SHA-256 roots its reference
# implementations publish for sizes 0..8 (the same vectors across the C++, Go and Java logs).
CT_LEAVES = [
    b"",
    b"\x00",
    b"\x10",
    b"\x20\x21",
    b"\x30\x31",
    b"\x40\x41\x42\x43",
    b"\x50\x51\x52\x53\x54\x55\x56\x57",
    b"\x60\x61\x62\x63\x64\x65\x66\x67\x68\x69\x6a\x6b\x6c\x6d\x6e\x6f",
]
CT_ROOTS = [
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]
CT_INCLUSION = [
    (0, 8, ["96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"]),
    (5, 8, ["bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
]  # fmt: skip
CT_CONSISTENCY = [
    (1, 1, []),
    (1, 8, ["96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"]),
    (2, 5, ["5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"]),
    (2, 8, ["5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"]),
    (6, 8, ["0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
]  # fmt: skip

EXHAUSTIVE_MAX = 70


# A deliberately naive transcription of RFC 6962 §2.1 (recursion over lists, no memo),
# sharing no code with the module under test, so the two cannot agree by shared mistake.


def ref_blake3(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


def ref_split(n: int) -> int:
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def ref_mth(data: list[bytes], h: RefHash = ref_blake3) -> bytes:
    if not data:
        return h(b"")
    if len(data) == 1:
        return h(b"\x00" + data[0])
    k = ref_split(len(data))
    return h(b"\x01" + ref_mth(data[:k], h) + ref_mth(data[k:], h))


def ref_path(m: int, data: list[bytes], h: RefHash = ref_blake3) -> list[bytes]:
    if len(data) == 1:
        return []
    k = ref_split(len(data))
    if m < k:
        return [*ref_path(m, data[:k], h), ref_mth(data[k:], h)]
    return [*ref_path(m - k, data[k:], h), ref_mth(data[:k], h)]


def ref_subproof(m: int, data: list[bytes], b: bool, h: RefHash = ref_blake3) -> list[bytes]:
    if m == len(data):
        return [] if b else [ref_mth(data, h)]
    k = ref_split(len(data))
    if m <= k:
        return [*ref_subproof(m, data[:k], b, h), ref_mth(data[k:], h)]
    return [*ref_subproof(m - k, data[k:], False, h), ref_mth(data[:k], h)]


def ref_proof(m: int, data: list[bytes], h: RefHash = ref_blake3) -> list[bytes]:
    return ref_subproof(m, data, True, h)


def rows(n: int) -> list[bytes]:
    return [f"row-{i}".encode() * (i % 3 + 1) for i in range(n)]


def tree_of(data: list[bytes], *, hasher: RefHash = blake3_hasher) -> MerkleTree:
    tree = MerkleTree(hasher=hasher)
    for item in data:
        tree.append(item)
    return tree


def flip(value: bytes, position: int = 0) -> bytes:
    return value[:position] + bytes([value[position] ^ 0x01]) + value[position + 1 :]


def flip_node(proof: list[bytes], i: int) -> list[bytes]:
    return [*proof[:i], flip(proof[i]), *proof[i + 1 :]]


@pytest.fixture(scope="module")
def big_tree() -> tuple[list[bytes], MerkleTree, list[bytes]]:
    data = rows(EXHAUSTIVE_MAX)
    return data, tree_of(data), [ref_mth(data[:n]) for n in range(EXHAUSTIVE_MAX + 1)]


def test_sha256_roots_match_certificate_transparency_vectors() -> None:
    tree = MerkleTree(hasher=sha256_hasher)
    assert tree.root().hex() == CT_ROOTS[0]
    for size, item in enumerate(CT_LEAVES, start=1):
        tree.append(item)
        assert tree.root().hex() == CT_ROOTS[size]
    assert [tree.root(n).hex() for n in range(9)] == CT_ROOTS


@pytest.mark.parametrize(("index", "size", "expected"), CT_INCLUSION)
def test_sha256_inclusion_proofs_match_certificate_transparency_vectors(
    index: int, size: int, expected: list[str]
) -> None:
    tree = tree_of(CT_LEAVES, hasher=sha256_hasher)
    proof = tree.inclusion_proof(index, size)
    assert [node.hex() for node in proof] == expected
    assert verify_inclusion(
        leaf_hash=leaf_hash(CT_LEAVES[index], hasher=sha256_hasher),
        index=index,
        size=size,
        proof=proof,
        root=bytes.fromhex(CT_ROOTS[size]),
        hasher=sha256_hasher,
    )


@pytest.mark.parametrize(("old_size", "new_size", "expected"), CT_CONSISTENCY)
def test_sha256_consistency_proofs_match_certificate_transparency_vectors(
    old_size: int, new_size: int, expected: list[str]
) -> None:
    tree = tree_of(CT_LEAVES, hasher=sha256_hasher)
    proof = tree.consistency_proof(old_size, new_size)
    assert [node.hex() for node in proof] == expected
    assert verify_consistency(
        old_size=old_size,
        new_size=new_size,
        old_root=bytes.fromhex(CT_ROOTS[old_size]),
        new_root=bytes.fromhex(CT_ROOTS[new_size]),
        proof=proof,
        hasher=sha256_hasher,
    )


def test_hashes_use_rfc6962_domain_prefixes_under_blake3_by_default() -> None:
    assert empty_root() == ref_blake3(b"")
    assert MerkleTree().root() == ref_blake3(b"")
    assert leaf_hash(b"abc") == ref_blake3(b"\x00abc")
    assert node_hash(b"L" * 32, b"R" * 32) == ref_blake3(b"\x01" + b"L" * 32 + b"R" * 32)
    assert empty_root(hasher=sha256_hasher) == hashlib.sha256(b"").digest()


def test_append_returns_consecutive_indices_and_leaf_hash_append_is_equivalent() -> None:
    by_data, by_hash = MerkleTree(), MerkleTree()
    for i, item in enumerate(rows(9)):
        assert by_data.append(item) == i
        assert by_hash.append_leaf_hash(leaf_hash(item)) == i
        assert by_data.size == by_hash.size == i + 1
    assert by_data.root() == by_hash.root()


def test_leaf_hash_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(ValueError, match="bytes"):
        MerkleTree().append_leaf_hash(b"short")


def test_every_prefix_root_matches_reference(
    big_tree: tuple[list[bytes], MerkleTree, list[bytes]],
) -> None:
    data, tree, ref_roots = big_tree
    assert [tree.root(n) for n in range(EXHAUSTIVE_MAX + 1)] == ref_roots
    grown = MerkleTree()
    for n, item in enumerate(data, start=1):
        grown.append(item)
        assert grown.root() == ref_roots[n]


def test_every_inclusion_proof_matches_reference_and_verifies(
    big_tree: tuple[list[bytes], MerkleTree, list[bytes]],
) -> None:
    data, tree, ref_roots = big_tree
    for size in range(1, EXHAUSTIVE_MAX + 1):
        for index in range(size):
            proof = tree.inclusion_proof(index, size)
            assert proof == ref_path(index, data[:size]), (index, size)
            assert verify_inclusion(
                leaf_hash=leaf_hash(data[index]),
                index=index,
                size=size,
                proof=proof,
                root=ref_roots[size],
            ), (index, size)


def test_every_consistency_proof_matches_reference_and_verifies(
    big_tree: tuple[list[bytes], MerkleTree, list[bytes]],
) -> None:
    data, tree, ref_roots = big_tree
    for new_size in range(EXHAUSTIVE_MAX + 1):
        for old_size in range(new_size + 1):
            proof = tree.consistency_proof(old_size, new_size)
            expected = ref_proof(old_size, data[:new_size]) if 0 < old_size < new_size else []
            assert proof == expected, (old_size, new_size)
            assert verify_consistency(
                old_size=old_size,
                new_size=new_size,
                old_root=ref_roots[old_size],
                new_root=ref_roots[new_size],
                proof=proof,
            ), (old_size, new_size)


def test_tampered_inclusion_proofs_leaves_roots_indices_and_sizes_fail(
    big_tree: tuple[list[bytes], MerkleTree, list[bytes]],
) -> None:
    data, tree, ref_roots = big_tree
    junk = b"\xab" * 32
    for size in range(1, EXHAUSTIVE_MAX + 1):
        for index in range(size):
            proof = tree.inclusion_proof(index, size)
            good = {
                "leaf_hash": leaf_hash(data[index]),
                "index": index,
                "size": size,
                "proof": proof,
                "root": ref_roots[size],
            }
            bad: list[dict[str, object]] = [
                {"leaf_hash": flip(leaf_hash(data[index]))},
                {"root": flip(ref_roots[size], 31)},
                {"index": index + 1},
                {"index": index - 1},
                # A proof binds the size only together with that size's root (see below).
                *(
                    {"size": n, "root": ref_roots[n]}
                    for n in (size - 1, size + 1)
                    if 1 <= n <= EXHAUSTIVE_MAX
                ),
                {"proof": [*proof, junk]},
                {"proof": [junk, *proof]},
            ]
            bad += [{"proof": flip_node(proof, i)} for i in range(len(proof))]
            if proof:
                bad += [{"proof": proof[:-1]}, {"proof": proof[1:]}]
            if len(proof) > 1 and proof[0] != proof[1]:
                bad.append({"proof": [proof[1], proof[0], *proof[2:]]})
            for change in bad:
                assert not verify_inclusion(**{**good, **change}), (index, size, change)  # type: ignore[arg-type]


def test_tampered_consistency_proofs_roots_and_sizes_fail(
    big_tree: tuple[list[bytes], MerkleTree, list[bytes]],
) -> None:
    _, tree, ref_roots = big_tree
    junk = b"\xcd" * 32
    for new_size in range(1, EXHAUSTIVE_MAX + 1):
        for old_size in range(1, new_size):
            proof = tree.consistency_proof(old_size, new_size)
            good = {
                "old_size": old_size,
                "new_size": new_size,
                "old_root": ref_roots[old_size],
                "new_root": ref_roots[new_size],
                "proof": proof,
            }
            bad: list[dict[str, object]] = [
                {"old_root": flip(ref_roots[old_size])},
                {"new_root": flip(ref_roots[new_size], 31)},
                {"old_root": ref_roots[new_size], "new_root": ref_roots[old_size]},
                *({"old_size": n, "old_root": ref_roots[n]} for n in (old_size - 1, old_size + 1)),
                *(
                    {"new_size": n, "new_root": ref_roots[n]}
                    for n in (new_size - 1, new_size + 1)
                    if n <= EXHAUSTIVE_MAX
                ),
                {"proof": [*proof, junk]},
                {"proof": proof[:-1]},
                {"proof": []},
            ]
            bad += [{"proof": flip_node(proof, i)} for i in range(len(proof))]
            if len(proof) > 1 and proof[0] != proof[1]:
                bad.append({"proof": [proof[1], proof[0], *proof[2:]]})
            for change in bad:
                assert not verify_consistency(**{**good, **change}), (old_size, new_size, change)  # type: ignore[arg-type]


def test_a_proof_alone_does_not_bind_the_tree_size_so_heads_must_sign_it() -> None:
    # RFC 9162's checks treat proof nodes as opaque subtree roots: the last leaf of a
    # 3-leaf tree can stand for leaves 2..3 of a 4-leaf one. Only a signed (size, root)
    # pair pins the size, which is why TreeHead signs tree_size beside root_hex.
    data = rows(3)
    tree = tree_of(data)
    for size in (3, 4):
        assert verify_inclusion(
            leaf_hash=leaf_hash(data[0]),
            index=0,
            size=size,
            proof=tree.inclusion_proof(0),
            root=tree.root(),
        )
        assert verify_consistency(
            old_size=1,
            new_size=size,
            old_root=tree.root(1),
            new_root=tree.root(),
            proof=tree.consistency_proof(1),
        )


def test_consistency_between_equal_sizes_needs_equal_roots_and_no_proof() -> None:
    tree = tree_of(rows(5))
    root4, root5 = tree.root(4), tree.root(5)
    assert verify_consistency(old_size=4, new_size=4, old_root=root4, new_root=root4, proof=[])
    assert not verify_consistency(old_size=4, new_size=4, old_root=root4, new_root=root5, proof=[])
    assert not verify_consistency(
        old_size=4, new_size=4, old_root=root4, new_root=root4, proof=[root4]
    )


def test_every_tree_extends_the_empty_tree_but_only_from_the_empty_root() -> None:
    tree = tree_of(rows(5))
    assert tree.consistency_proof(0) == []
    assert verify_consistency(
        old_size=0, new_size=5, old_root=empty_root(), new_root=tree.root(), proof=[]
    )
    assert not verify_consistency(
        old_size=0, new_size=5, old_root=tree.root(1), new_root=tree.root(), proof=[]
    )
    assert not verify_consistency(
        old_size=0, new_size=5, old_root=empty_root(), new_root=tree.root(), proof=[tree.root(1)]
    )


def test_verifiers_reject_out_of_range_arguments_without_raising() -> None:
    tree = tree_of(rows(4))
    leaf = leaf_hash(rows(4)[0])
    proof = tree.inclusion_proof(0)
    for index, size in [(-1, 4), (4, 4), (0, 0), (0, -1)]:
        assert not verify_inclusion(
            leaf_hash=leaf, index=index, size=size, proof=proof, root=tree.root()
        )
    for old_size, new_size in [(3, 2), (-1, 4), (0, -1)]:
        assert not verify_consistency(
            old_size=old_size,
            new_size=new_size,
            old_root=tree.root(2),
            new_root=tree.root(3),
            proof=[],
        )


@pytest.mark.parametrize(
    "request_",
    [
        lambda t: t.root(6),
        lambda t: t.root(-1),
        lambda t: t.inclusion_proof(5),
        lambda t: t.inclusion_proof(-1),
        lambda t: t.inclusion_proof(0, 0),
        lambda t: t.inclusion_proof(3, 3),
        lambda t: t.inclusion_proof(0, 6),
        lambda t: t.consistency_proof(6),
        lambda t: t.consistency_proof(-1),
        lambda t: t.consistency_proof(4, 3),
        lambda t: t.consistency_proof(1, 6),
    ],
)
def test_out_of_range_requests_raise_proof_error(request_: Callable[[MerkleTree], object]) -> None:
    with pytest.raises(ProofError):
        request_(tree_of(rows(5)))
    assert issubclass(ProofError, ValueError)


def test_a_forked_history_fails_consistency_with_the_honest_one() -> None:
    honest = rows(20)
    forked = [*honest[:7], b"rewritten", *honest[8:]]
    honest_tree, forked_tree = tree_of(honest), tree_of(forked)
    for old_size in range(8, 20):
        assert not verify_consistency(
            old_size=old_size,
            new_size=20,
            old_root=forked_tree.root(old_size),
            new_root=honest_tree.root(),
            proof=honest_tree.consistency_proof(old_size),
        )


def test_hundred_thousand_leaf_root_matches_reference_and_proofs_verify() -> None:
    data = [i.to_bytes(4, "big") for i in range(100_000)]
    tree = tree_of(data)
    root = tree.root()
    assert root == ref_mth(data)
    for index in (0, 65_535, 65_536, 99_999):
        assert verify_inclusion(
            leaf_hash=leaf_hash(data[index]),
            index=index,
            size=tree.size,
            proof=tree.inclusion_proof(index),
            root=root,
        )
    assert verify_consistency(
        old_size=77_777,
        new_size=100_000,
        old_root=tree.root(77_777),
        new_root=root,
        proof=tree.consistency_proof(77_777),
    )


leaf_lists = st.lists(st.binary(max_size=12), min_size=1, max_size=150)


@settings(max_examples=150, deadline=None)
@given(data=leaf_lists, picks=st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)))
def test_inclusion_proofs_for_any_prefix_verify_and_match_reference(
    data: list[bytes], picks: tuple[int, int]
) -> None:
    size = picks[0] % len(data) + 1
    index = picks[1] % size
    tree = tree_of(data)
    proof = tree.inclusion_proof(index, size)
    assert proof == ref_path(index, data[:size])
    assert verify_inclusion(
        leaf_hash=leaf_hash(data[index]),
        index=index,
        size=size,
        proof=proof,
        root=ref_mth(data[:size]),
    )


@settings(max_examples=150, deadline=None)
@given(data=leaf_lists, picks=st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)))
def test_consistency_proofs_between_any_prefixes_verify_and_match_reference(
    data: list[bytes], picks: tuple[int, int]
) -> None:
    new_size = picks[0] % (len(data) + 1)
    old_size = picks[1] % (new_size + 1)
    tree = tree_of(data)
    proof = tree.consistency_proof(old_size, new_size)
    assert proof == (ref_proof(old_size, data[:new_size]) if 0 < old_size < new_size else [])
    assert verify_consistency(
        old_size=old_size,
        new_size=new_size,
        old_root=ref_mth(data[:old_size]),
        new_root=ref_mth(data[:new_size]),
        proof=proof,
    )


@settings(max_examples=200, deadline=None)
@given(
    data=leaf_lists,
    picks=st.tuples(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6)),
)
def test_any_single_bit_flip_in_an_inclusion_proof_is_detected(
    data: list[bytes], picks: tuple[int, int, int]
) -> None:
    tree = tree_of(data)
    index = picks[0] % tree.size
    proof = tree.inclusion_proof(index)
    # One flat byte string of leaf hash, proof nodes and root, so any bit of any part can flip.
    parts = [leaf_hash(data[index]), *proof, tree.root()]
    flat = bytearray(b"".join(parts))
    bit = picks[1] % (len(flat) * 8)
    flat[bit // 8] ^= 1 << (bit % 8)
    cut = [bytes(flat[i * 32 : (i + 1) * 32]) for i in range(len(parts))]
    assert not verify_inclusion(
        leaf_hash=cut[0], index=index, size=tree.size, proof=cut[1:-1], root=cut[-1]
    )


@settings(max_examples=100, deadline=None)
@given(data=leaf_lists, extra=st.lists(st.binary(max_size=8), max_size=40))
def test_roots_of_earlier_sizes_never_change_as_the_tree_grows(
    data: list[bytes], extra: list[bytes]
) -> None:
    tree = tree_of(data)
    before = [tree.root(n) for n in range(tree.size + 1)]
    for item in extra:
        tree.append(item)
    assert [tree.root(n) for n in range(len(data) + 1)] == before
