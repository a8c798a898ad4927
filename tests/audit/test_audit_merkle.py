"""RFC 9162 proofs against a brute-force reference over random trees, and every corruption of
a proof rejected (flipped bit, wrong index, wrong size, truncated, extended, reordered)."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.audit.log import AuditLog
from gateway.audit.merkle import (
    CompactRange,
    ProofError,
    aligned_pieces,
    consistency_proof_ranges,
    inclusion_proof_ranges,
    leaf_hash,
    node_hash,
    perfect_pieces,
    range_hash,
    reference_root,
    verify_consistency,
    verify_inclusion,
)
from gateway.db import make_db_engine, upgrade_database


def leaves(n: int) -> list[bytes]:
    return [leaf_hash(f"event {i}".encode()) for i in range(n)]


def stored_nodes(hashes: list[bytes]) -> dict[tuple[int, int], bytes]:
    """Every perfect node, as the log stores them, built by appending to a compact range."""
    compact = CompactRange()
    nodes: dict[tuple[int, int], bytes] = {}
    for digest in hashes:
        nodes.update(compact.append(digest))
    return nodes


def reference_path(m: int, data: list[bytes]) -> list[bytes]:
    """RFC 9162 PATH(m, D[n]) literally, over a list of leaf hashes."""
    if len(data) == 1:
        return []
    k = 1
    while k * 2 < len(data):
        k *= 2
    if m < k:
        return [*reference_path(m, data[:k]), reference_root(data[k:])]
    return [*reference_path(m - k, data[k:]), reference_root(data[:k])]


def reference_subproof(m: int, data: list[bytes], whole: bool) -> list[bytes]:
    n = len(data)
    if m == n:
        return [] if whole else [reference_root(data)]
    k = 1
    while k * 2 < n:
        k *= 2
    if m <= k:
        return [*reference_subproof(m, data[:k], whole), reference_root(data[k:])]
    return [*reference_subproof(m - k, data[k:], False), reference_root(data[:k])]


def from_store(ranges: list[tuple[int, int]], nodes: dict[tuple[int, int], bytes]) -> list[bytes]:
    return [range_hash(a, b, nodes.__getitem__) for a, b in ranges]


sizes = st.integers(min_value=1, max_value=300)


@settings(max_examples=200, deadline=None)
@given(sizes, st.data())
def test_inclusion_proofs_match_the_reference_and_verify(n: int, data: st.DataObject) -> None:
    hashes = leaves(n)
    nodes = stored_nodes(hashes)
    root = reference_root(hashes)
    assert range_hash(0, n, nodes.__getitem__) == root
    index = data.draw(st.integers(0, n - 1))
    proof = from_store(inclusion_proof_ranges(index, n), nodes)
    assert proof == reference_path(index, hashes)
    verify_inclusion(index, n, hashes[index], proof, root)


@settings(max_examples=200, deadline=None)
@given(sizes, st.data())
def test_consistency_proofs_match_the_reference_and_verify(n: int, data: st.DataObject) -> None:
    hashes = leaves(n)
    nodes = stored_nodes(hashes)
    m = data.draw(st.integers(0, n))
    proof = from_store(consistency_proof_ranges(m, n), nodes)
    expected = reference_subproof(m, hashes, True) if 0 < m < n else []
    assert proof == expected
    verify_consistency(m, n, proof, reference_root(hashes[:m]), reference_root(hashes))


def _flips(proof: list[bytes]) -> list[list[bytes]]:
    corrupted = []
    for i, digest in enumerate(proof):
        for bit in (0, 7, 255):
            flipped = bytearray(digest)
            flipped[bit // 8] ^= 1 << (bit % 8)
            corrupted.append([*proof[:i], bytes(flipped), *proof[i + 1 :]])
    return corrupted


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 200), st.data())
def test_every_corrupted_inclusion_proof_is_rejected(n: int, data: st.DataObject) -> None:
    hashes = leaves(n)
    root = reference_root(hashes)
    index = data.draw(st.integers(0, n - 1))
    proof = reference_path(index, hashes)
    bad: list[tuple[int, int, bytes, list[bytes], bytes]] = []
    bad += [(index, n, hashes[index], p, root) for p in _flips(proof)]
    bad += [(i, n, hashes[index], proof, root) for i in (index - 1, index + 1) if 0 <= i < n]
    # A proof for size n, checked as if for another size (against that tree's root).
    longer = leaves(2 * n)
    bad += [
        (index, s, hashes[index], proof, reference_root(longer[:s]))
        for s in (n - 1, n + 1, 2 * n)
        if s > index
    ]
    bad.append((index, n, hashes[index], proof[:-1], root))
    bad.append((index, n, hashes[index], [*proof, proof[-1]], root))
    bad.append((index, n, hashes[index], proof[::-1], root) if len(proof) > 1 else bad[0])
    bad.append((index, n, leaf_hash(b"other"), proof, root))
    bad.append((index, n, hashes[index], proof, hashlib.sha256(root).digest()))
    bad.append((n, n, hashes[index], proof, root))
    for case in bad:
        if case[:4] == (index, n, hashes[index], proof) and case[4] == root:
            continue  # a reordering that changed nothing (palindromic proof)
        with pytest.raises(ProofError):
            verify_inclusion(*case)


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 200), st.data())
def test_every_corrupted_consistency_proof_is_rejected(n: int, data: st.DataObject) -> None:
    hashes = leaves(n)
    m = data.draw(st.integers(1, n - 1))
    old, new = reference_root(hashes[:m]), reference_root(hashes)
    proof = reference_subproof(m, hashes, True)
    bad: list[tuple[int, int, list[bytes], bytes, bytes]] = []
    bad += [(m, n, p, old, new) for p in _flips(proof)]
    longer = leaves(n + 1)
    bad += [(s, n, proof, reference_root(hashes[:s]), new) for s in (m - 1, m + 1) if 0 < s < n]
    bad += [(m, s, proof, old, reference_root(longer[:s])) for s in (n - 1, n + 1) if s > m]
    bad.append((m, n, proof[:-1], old, new))
    bad.append((m, n, [*proof, proof[-1]], old, new))
    bad.append((m, n, proof, hashlib.sha256(old).digest(), new))
    bad.append((m, n, proof, old, hashlib.sha256(new).digest()))
    bad.append((n + 1, n, proof, old, new))
    for case in bad:
        with pytest.raises(ProofError):
            verify_consistency(*case)


def test_a_fork_of_equal_size_is_rejected() -> None:
    hashes = leaves(5)
    other = [*hashes[:4], leaf_hash(b"forged")]
    verify_consistency(5, 5, [], reference_root(hashes), reference_root(hashes))
    with pytest.raises(ProofError, match="fork"):
        verify_consistency(5, 5, [], reference_root(hashes), reference_root(other))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 300), st.data())
def test_compact_range_and_pieces_rebuild_the_root(n: int, data: st.DataObject) -> None:
    hashes = leaves(n)
    nodes = stored_nodes(hashes)
    start = data.draw(st.integers(0, n))
    end = data.draw(st.integers(start, n))
    compact = CompactRange(start, [nodes[p] for p in perfect_pieces(0, start)])
    for digest in hashes[start:end]:
        compact.append(digest)
    for level, index in aligned_pieces(end, n):
        compact.append_subtree(level, nodes[(level, index)])
    assert compact.size == n
    assert compact.root() == reference_root(hashes)


def test_node_hash_is_rfc_9162() -> None:
    a, b = leaf_hash(b""), leaf_hash(b"\x00")
    assert a == hashlib.sha256(b"\x00").digest()
    assert node_hash(a, b) == hashlib.sha256(b"\x01" + a + b).digest()
    assert reference_root([a, b]) == node_hash(a, b)


def test_proofs_served_from_the_database_match_the_reference(tmp_path: Path) -> None:
    """The stored tree (interior nodes in the database, leaves hashed from their events)
    gives the reference proofs at every size."""
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    upgrade_database(url)
    db = make_db_engine(url)
    log = AuditLog(db)
    hashes = [log.append("request", None, {"i": i}).leaf_hash for i in range(37)]
    rng = random.Random(12)
    for n in range(1, 38):
        for m in {0, 1, n // 2, n - 1, n, rng.randint(0, n)}:
            if 0 <= m <= n:
                expected = reference_subproof(m, hashes[:n], True) if 0 < m < n else []
                assert log.consistency_proof(m, n) == expected
        index = rng.randrange(n)
        assert log.inclusion_proof(index, n) == reference_path(index, hashes[:n])
    db.dispose()


# The RFC 6962 test data of Certificate Transparency's Merkle tree tests, and the root hash of
# each prefix of it (also used by transparency-dev/merkle).
CT_LEAVES = [
    b"",
    b"\x00",
    b"\x10",
    b"\x20\x21",
    b"\x30\x31",
    b"\x40\x41\x42\x43",
    bytes(range(0x50, 0x58)),
    bytes(range(0x60, 0x70)),
]
CT_ROOTS = [
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]


def test_roots_match_the_rfc_6962_known_answers() -> None:
    compact = CompactRange()
    nodes: dict[tuple[int, int], bytes] = {}
    for size, (data, expected) in enumerate(zip(CT_LEAVES, CT_ROOTS, strict=True), start=1):
        nodes.update(compact.append(leaf_hash(data)))
        assert compact.root().hex() == expected
        assert range_hash(0, size, nodes.__getitem__).hex() == expected
