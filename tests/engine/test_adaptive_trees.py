"""Adaptive k for tree proposers (Medusa, EAGLE): each node's acceptance, and a proposal
priced whole."""

from __future__ import annotations

import pytest

from engine.speculation.adaptive import Candidate, NodeHits, PassCosts, SpeculationLength
from engine.speculation.proposers.base import Proposal
from engine.speculation.request import record_proposal_cost
from tests.decode_alone import adaptive, k_alone


def test_node_hits_count_each_node_and_carry_the_estimate_to_unseen_nodes() -> None:
    hits = NodeHits(6)
    for _ in range(8):
        hits.record(4, [0, 2])  # nodes 0 and 2 on the accepted path of a 4-node tree
    rates = hits.rates(prior=0.5, weight=1e-9)
    assert rates[:4] == pytest.approx([1.0, 0.0, 1.0, 0.0], abs=1e-6)
    assert rates[4:] == pytest.approx([0.0, 0.0], abs=1e-6)  # never proposed: as the node before
    shrunk = hits.rates(prior=0.5, weight=8.0)
    assert shrunk[0] == pytest.approx((8 + 8 * 0.5) / 16)
    assert shrunk[1] == pytest.approx(8 * shrunk[0] / 16)


def test_a_trees_expected_tokens_are_its_first_nodes_acceptance() -> None:
    length = SpeculationLength(6, 0.5, PassCosts(), "medusa", trees=True)
    for _ in range(200):
        length.record(6, 1, [3])  # only the fourth node is ever accepted
    candidate = length.candidate()
    assert candidate.cap == 6  # not one beyond the longest accepted run
    assert candidate.expected(3) == pytest.approx(1.0, abs=0.02)
    assert candidate.expected(4) == pytest.approx(2.0, abs=0.03)


class _TreeProposer:
    method = "eagle"
    proposes_trees = True
    most_tokens = 16

    def propose(self, *_args: object) -> Proposal:
        return Proposal([])


def test_a_tree_proposal_is_priced_whole_whatever_its_node_count() -> None:
    """A 4-node EAGLE proposal that took 20 ms costs 20 ms at 16 nodes too (its draft passes
    are its levels, not its nodes): per token it was charged 80 ms at k = 16, and adaptive k
    stayed small (EAGLE's auto rows behind its k = 4 rows)."""
    costs = PassCosts()
    for tokens in range(1, 18):
        costs.record_target(tokens, 0.05)
    record_proposal_cost(costs, _TreeProposer(), 0.02, 4)  # type: ignore[arg-type]
    assert costs.proposal("eagle") == pytest.approx(0.02)
    assert costs.proposer("eagle") == 0.0
    length = SpeculationLength(16, 0.5, costs, "eagle", trees=True)
    for _ in range(50):
        length.record(16, 2, [0, 5 + _ % 10])  # nodes deep in the ranking are accepted too
    candidate = length.candidate()
    assert candidate.overhead(4) == candidate.overhead(16) == pytest.approx(0.02)
    assert k_alone(adaptive(length)) == 16


def test_a_chain_proposers_cost_stays_per_token() -> None:
    costs = PassCosts()
    proposer = type("Chain", (), {"method": "draft", "proposes_trees": False})()
    record_proposal_cost(costs, proposer, 0.02, 4)
    assert costs.proposer("draft") == pytest.approx(0.005)
    assert Candidate([0.5] * 4, 0.005, 4).overhead(4) == pytest.approx(0.02)
