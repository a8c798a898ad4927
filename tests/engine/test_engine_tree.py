"""Tree passes: masks and positions, KV compaction, and lossless tree verification.

The chi-square cases follow tests/engine/test_engine_sampling.py: Pearson's test at significance
0.001, bins under 5 expected pooled, seeded draws. Each known way to get tree verification
wrong is implemented here as a variant and shown to fail the same test, so the test would
catch it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from engine.models.loading import load_model
from engine.models.model_runner import ModelRunner
from engine.speculation.proposers.base import Proposal
from engine.speculation.sampling import TreeVerdict, sample, verify_tree_greedy, verify_tree_sampled
from engine.speculation.tree import ancestor_mask, children, depths, path_to
from tests.tiny_models import build_model, build_tokenizer

SIGNIFICANCE = 0.001

parents_strategy = st.lists(st.integers(min_value=-1, max_value=30), max_size=12).map(
    lambda raw: tuple(min(p, i - 1) for i, p in enumerate(raw))
)


def brute_ancestors(parents: tuple[int, ...], node: int) -> set[int]:
    seen = set()
    while node >= 0:
        seen.add(node)
        node = parents[node]
    return seen


@given(parents_strategy)
def test_each_node_sees_exactly_its_ancestors_and_sits_at_its_depth(
    parents: tuple[int, ...],
) -> None:
    mask = ancestor_mask(parents)
    assert mask[0].tolist() == [True] + [False] * len(parents)
    for node in range(len(parents)):
        ancestors = brute_ancestors(parents, node)
        expected = [True] + [i in ancestors for i in range(len(parents))]
        assert mask[node + 1].tolist() == expected
        assert depths(parents)[node] == len(ancestors)
        assert path_to(parents, node) == sorted(ancestors)


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    root: Path = tmp_path_factory.mktemp("tree")
    path = build_model(root / "m", build_tokenizer(), seed=3, hidden=64, layers=2)
    return ModelRunner(load_model(path, torch.device("cpu"), "float32"))


def fresh_last_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    runner.reset()
    return runner.forward(tokens)[-1]


PREFIX = [5, 17, 42, 8, 99, 23, 61]
TREE_PARENTS = (-1, -1, 0, 0, 1, 2, 4, -1, 6)
TREE_TOKENS = [11, 12, 13, 14, 15, 16, 17, 18, 19]


def tree_pass(runner: ModelRunner, positions: list[int] | None = None) -> torch.Tensor:
    runner.reset()
    runner.forward(PREFIX[:-1])
    committed = len(PREFIX)
    if positions is None:
        positions = [committed - 1 + d for d in (0, *depths(TREE_PARENTS))]
    return runner.forward(
        [PREFIX[-1], *TREE_TOKENS], positions=positions, tree_mask=ancestor_mask(TREE_PARENTS)
    )


def test_a_tree_pass_gives_each_node_the_logits_of_its_own_path(runner: ModelRunner) -> None:
    logits = tree_pass(runner)
    expected = [fresh_last_logits(runner, PREFIX)]
    for node in range(len(TREE_TOKENS)):
        path = [TREE_TOKENS[i] for i in path_to(TREE_PARENTS, node)]
        expected.append(fresh_last_logits(runner, [*PREFIX, *path]))
    torch.testing.assert_close(logits, torch.stack(expected), rtol=1e-4, atol=1e-4)


def test_sequential_positions_would_be_caught(runner: ModelRunner) -> None:
    """The known mistake: positions by index in the flattened tree instead of depth."""
    sequential = list(range(len(PREFIX) - 1, len(PREFIX) + len(TREE_TOKENS)))
    wrong = tree_pass(runner, positions=sequential)
    right = tree_pass(runner)
    assert not torch.allclose(wrong[2:], right[2:], atol=1e-3)


@pytest.mark.parametrize("path", [(1, 4, 6), (0, 3), (7,), (0, 2, 5), ()])
def test_keeping_a_path_equals_a_fresh_prefill_of_it(
    runner: ModelRunner, path: tuple[int, ...]
) -> None:
    tree_pass(runner)
    runner.keep_path(len(PREFIX), path)
    accepted = [TREE_TOKENS[i] for i in path]
    assert runner.length == len(PREFIX) + len(path)
    after = runner.forward([3, 4])
    fresh = runner_fresh = fresh_tail(runner, [*PREFIX, *accepted, 3, 4])
    del runner_fresh
    torch.testing.assert_close(after, fresh, rtol=1e-4, atol=1e-4)


def fresh_tail(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    runner.reset()
    return runner.forward(tokens)[-2:]


# --- verification -----------------------------------------------------------------------


def reference_verify_greedy(proposal: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """The chain verifier as it was before trees (frozen here as the reference)."""
    best = target_logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(proposal) and proposal[n] == best[n]:
        n += 1
    return n, best[n]


def reference_verify_sampled(
    proposal: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> tuple[int, int]:
    for i, token in enumerate(proposal):
        p = target_probs[i]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[token] = 1.0
        else:
            q = draft_probs[i]
        ratio = (p[token] / q[token]).item() if q[token] > 0 else 0.0
        u = torch.rand((), generator=generator, device=p.device).item()
        if u < ratio:
            continue
        residual = torch.clamp(p - q, min=0.0)
        total = residual.sum()
        return i, sample(residual / total if total > 0 else p, generator)
    return len(proposal), sample(target_probs[len(proposal)], generator)


@settings(max_examples=60)
@given(
    st.integers(min_value=0, max_value=6),
    st.integers(min_value=0, max_value=2**31),
    st.booleans(),
    st.booleans(),
)
def test_chains_verify_exactly_as_before(k: int, seed: int, with_q: bool, greedy: bool) -> None:
    vocab = 7
    torch.manual_seed(seed)
    logits = torch.randn(k + 1, vocab) * 2
    target_probs = torch.softmax(logits, dim=-1)
    q = torch.softmax(torch.randn(k, vocab), dim=-1) if with_q else None
    # Tokens often equal to the target's argmax, so that chains get accepted.
    best = logits.argmax(dim=-1).tolist()
    tokens = [best[i] if torch.rand(()) < 0.6 else int(torch.randint(vocab, ())) for i in range(k)]
    if greedy:
        verdict = verify_tree_greedy(Proposal(tokens), logits)
        assert (len(verdict.path), verdict.next_token) == reference_verify_greedy(tokens, logits)
    else:
        mine = torch.Generator().manual_seed(seed)
        theirs = torch.Generator().manual_seed(seed)
        verdict = verify_tree_sampled(Proposal(tokens, probs=q), target_probs, mine)
        expected = reference_verify_sampled(tokens, q, target_probs, theirs)
        assert (len(verdict.path), verdict.next_token) == expected
        # The same draws, in the same order: both generators are in the same state after.
        assert torch.equal(mine.get_state(), theirs.get_state())
    assert verdict.path == tuple(range(len(verdict.path)))


def test_greedy_walks_the_branch_of_the_argmax() -> None:
    vocab = 6
    # Root children 2, 4 (nodes 0, 1); node 1's children 0, 5 (nodes 2, 3).
    proposal = Proposal([2, 4, 0, 5], parents=(-1, -1, 1, 1))
    logits = torch.full((5, vocab), -5.0)
    for row, best in enumerate([4, 1, 5, 3, 2]):
        logits[row, best] = 5.0
    assert verify_tree_greedy(proposal, logits) == TreeVerdict((1, 3), 2)


# A two-level tree over a vocabulary of 5: the target's distribution at each row, a draft
# distribution q at each row (what a head predicts), and a proposer that picks each row's
# children as the top-2 of q (deterministic, so their true q is one-hot), or draws them.
VOCAB = 5
TARGET = torch.tensor([0.35, 0.05, 0.25, 0.15, 0.20])


def target_after(token: int) -> torch.Tensor:
    """The target's next-token distribution after ``token`` (a fixed, token-dependent p)."""
    return torch.roll(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]), token)


DRAFT = torch.tensor([0.45, 0.05, 0.30, 0.05, 0.15])  # differs from TARGET on purpose


def draft_after(token: int) -> torch.Tensor:
    return torch.roll(torch.tensor([0.1, 0.45, 0.05, 0.3, 0.1]), token)


def top2(q: torch.Tensor) -> list[int]:
    return torch.topk(q, 2).indices.tolist()


def topk_tree() -> tuple[Proposal, torch.Tensor, torch.Tensor]:
    """Root children: top-2 of DRAFT; each has children: top-2 of its draft_after. Returns the
    proposal (one-hot q: probs None), the target rows and the heads' rows (true q)."""
    tokens, parents, q_rows = [], [], []
    for first in top2(DRAFT):
        tokens.append(first)
        parents.append(-1)
        q_rows.append(DRAFT)
    for index, first in enumerate(list(tokens)):
        for second in top2(draft_after(first)):
            tokens.append(second)
            parents.append(index)
            q_rows.append(draft_after(first))
    target_rows = [TARGET] + [target_after(t) for t in tokens]
    return Proposal(tokens, parents=tuple(parents)), torch.stack(target_rows), torch.stack(q_rows)


def exact_pairs() -> dict[tuple[int, int], float]:
    return {
        (a, b): float(TARGET[a] * target_after(a)[b]) for a in range(VOCAB) for b in range(VOCAB)
    }


def first_two(proposal: Proposal, verdict: TreeVerdict) -> tuple[int, int]:
    """The first two output tokens of a step; when only one comes out, the second is drawn
    from the target after it (what the next step would do)."""
    out = [*(proposal.tokens[i] for i in verdict.path), verdict.next_token]
    return out[0], out[1] if len(out) > 1 else -1


Verifier = Callable[[Proposal, torch.Tensor, torch.Generator], TreeVerdict]


def chi_square_p(verifier: Verifier, samples: int = 4000, drawn: str = "") -> float:
    """``drawn``: "" top-k siblings; "iid", "distinct" or "distinct, first q" drawn ones."""
    exact = exact_pairs()
    counts: Counter[tuple[int, int]] = Counter()
    fixed = topk_tree()
    for seed in range(samples):
        generator = torch.Generator().manual_seed(seed)
        if drawn:
            proposal, target_rows, _ = drawn_tree(
                generator, distinct=drawn != "iid", honest=drawn != "distinct, first q"
            )
        else:
            proposal, target_rows, _ = fixed
        verdict = verifier(proposal, target_rows, generator)
        a, b = first_two(proposal, verdict)
        if b < 0:
            b = sample(target_after(a), generator)
        counts[(a, b)] += 1
    return pearson(counts, exact, samples)


def pearson(counts: Counter[tuple[int, int]], exact: dict[tuple[int, int], float], n: int) -> float:
    assert set(counts) <= {k for k, v in exact.items() if v > 0}, "an impossible output"
    observed, expected, pooled_o, pooled_e = [], [], 0.0, 0.0
    for key, prob in exact.items():
        if prob * n < 5:
            pooled_o += counts[key]
            pooled_e += prob * n
        else:
            observed.append(counts[key])
            expected.append(prob * n)
    if pooled_e > 0:
        observed.append(pooled_o)
        expected.append(pooled_e)
    scale = n / sum(expected)  # float32 probabilities sum to 1 only within rounding
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


# A draft sure of one token, which the target gives little mass: a sibling drawn after it
# without replacement is far likelier than its q before the removal says.
PEAKED = torch.tensor([0.04, 0.06, 0.05, 0.80, 0.05])


def drawn_tree(
    generator: torch.Generator, distinct: bool = False, honest: bool = True
) -> tuple[Proposal, torch.Tensor, torch.Tensor]:
    """Two root children drawn from PEAKED, each with two children drawn from draft_after: a
    sampling proposer with q per node. i.i.d. draws may coincide; ``distinct`` draws without
    replacement, where the second sibling's q is the first's with that token removed
    (``honest``) or, the mistake, the same q again."""
    tokens: list[int] = []
    parents: list[int] = []
    q_rows: list[torch.Tensor] = []

    def siblings(q: torch.Tensor, parent: int) -> None:
        first = sample(q, generator)
        second_q = q
        if distinct:
            second_q = q.clone()
            second_q[first] = 0.0
            second_q = second_q / second_q.sum()
        second = sample(second_q, generator)
        tokens.extend([first, second])
        parents.extend([parent, parent])
        q_rows.extend([q, second_q if honest else q])

    siblings(PEAKED, -1)
    for index in range(2):
        siblings(draft_after(tokens[index]), index)
    q_all = torch.stack(q_rows)
    target_rows = torch.stack([TARGET] + [target_after(t) for t in tokens])
    return Proposal(tokens, parents=tuple(parents), probs=q_all), target_rows, q_all


def test_tree_verification_of_top_k_siblings_is_exact() -> None:
    assert chi_square_p(verify_tree_sampled) > SIGNIFICANCE


def test_tree_verification_of_drawn_siblings_is_exact() -> None:
    assert chi_square_p(verify_tree_sampled, drawn="iid") > SIGNIFICANCE


def test_the_true_q_of_top_k_siblings_would_be_caught() -> None:
    """Mistake: verifying deterministic top-k picks against the heads' distribution."""
    _, _, q_rows = topk_tree()

    def with_true_q(proposal: Proposal, rows: torch.Tensor, g: torch.Generator) -> TreeVerdict:
        biased = Proposal(proposal.tokens, parents=proposal.parents, probs=q_rows)
        return verify_tree_sampled(biased, rows, g)

    assert chi_square_p(with_true_q) < SIGNIFICANCE


def test_skipping_the_residual_update_between_siblings_would_be_caught() -> None:
    def no_residual(proposal: Proposal, rows: torch.Tensor, g: torch.Generator) -> TreeVerdict:
        below = children(proposal.parent_indices())
        path: list[int] = []
        row = 0
        while True:
            p = rows[row]
            for node in below[row]:
                if torch.rand((), generator=g).item() < p[proposal.tokens[node]].item():
                    path.append(node)
                    row = node + 1
                    break
            else:
                residual = p.clone()
                for node in below[row]:
                    residual[proposal.tokens[node]] = 0.0  # only the last rejection's update
                return TreeVerdict(tuple(path), sample(residual / residual.sum(), g))

    assert chi_square_p(no_residual) < SIGNIFICANCE


def test_tree_verification_of_siblings_drawn_without_replacement_is_exact() -> None:
    assert chi_square_p(verify_tree_sampled, drawn="distinct") > SIGNIFICANCE


def test_distinct_siblings_verified_against_the_first_q_would_be_caught() -> None:
    """Mistake: avoiding duplicate siblings by drawing without replacement, yet verifying
    each against the distribution before the removal."""
    assert chi_square_p(verify_tree_sampled, drawn="distinct, first q") < SIGNIFICANCE


def test_duplicate_deterministic_siblings_are_refused() -> None:
    with pytest.raises(ValueError, match="duplicate siblings"):
        verify_tree_sampled(
            Proposal([1, 1], parents=(-1, -1)), torch.stack([TARGET] * 3), torch.Generator()
        )


def test_models_with_sliding_windows_verify_chains_only() -> None:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
    )
    runner = ModelRunner(MistralForCausalLM(config).eval())
    assert not runner.supports_trees
    runner.forward([1, 2, 3])
    with pytest.raises(ValueError, match="chains only"):
        runner.forward([4, 5, 6], positions=[3, 4, 4], tree_mask=ancestor_mask((-1, -1)))
    runner.forward([4, 5, 6])
    with pytest.raises(ValueError, match="prefixes only"):
        runner.keep_path(4, (1,))
    runner.keep_path(4, (0,))  # a chain's path is a plain truncate
    assert runner.length == 5
