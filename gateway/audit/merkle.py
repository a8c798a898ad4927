"""RFC 9162 Merkle tree hashing, proofs and their verification (standard library only).

Leaves are numbered from 0. ``MTH(D[start:end])`` is written ``range [start, end)``. Every
subtree that an RFC 9162 proof names is either *perfect* (2^level leaves starting at a multiple
of 2^level, stored by the log as node ``(level, start >> level)``) or a right-edge subtree that
splits into a few perfect ones (``perfect_pieces``). Proof generation is therefore two steps:
``*_proof_ranges`` says which ranges the proof holds, and the log reads the perfect nodes those
ranges are made of in one query and combines them with ``range_hash``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

HASH_SIZE = 32
EMPTY_ROOT = hashlib.sha256(b"").digest()

Node = tuple[int, int]  # (level, index): the perfect subtree of leaves [index << level, ...)
Range = tuple[int, int]  # [start, end)


class ProofError(ValueError):
    """A proof that does not verify; the message says why."""


def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def split_point(size: int) -> int:
    """The largest power of two smaller than ``size`` (size >= 2): RFC 9162's k."""
    return 1 << ((size - 1).bit_length() - 1)


def reference_root(leaves: Sequence[bytes]) -> bytes:
    """MTH over leaf hashes by the RFC's recursive definition (a reference, O(n) memory)."""
    if not leaves:
        return EMPTY_ROOT
    if len(leaves) == 1:
        return leaves[0]
    k = split_point(len(leaves))
    return node_hash(reference_root(leaves[:k]), reference_root(leaves[k:]))


def perfect_pieces(start: int, end: int) -> list[Node]:
    """The perfect subtrees, left to right, that an RFC subtree [start, end) is built from."""
    pieces: list[Node] = []
    while end - start > 0:
        size = end - start
        piece = size if size & (size - 1) == 0 else split_point(size)
        level = piece.bit_length() - 1
        pieces.append((level, start >> level))
        start += piece
    return pieces


def aligned_pieces(start: int, end: int) -> list[Node]:
    """The fewest perfect subtrees, left to right, that cover leaves [start, end) exactly."""
    pieces: list[Node] = []
    while start < end:
        level = (end - start).bit_length() - 1
        if start:
            level = min(level, (start & -start).bit_length() - 1)
        pieces.append((level, start >> level))
        start += 1 << level
    return pieces


def range_hash(start: int, end: int, nodes: Callable[[Node], bytes]) -> bytes:
    """MTH of the RFC subtree [start, end), from the perfect nodes ``nodes`` returns."""
    pieces = [nodes(piece) for piece in perfect_pieces(start, end)]
    if not pieces:
        return EMPTY_ROOT
    digest = pieces[-1]
    for left in reversed(pieces[:-1]):
        digest = node_hash(left, digest)
    return digest


def inclusion_proof_ranges(index: int, size: int) -> list[Range]:
    """RFC 9162 PATH(index, D[0:size]) as ranges, leaf side first."""
    if not 0 <= index < size:
        raise ValueError(f"leaf {index} is not in a tree of size {size}")
    ranges: list[Range] = []
    start, end = 0, size
    while end - start > 1:
        k = split_point(end - start)
        if index < start + k:
            ranges.append((start + k, end))
            end = start + k
        else:
            ranges.append((start, start + k))
            start += k
    return ranges[::-1]


def consistency_proof_ranges(old_size: int, new_size: int) -> list[Range]:
    """RFC 9162 PROOF(old_size, D[0:new_size]) as ranges; empty when old is 0 or equal."""
    if not 0 <= old_size <= new_size:
        raise ValueError(f"no consistency proof from size {old_size} to {new_size}")
    if old_size in (0, new_size):
        return []
    ranges: list[Range] = []
    start, end, m, whole = 0, new_size, old_size, True
    while m != end - start:
        k = split_point(end - start)
        if m <= k:
            ranges.append((start + k, end))
            end = start + k
        else:
            ranges.append((start, start + k))
            start, m, whole = start + k, m - k, False
    if not whole:
        ranges.append((start, end))
    return ranges[::-1]


def nodes_for(ranges: Iterable[Range]) -> set[Node]:
    """Every perfect node that ``ranges`` are built from (what the log must read)."""
    return {piece for start, end in ranges for piece in perfect_pieces(start, end)}


def verify_inclusion(
    index: int, size: int, leaf: bytes, proof: Sequence[bytes], root: bytes
) -> None:
    """RFC 9162 section 2.1.3.2; raises ProofError unless ``leaf`` is leaf ``index`` of the
    tree of ``size`` with ``root``."""
    if not 0 <= index < size:
        raise ProofError(f"leaf index {index} is outside a tree of size {size}")
    fn, sn, digest = index, size - 1, leaf
    for sibling in proof:
        _check_hash(sibling)
        if sn == 0:
            raise ProofError("inclusion proof is longer than the tree is deep")
        if fn & 1 or fn == sn:
            digest = node_hash(sibling, digest)
            while not fn & 1 and fn != 0:
                fn, sn = fn >> 1, sn >> 1
        else:
            digest = node_hash(digest, sibling)
        fn, sn = fn >> 1, sn >> 1
    if sn != 0:
        raise ProofError("inclusion proof is shorter than the tree is deep")
    if digest != root:
        raise ProofError("inclusion proof does not lead to the root hash")


def verify_consistency(
    old_size: int, new_size: int, proof: Sequence[bytes], old_root: bytes, new_root: bytes
) -> None:
    """RFC 9162 section 2.1.4.2; raises ProofError unless the tree (new_size, new_root)
    extends the tree (old_size, old_root)."""
    if not 0 <= old_size <= new_size:
        raise ProofError(f"a tree of size {new_size} cannot extend one of size {old_size}")
    if old_size == new_size:
        if proof:
            raise ProofError("a proof between equal sizes must be empty")
        if old_root != new_root:
            raise ProofError("two different root hashes for the same tree size (a fork)")
        return
    if old_size == 0:
        if proof:
            raise ProofError("a proof from the empty tree must be empty")
        return
    path = list(proof)
    for digest in path:
        _check_hash(digest)
    if old_size & (old_size - 1) == 0:
        path.insert(0, old_root)
    if not path:
        raise ProofError("consistency proof is empty")
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn, sn = fn >> 1, sn >> 1
    first = second = path[0]
    for digest in path[1:]:
        if sn == 0:
            raise ProofError("consistency proof is longer than needed")
        if fn & 1 or fn == sn:
            first, second = node_hash(digest, first), node_hash(digest, second)
            while not fn & 1 and fn != 0:
                fn, sn = fn >> 1, sn >> 1
        else:
            second = node_hash(second, digest)
        fn, sn = fn >> 1, sn >> 1
    if sn != 0:
        raise ProofError("consistency proof is shorter than needed")
    if first != old_root:
        raise ProofError(
            f"the tree of size {new_size} does not contain the old tree of size "
            f"{old_size} (history rewritten)"
        )
    if second != new_root:
        raise ProofError("consistency proof does not lead to the new root hash")


def _check_hash(digest: bytes) -> None:
    if not isinstance(digest, bytes) or len(digest) != HASH_SIZE:
        raise ProofError("a proof hash is not 32 bytes")


@dataclass
class CompactRange:
    """The perfect subtrees covering leaves [0, size): what appending needs to know.

    ``append`` returns the nodes that became complete, which the log stores.
    """

    size: int = 0
    hashes: list[bytes] = field(default_factory=list)  # largest subtree first

    def __post_init__(self) -> None:
        if len(self.hashes) != self.size.bit_count():
            raise ValueError(
                f"a compact range of size {self.size} has {self.size.bit_count()} "
                f"hashes, not {len(self.hashes)}"
            )

    def append(self, leaf: bytes) -> list[tuple[Node, bytes]]:
        return self.append_subtree(0, leaf)

    def append_subtree(self, level: int, digest: bytes) -> list[tuple[Node, bytes]]:
        """Add the perfect subtree of 2**level leaves that starts at ``size``."""
        if self.size % (1 << level):
            raise ValueError(f"a subtree of level {level} cannot start at leaf {self.size}")
        index, added = self.size >> level, 1 << level
        completed: list[tuple[Node, bytes]] = [((level, index), digest)]
        while index & 1:
            digest = node_hash(self.hashes.pop(), digest)
            level, index = level + 1, index >> 1
            completed.append(((level, index), digest))
        self.hashes.append(digest)
        self.size += added
        return completed

    def copy(self) -> CompactRange:
        return CompactRange(self.size, list(self.hashes))

    def root(self) -> bytes:
        if not self.hashes:
            return EMPTY_ROOT
        digest = self.hashes[-1]
        for left in reversed(self.hashes[:-1]):
            digest = node_hash(left, digest)
        return digest

    def nodes(self) -> list[Node]:
        """The (level, index) of each hash, largest first."""
        return perfect_pieces(0, self.size)
