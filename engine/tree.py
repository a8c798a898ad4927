"""Shape helpers for a proposal tree (engine-interface: a chain is a one-branch tree).

``parents[i]`` is the index of node i's parent, -1 for a child of the last committed token;
nodes come in topological order (a node after its parent). Row/column 0 of a pass is the last
committed token, row i + 1 is node i.
"""

from __future__ import annotations

import torch


def chain_parents(n: int) -> tuple[int, ...]:
    """The parents of a chain of ``n`` nodes: (-1, 0, 1, ..., n - 2)."""
    return tuple(range(-1, n - 1))


def depths(parents: tuple[int, ...] | list[int]) -> list[int]:
    """Depth of every node; a root child has depth 1."""
    out: list[int] = []
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i} has parent {parent}: not in topological order")
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def ancestor_mask(parents: tuple[int, ...] | list[int]) -> torch.Tensor:
    """``[n + 1, n + 1]`` bool: row r may attend to column c (itself, its ancestors and row 0)."""
    n = len(parents)
    mask = torch.zeros((n + 1, n + 1), dtype=torch.bool)
    mask[:, 0] = True
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i} has parent {parent}: not in topological order")
        row = i + 1
        if parent >= 0:
            mask[row] = mask[parent + 1]
        mask[row, row] = True
    return mask


def path_to(parents: tuple[int, ...] | list[int], node: int) -> list[int]:
    """Node indices from the root child down to ``node`` (empty for node -1)."""
    path: list[int] = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]
