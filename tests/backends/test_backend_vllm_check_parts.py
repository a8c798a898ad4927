"""The parts behind the vLLM backend's replica checks, accepted tokens by position and tool
rendering that need no server (the real-server tests are in test_backend_vllm_checks.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from engine.api.chat import DEFAULT_TEMPLATE, hermes_messages
from gateway.backends.vllm_acceptance import IntervalAttribution, per_position
from gateway.backends.vllm_chat import template_renders_tools, tokenize_chat_body
from gateway.backends.vllm_replica_check import (
    CheckHistory,
    Expected,
    differences,
    read_metrics,
    read_served,
)
from gateway.backends.vllm_wire import accepted_per_position

MODELS = {"object": "list", "data": [{"id": "m", "max_model_len": 512}]}
SPECULATIVE_METRICS = "\n".join(
    [
        "process_start_time_seconds 1.79653844665e+09",
        "# TYPE vllm:spec_decode_num_drafts counter",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 3.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 2.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_created{model_name="m",position="0"} 1.7e9',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 0.0',
    ]
)  # fmt: skip
PLAIN_METRICS = 'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
MULTIPROCESS_METRICS = 'vllm:prompt_tokens_created{engine="0",model_name="m"} 1.5e+09\n'


def served(metrics: str, version: object = None) -> Any:
    return read_served(MODELS, version, read_metrics(metrics))


def test_what_a_replica_serves_is_read_from_vllms_endpoints() -> None:
    speculative = served(SPECULATIVE_METRICS, {"version": "0.32.0"})
    assert (speculative.models, speculative.max_model_len) == (("m",), {"m": 512})
    assert (speculative.speculative, speculative.num_speculative_tokens) == (True, 3)
    assert speculative.version == "0.32.0"
    plain = served(PLAIN_METRICS)
    assert (plain.speculative, plain.num_speculative_tokens, plain.version) == (False, None, None)


def test_a_restart_shows_as_another_start_time() -> None:
    # The process's start (10 ms), the first counter's creation (to the microsecond), names.
    assert read_metrics(SPECULATIVE_METRICS).started == "1.79653844665e+09 1.7e9 m"
    assert read_metrics(MULTIPROCESS_METRICS).started == "1.5e+09 m"
    assert read_metrics(PLAIN_METRICS).started is None


def test_each_difference_from_the_pool_is_named() -> None:
    speculative = Expected.for_replica("m", 512, "speculative", {"num_speculative_tokens": 3})
    plain = Expected.for_replica("m", 512, "plain", None)
    matching = served(SPECULATIVE_METRICS)
    assert differences(speculative, matching) == ()
    assert differences(plain, matching) == ("runs speculative decoding in the plain pool",)
    assert differences(speculative, served(PLAIN_METRICS)) == (
        "runs without speculative decoding (no vllm:spec_decode_* series)",
    )
    four = Expected.for_replica("m", 512, "speculative", {"num_speculative_tokens": 4})
    assert differences(four, matching) == ("speculates 3 tokens, not 4",)
    longer = Expected.for_replica("m", 1024, "speculative", None)
    assert differences(longer, matching) == ("max_model_len 512 < the gateway's 1024",)
    other = Expected.for_replica("n", None, "speculative", None)
    assert differences(other, matching) == ("serves ['m'], not 'n'",)


def test_only_news_is_reported() -> None:
    history = CheckHistory()
    expected = Expected.for_replica("m", 512, "speculative", {"num_speculative_tokens": 3})
    matching, restarted_plain = served(SPECULATIVE_METRICS), served(PLAIN_METRICS)
    outcomes = []
    for seen in (matching, matching, restarted_plain, restarted_plain, matching):
        _, news = history.judge("http://a", "speculative", expected, seen)
        outcomes.append(news.outcome if news is not None else None)
    assert outcomes == ["admitted", None, "refused", None, "admitted"]


def test_accepted_tokens_by_position_from_vllms_histogram_and_counters() -> None:
    # Steps that accepted 0, 1, 2, 3 of 3 draft tokens: 4, 2, 1, 0.
    assert per_position([4, 2, 1, 0]) == (3, 1)
    assert per_position([5, 0, 0, 0]) == ()
    assert accepted_per_position(SPECULATIVE_METRICS) == [2.0, 1.0, 0.0]
    assert accepted_per_position(PLAIN_METRICS) == []


def test_an_interval_increase_by_position_goes_to_that_interval_requests() -> None:
    async def run() -> list[tuple[int, ...]]:
        attribution = IntervalAttribution()
        attribution.settle({}, [10.0, 4.0, 1.0])  # the baseline
        first, second = attribution.wait(30), attribution.wait(10)
        attribution.settle({}, [18.0, 8.0, 1.0])
        return [(await f).num_accepted_tokens_per_pos for f in (first, second)]

    assert asyncio.run(run()) == [(6, 3), (2, 1)]


TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object"}},
}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
CHAT: list[dict[str, Any]] = [
    {"role": "user", "content": "go"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "done", "tool_call_id": "c1"},
]


def test_a_template_without_tools_gets_the_built_in_engines_hermes_messages() -> None:
    body = tokenize_chat_body(CHAT, [TOOL], DEFAULT_TEMPLATE, renders_tools=False)
    assert body["messages"] == hermes_messages(CHAT, [TOOL]) and "tools" not in body
    passed = tokenize_chat_body(CHAT, [TOOL], DEFAULT_TEMPLATE, renders_tools=True)
    assert passed["messages"] == CHAT and passed["tools"] == [TOOL]


def test_the_template_probe_compares_renderings_with_and_without_a_tool() -> None:
    assert not template_renders_tools(lambda body: [1, 2, 3])
    assert template_renders_tools(lambda body: [1, 2, 3, *([4] if "tools" in body else [])])
