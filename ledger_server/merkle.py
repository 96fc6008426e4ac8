"""RFC 6962 Merkle trees over pluggable hashes, and proof checks that never rebuild a tree.

The tree shape and the proofs follow RFC 6962 §2.1 exactly (MTH, PATH, PROOF
and SUBPROOF, splitting at the largest power of two below ``n``); the checks
are the RFC 9162 §2.1.3.2 and RFC 9162 §2.1.4.2 algorithms, which walk a proof in
O(log n) hashes. The ledger hashes with blake3; tests swap in sha256 to meet
the Certificate Transparency reference vectors.

Pure: no I/O, no clock, no logging.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Final, TypeAlias

import blake3

__all__ = [
    "Hasher",
    "MerkleTree",
    "ProofError",
    "blake3_hasher",
    "empty_root",
    "leaf_hash",
    "node_hash",
    "sha256_hasher",
    "verify_consistency",
    "verify_inclusion",
]

Hasher: TypeAlias = Callable[[bytes], bytes]

# The one-byte prefixes keep a leaf from ever hashing like an interior node (RFC 6962 §2.1),
# which is what stops a forger presenting a subtree root as a leaf.
_LEAF_PREFIX: Final = b"\x00"
_NODE_PREFIX: Final = b"\x01"


class ProofError(ValueError):
    """Reports a root or proof request for an index or size outside the tree."""


def blake3_hasher(data: bytes) -> bytes:
    """Returns the 32-byte blake3 digest of data."""
    return blake3.blake3(data).digest()


def sha256_hasher(data: bytes) -> bytes:
    """Returns the 32-byte SHA-256 digest of data."""
    return hashlib.sha256(data).digest()


def leaf_hash(data: bytes, *, hasher: Hasher = blake3_hasher) -> bytes:
    """Returns the RFC 6962 leaf hash H(0x00 ‖ data)."""
    return hasher(_LEAF_PREFIX + data)


def node_hash(left: bytes, right: bytes, *, hasher: Hasher = blake3_hasher) -> bytes:
    """Returns the RFC 6962 interior node hash H(0x01 ‖ left ‖ right)."""
    return hasher(_NODE_PREFIX + left + right)


def empty_root(*, hasher: Hasher = blake3_hasher) -> bytes:
    """Returns the root of the empty tree, H(b"")."""
    return hasher(b"")


def _split(n: int) -> int:
    """Returns the largest power of two strictly smaller than n, for n >= 2."""
    return 1 << ((n - 1).bit_length() - 1)


def _is_power_of_two(n: int) -> bool:
    """Returns whether n is a positive power of two."""
    return n > 0 and n & (n - 1) == 0


class MerkleTree:
    """Holds an append-only RFC 6962 tree and serves roots and proofs for any prefix of it.

    Complexity, for n leaves: ``append`` costs amortised O(1) hashes (at most
    two per leaf in total) and the tree keeps about 2n digests; ``root`` costs
    O(log n) hashes for any prefix size; ``inclusion_proof`` and
    ``consistency_proof`` cost O(log² n) hashes at worst.
    """

    __slots__ = ("_digest_size", "_hasher", "_levels")

    def __init__(self, *, hasher: Hasher = blake3_hasher) -> None:
        self._hasher = hasher
        self._digest_size = len(hasher(b""))
        # _levels[h][i] is the root of the complete subtree over leaves [i·2^h, (i+1)·2^h).
        # A full subtree never changes in an append-only tree, and every subtree of
        # size 2^h that RFC 6962's split produces starts at a multiple of 2^h, so each
        # root or proof, for any prefix size, reads these instead of rehashing leaves.
        self._levels: list[list[bytes]] = [[]]

    @property
    def size(self) -> int:
        """Returns the number of leaves."""
        return len(self._levels[0])

    def append(self, leaf_data: bytes) -> int:
        """Appends one leaf by its data and returns its index."""
        return self.append_leaf_hash(leaf_hash(leaf_data, hasher=self._hasher))

    def append_leaf_hash(self, h: bytes) -> int:
        """Appends one leaf by its already computed leaf hash and returns its index."""
        if len(h) != self._digest_size:
            raise ValueError(f"leaf hash is {len(h)} bytes, the hasher makes {self._digest_size}")
        index = self.size
        self._levels[0].append(h)
        height = 0
        # An even count at a height means the newest two nodes there just completed a pair.
        while len(self._levels[height]) % 2 == 0:
            if height + 1 == len(self._levels):
                self._levels.append([])
            row = self._levels[height]
            self._levels[height + 1].append(node_hash(row[-2], row[-1], hasher=self._hasher))
            height += 1
        return index

    def root(self, size: int | None = None) -> bytes:
        """Returns MTH of the first ``size`` leaves (all leaves when size is None)."""
        n = self._checked_size(size)
        if n == 0:
            return empty_root(hasher=self._hasher)
        return self._subtree(0, n)

    def inclusion_proof(self, index: int, size: int | None = None) -> list[bytes]:
        """Returns PATH(index, D[0:size]), the audit path ordered from the leaf up."""
        n = self._checked_size(size)
        if not 0 <= index < n:
            raise ProofError(f"leaf index {index} is outside a tree of size {n}")
        # Descending from the root yields the siblings top-down; RFC 6962 lists them leaf-first.
        siblings: list[bytes] = []
        start = 0
        while n > 1:
            k = _split(n)
            if index < k:
                siblings.append(self._subtree(start + k, n - k))
                n = k
            else:
                siblings.append(self._complete(start, k))
                start, index, n = start + k, index - k, n - k
        siblings.reverse()
        return siblings

    def consistency_proof(self, old_size: int, new_size: int | None = None) -> list[bytes]:
        """Returns PROOF(old_size, D[0:new_size]); empty when old_size is 0 or equals new_size."""
        n = self._checked_size(new_size)
        if not 0 <= old_size <= n:
            raise ProofError(f"old size {old_size} is outside 0..{n}")
        if old_size in (0, n):
            return []
        m = old_size
        nodes: list[bytes] = []
        start = 0
        # SUBPROOF's flag b: still true while the old tree is the whole left edge we walk.
        whole_old_tree = True
        while m != n:
            k = _split(n)
            if m <= k:
                nodes.append(self._subtree(start + k, n - k))
                n = k
            else:
                nodes.append(self._complete(start, k))
                start, m, n = start + k, m - k, n - k
                whole_old_tree = False
        if not whole_old_tree:
            nodes.append(self._subtree(start, n))
        nodes.reverse()
        return nodes

    def _checked_size(self, size: int | None) -> int:
        """Returns size, defaulting to the current size, or raises ProofError when out of range."""
        if size is None:
            return self.size
        if not 0 <= size <= self.size:
            raise ProofError(f"tree size {size} is outside 0..{self.size}")
        return size

    def _complete(self, start: int, width: int) -> bytes:
        """Returns the memoised root of the aligned power-of-two subtree at start."""
        height = width.bit_length() - 1
        return self._levels[height][start >> height]

    def _subtree(self, start: int, n: int) -> bytes:
        """Returns MTH(D[start:start+n]) for n >= 1, in O(log n) hashes."""
        # Along the right spine every left part is a complete, memoised subtree.
        lefts: list[bytes] = []
        while not _is_power_of_two(n):
            k = _split(n)
            lefts.append(self._complete(start, k))
            start, n = start + k, n - k
        acc = self._complete(start, n)
        for left in reversed(lefts):
            acc = node_hash(left, acc, hasher=self._hasher)
        return acc


def verify_inclusion(
    *,
    leaf_hash: bytes,
    index: int,
    size: int,
    proof: Sequence[bytes],
    root: bytes,
    hasher: Hasher = blake3_hasher,
) -> bool:
    """Returns whether proof shows leaf_hash at index in the tree of size with root (RFC 9162 §2.1.3.2)."""
    if not 0 <= index < size:
        return False
    fn, sn = index, size - 1
    r = leaf_hash
    for p in proof:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r, hasher=hasher)
            # Climb past the levels where this node has no right sibling in the ragged tree.
            while not fn & 1 and fn != 0:
                fn, sn = fn >> 1, sn >> 1
        else:
            r = node_hash(r, p, hasher=hasher)
        fn, sn = fn >> 1, sn >> 1
    return sn == 0 and r == root


def verify_consistency(
    *,
    old_size: int,
    new_size: int,
    old_root: bytes,
    new_root: bytes,
    proof: Sequence[bytes],
    hasher: Hasher = blake3_hasher,
) -> bool:
    """Returns whether proof shows the tree (new_size, new_root) extends (old_size, old_root) (RFC 9162 §2.1.4.2)."""
    if not 0 <= old_size <= new_size:
        return False
    if old_size == new_size:
        return not proof and old_root == new_root
    if old_size == 0:
        # Every tree extends the empty one; only the empty root itself is checkable.
        return not proof and old_root == empty_root(hasher=hasher)
    if not proof:
        return False
    path = list(proof)
    # A power-of-two old tree is itself a node of the new tree, so PROOF omits its root.
    if _is_power_of_two(old_size):
        path.insert(0, old_root)
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn, sn = fn >> 1, sn >> 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr, hasher=hasher)
            sr = node_hash(c, sr, hasher=hasher)
            while not fn & 1 and fn != 0:
                fn, sn = fn >> 1, sn >> 1
        else:
            sr = node_hash(sr, c, hasher=hasher)
        fn, sn = fn >> 1, sn >> 1
    return sn == 0 and fr == old_root and sr == new_root
