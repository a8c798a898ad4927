"""The made-up company's workload (``bench.company``): deterministic for a seed, every
application in turn, every request a data subject's, and kept apart from the benchmark's prompt
sets and the demo's distillation prompts (a retrained proposer must not have seen them)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.company import APPS, company_requests
from engine.training.heads.train import demo_chats

PROMPTS = Path(__file__).resolve().parents[2] / "bench" / "prompts"


def _texts(bodies: list[dict]) -> set[str]:  # type: ignore[type-arg]
    return {m["content"] for body in bodies for m in body["messages"] if m["role"] == "user"}


def test_the_workload_is_seeded_and_rotates_through_the_applications() -> None:
    first = company_requests(40, seed=3)
    assert first == company_requests(40, seed=3)
    assert first != company_requests(40, seed=4)
    assert [app for app, _ in first[:8]] == [*APPS, *APPS]
    assert all(body["user"].startswith("employee-") for _, body in first)
    assert len(_texts([body for _, body in first])) > 30  # slots vary the prompts


def test_the_workload_shares_no_prompt_with_the_benchmark_or_the_demo_corpus() -> None:
    ours = _texts([body for _, body in company_requests(200)])
    bench = {
        json.loads(line)["messages"][-1]["content"]
        for path in PROMPTS.glob("*.jsonl")
        for line in path.read_text().splitlines()
        if line.strip()
    }
    demo = {messages[-1]["content"] for messages in demo_chats(200, 0)}
    assert bench and demo
    assert not ours & bench
    assert not ours & demo
