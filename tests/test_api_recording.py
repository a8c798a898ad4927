"""What the `completion` audit event holds, with and without content storage."""

from __future__ import annotations

import hashlib

from engine.types import GenerationStats
from gateway.recording import combined_stats, completion_payload


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


def test_completion_text_is_hashed_and_stored_only_when_asked() -> None:
    common = {
        "request_event_id": "e-1",
        "outcome": "ok",
        "error": None,
        "texts": ["hello", "world"],
        "finish_reasons": ["stop", "length"],
        "prompt_tokens": 9,
        "completion_tokens": 17,
        "stats": _stats(2, 8, 6, 17, False),
        "latency_s": 0.5,
    }
    private = completion_payload(**common, store_content=False)  # type: ignore[arg-type]
    assert private["completion_sha256"] == [
        hashlib.sha256(b"hello").hexdigest(),
        hashlib.sha256(b"world").hexdigest(),
    ]
    assert "completions" not in private
    assert "hello" not in str(private)
    assert private["speculative"]["acceptance_rate"] == 0.75
    stored = completion_payload(**common, store_content=True)  # type: ignore[arg-type]
    assert stored["completions"] == ["hello", "world"]
