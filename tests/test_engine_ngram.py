"""Prompt lookup: which match is used, and how the continuation is copied."""

from hypothesis import given
from hypothesis import strategies as st

from engine.proposers.ngram import lookup


def test_longest_suffix_ngram_wins_over_a_later_shorter_match() -> None:
    context = [1, 2, 3, 7, 9, 3, 8, 1, 2, 3]
    assert lookup(context, 2, 1, 3) == [7, 9]


def test_most_recent_match_of_the_same_length_is_used() -> None:
    assert lookup([5, 1, 5, 2, 5], 1, 1, 1) == [2]


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
    m = earlier_starts(n)[-1]
    extended = context + proposal
    assert len(proposal) == k
    assert all(extended[m + n + i] == proposal[i] for i in range(k))
