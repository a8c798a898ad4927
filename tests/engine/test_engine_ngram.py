"""Prompt lookup: which match is used, how the continuation is copied, and how far adaptive k
may look from the copy in progress."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.api.types import SamplingParams
from engine.speculation.adaptive import PassCosts, SpeculationLength
from engine.speculation.proposers.ngram import ALIGNMENT_CAP, NgramProposer, find_match, lookup
from engine.speculation.request import Speculation


def test_longest_suffix_ngram_wins_over_a_later_shorter_match() -> None:
    context = [1, 2, 3, 7, 9, 3, 8, 1, 2, 3]
    assert lookup(context, 2, 1, 3) == [7, 9]


def test_most_recent_match_of_the_same_length_and_alignment_is_used() -> None:
    assert lookup([5, 1, 5, 2, 5], 1, 1, 1) == [2]


def test_the_match_whose_text_before_agrees_longest_wins_over_a_later_one() -> None:
    """An answer quoting a text: its last token also occurs in the answer's own earlier line
    (followed by 20), but the quoted source agrees for three tokens back (followed by 14)."""
    source = [10, 11, 12, 13, 14, 15]
    context = [*source, 99, 13, 20, 7, 11, 12, 13]
    assert lookup(context, 2, 1, 1) == [14, 15]
    match = find_match(context, 1, 1)
    assert match is not None and (match.start, match.aligned) == (4, 3)


def test_continuation_overlapping_the_end_repeats_the_period() -> None:
    assert lookup([4, 1, 2, 3, 1, 2, 3, 1, 2], 7, 1, 2) == [3, 1, 2, 3, 1, 2, 3]


def test_no_match_or_no_room_proposes_nothing() -> None:
    assert lookup([1, 2, 3, 4], 4, 1, 3) == []
    assert lookup([1], 4, 1, 3) == []
    assert lookup([1, 2, 1], 0, 1, 3) == []


def test_ngrams_shorter_than_min_n_are_not_matched() -> None:
    assert lookup([1, 2, 9, 3, 2], 2, 2, 3) == []


@given(
    context=st.lists(st.integers(0, 3), min_size=0, max_size=40),
    k=st.integers(1, 12),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 2),
)
def test_proposal_is_a_copy_of_what_followed_an_earlier_match(
    context: list[int], k: int, min_n: int, extra: int
) -> None:
    """Either nothing, or k tokens such that for some n in range, the suffix n-gram occurs at
    an earlier start m, no longer n-gram occurs earlier, and extending the context with the
    proposal repeats the text from m + n on: LZ77's overlapping copy."""
    max_n = min_n + extra
    proposal = lookup(context, k, min_n, max_n)
    size = len(context)

    def earlier_starts(n: int) -> list[int]:
        if n > size - 1:
            return []
        return [m for m in range(size - n) if context[m : m + n] == context[size - n :]]

    matched = [n for n in range(min_n, max_n + 1) if earlier_starts(n)]
    if not matched:
        assert proposal == []
        return
    n = max(matched)

    def aligned(m: int) -> int:  # tokens before m + n that equal the context's last ones
        count = 0
        while (
            count < min(ALIGNMENT_CAP, size - 1)
            and m + n - 1 - count >= 0
            and context[m + n - 1 - count] == context[size - 1 - count]
        ):
            count += 1
        return count

    m = max(earlier_starts(n), key=lambda start: (aligned(start), start))
    extended = context + proposal
    assert len(proposal) == k
    assert all(extended[m + n + i] == proposal[i] for i in range(k))
    match = find_match(context, min_n, max_n)
    assert match is not None and (match.start, match.aligned) == (m + n, aligned(m))


def test_the_reach_starts_at_the_copy_in_progress() -> None:
    """Before any accepted run, adaptive k may look one token ahead; once the committed text
    copies an earlier passage for 12 tokens, the n-gram proposer's copy sets the reach to 12
    at once (the engine-wide runs would take a fully accepted step per token)."""
    proposer = NgramProposer(1, 4)
    length = SpeculationLength(32, 0.5, PassCosts(), "ngram")
    speculation = Speculation(proposer, None, length)
    passage = list(range(100, 140))
    speculation.begin([*passage, 1, 2, 3])
    assert length.reach == 1  # no copy: nothing agrees before the last tokens
    speculation.committed([*passage, 1, 2, 3, *passage[:12]], 0, ())
    assert length.reach == 12 and length.candidate().cap == 12
    assert lookup([*passage, 1, 2, 3, *passage[:12]], 12, 1, 4) == passage[12:24]


def test_a_long_context_compares_only_the_latest_candidates() -> None:
    """A one-token n-gram that occurs thousands of times is matched in bounded work."""
    context = torch.randint(0, 4, (20_000,), generator=torch.Generator().manual_seed(0)).tolist()
    match = find_match(context, 1, 1)
    assert match is not None and context[match.start - 1] == context[-1]
    assert match.start >= 20_000 - 1 - 4 * 256  # among the latest hits


@given(
    prompt=st.lists(st.integers(0, 3), max_size=30),
    chunks=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), max_size=12),
    other=st.lists(st.integers(0, 3), max_size=30),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 2),
)
def test_an_index_kept_up_to_date_step_by_step_matches_as_a_fresh_one(
    prompt: list[int], chunks: list[list[int]], other: list[int], min_n: int, extra: int
) -> None:
    """The proposer's index follows its request's sequence as steps commit one or more tokens;
    its match (and so the proposal and the reach) is the one indexing the whole sequence at
    that step finds. Shared by sequences that are no extension of the first (a proposer
    serving several: another one, and one as long that differs in its last token), it indexes
    each afresh and still agrees."""
    max_n = min_n + extra
    proposer = NgramProposer(min_n, max_n)
    context = list(prompt)
    proposer.start(context)
    for chunk in chunks:
        context += chunk
        proposer.accepted(context)
        assert proposer.expected_run(context) == (
            0 if (m := find_match(context, min_n, max_n)) is None else m.aligned
        )
        proposal = proposer.propose(context, 5, SamplingParams(), torch.Generator())
        assert proposal.tokens == lookup(context, 5, min_n, max_n)
        twin = [*context[:-1], (context[-1] + 1) % 4]
        for sequence in (other, twin, context):
            fresh = find_match(sequence, min_n, max_n)
            assert proposer.expected_run(sequence) == (0 if fresh is None else fresh.aligned)
