"""Draft trees: the shape helpers every pass over a tree needs.

A tree is given by ``parents``: the parent node index of each node in topological order (a
node after its parent), -1 for a child of the last committed token. In a pass the last
committed token is row 0 and node i is row i + 1; node i sits at position
``committed_len - 1 + depths[i]``, its depth, not its index in the flattened tree.
"""

from __future__ import annotations

import torch


def chain_parents(n: int) -> tuple[int, ...]:
    """The parents of a chain of ``n`` nodes: (-1, 0, 1, ..., n-2)."""
    return tuple(range(-1, n - 1))


def check_parents(parents: tuple[int, ...]) -> None:
    """Raise ValueError unless every node's parent is -1 or an earlier node."""
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i} has parent {parent}: parents must come first")


def depths(parents: tuple[int, ...] | list[int]) -> list[int]:
    """Depth of each node; a child of the last committed token has depth 1."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def ancestor_mask(parents: tuple[int, ...] | list[int]) -> torch.Tensor:
    """``[n+1, n+1]`` bool: row r may attend to column c. Row/column 0 is the last committed
    token; row i+1 is node i, which sees row 0, its ancestors and itself."""
    n = len(parents)
    mask = torch.zeros((n + 1, n + 1), dtype=torch.bool)
    mask[:, 0] = True
    for i, parent in enumerate(parents):
        row = i + 1
        if parent >= 0:
            mask[row] = mask[parent + 1]
        mask[row, row] = True
    return mask


def path_to(parents: tuple[int, ...] | list[int], node: int) -> list[int]:
    """Node indices from the root child down to ``node`` (inclusive); [] for node -1."""
    path: list[int] = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def children(parents: tuple[int, ...] | list[int]) -> list[list[int]]:
    """``children[r]`` lists the nodes under row r in order (row 0: the last committed token,
    row i+1: node i)."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        out[parent + 1].append(i)
    return out
