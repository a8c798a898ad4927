"""What the `completion` audit event holds: keyed commitments, never text, and the schedule."""

from __future__ import annotations

import hashlib
import hmac

from hypothesis import given
from hypothesis import strategies as st

from engine.api.types import GenerationStats
from gateway.privacy.commitments import CommitmentKey
from gateway.recording import (
    combined_stats,
    completion_payload,
    expand_runs,
    run_lengths,
    schedule_record,
)


def _stats(
    drafts: int, draft_tokens: int, accepted: int, output: int, fallback: bool
) -> GenerationStats:
    return GenerationStats(
        method="draft",
        num_prompt_tokens=9,
        num_output_tokens=output,
        num_drafts=drafts,
        num_draft_tokens=draft_tokens,
        num_accepted_tokens=accepted,
        num_target_passes=drafts + 1,
        fallback_active=fallback,
        time_to_first_token_s=0.02 * drafts,
        total_time_s=0.1 * drafts,
    )


def test_choices_add_up_into_one_figure() -> None:
    total = combined_stats([_stats(2, 8, 6, 10, False), _stats(3, 12, 3, 7, True)])
    assert total is not None
    assert (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens) == (5, 20, 9)
    assert (total.num_output_tokens, total.num_prompt_tokens, total.num_target_passes) == (17, 9, 7)
    assert total.fallback_active is True
    assert total.acceptance_rate == 9 / 20
    assert total.mean_acceptance_length == 1 + 9 / 5
    assert (total.time_to_first_token_s, total.total_time_s) == (0.04, 0.30000000000000004)
    assert combined_stats([]) is None


def test_completion_commits_to_text_under_a_key_and_never_holds_it() -> None:
    key = CommitmentKey(b"k" * 32, {"type": "deployment", "kek_id": "sha256:x"})
    stats = _stats(2, 8, 6, 17, False)
    stats.proposal_lengths = [3, 3, 3, 0, 0, 5]
    payload = completion_payload(
        request_event_id="e-1",
        outcome="ok",
        error=None,
        commitments=[key.commit(b"hello"), key.commit(b"world")],
        commitment_key=key.description,
        schedules=[schedule_record(stats), None],
        finish_reasons=["stop", "length"],
        prompt_tokens=9,
        completion_tokens=17,
        stats=stats,
        latency_s=0.5,
    )
    assert payload["completion_commitments"] == [
        hmac.new(b"k" * 32, b"hello", hashlib.sha256).hexdigest(),
        hmac.new(b"k" * 32, b"world", hashlib.sha256).hexdigest(),
    ]
    # A bare SHA-256 of a guessed text does not confirm it.
    assert hashlib.sha256(b"hello").hexdigest() not in str(payload)
    assert "hello" not in str(payload)
    assert payload["schedules"][0] == {
        "method": "draft",
        "fallback_active": False,
        "proposal_lengths": [[3, 3], [0, 2], [5, 1]],
        "max_batch_size": 1,
    }
    assert expand_runs(payload["schedules"][0]["proposal_lengths"]) == (3, 3, 3, 0, 0, 5)
    assert payload["speculative"]["acceptance_rate"] == 0.75


@given(st.lists(st.integers(min_value=0, max_value=16), max_size=200))
def test_schedules_round_trip_through_run_lengths(lengths: list[int]) -> None:
    assert expand_runs(run_lengths(lengths)) == tuple(lengths)
