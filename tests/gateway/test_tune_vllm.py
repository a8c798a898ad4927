"""``tune measure`` on a vLLM-served model without vLLM: its pools from the settings, the
replay on each pool (an in-process transport answers as the servers do) and what `tune apply`
writes for it. The real servers are measured in
``tests/backends/test_backend_vllm.py::test_tune_measure_replays_recorded_requests_on_each_pool``."""

from __future__ import annotations

import json
from typing import Any

import httpx

from gateway.backends.vllm_acceptance import counter_increase
from gateway.settings import Settings
from gateway.tune.measure import VllmModel, figures
from gateway.tune.recommend import apply_to_config
from gateway.tune.sample import TuneRequest
from gateway.tune.vllm_pools import measure_vllm_model, vllm_pools

VERSION = "sha256:" + "ab" * 32
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
EAGLE = {"method": "eagle", "model": "/models/eagle", "num_speculative_tokens": 2}


def settings(*servers: dict[str, Any]) -> Settings:
    return Settings(backend={"kind": "vllm", "vllm_servers": list(servers)})


def test_the_pools_are_the_plain_one_then_each_speculative_configuration() -> None:
    pools = vllm_pools(
        settings(
            {"url": "http://spec-a:8000/", "model_version": VERSION, "speculative_config": NGRAM},
            {"url": "http://plain-a:8000", "model_version": VERSION},
            {"url": "http://spec-b:8000", "model_version": VERSION, "speculative_config": NGRAM},
            {"url": "http://plain-b:8000", "model_version": VERSION},
            {"url": "http://eagle:8000", "model_version": VERSION, "speculative_config": EAGLE},
        )
    )
    assert [(p.url, p.method, p.k) for p in pools] == [
        ("http://plain-a:8000", "none", None),
        ("http://spec-a:8000", "ngram", 3),
        ("http://eagle:8000", "eagle", 2),
    ]


def test_counter_increase_is_the_difference_of_two_reads() -> None:
    before = {"vllm:spec_decode_num_drafts": 4.0, "vllm:spec_decode_num_draft_tokens": 12.0}
    after = {
        "vllm:spec_decode_num_drafts": 7.0,
        "vllm:spec_decode_num_draft_tokens": 21.0,
        "vllm:spec_decode_num_accepted_tokens": 5.0,
    }
    increase = counter_increase(before, after)
    assert (increase.num_drafts, increase.num_draft_tokens, increase.num_accepted_tokens) == (
        3, 9, 5,
    )  # fmt: skip


class Servers:
    """Answers as a plain and an n-gram vLLM server do: the n-gram one reports per-request
    figures, or (``per_request`` False) only its /metrics counters."""

    def __init__(self, per_request: bool) -> None:
        self.per_request = per_request
        self.completions: list[tuple[str, dict[str, Any]]] = []
        self.drafts = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/metrics":
            text = (
                f"vllm:spec_decode_num_drafts_total {self.drafts}\n"
                f"vllm:spec_decode_num_draft_tokens_total {3 * self.drafts}\n"
                f"vllm:spec_decode_num_accepted_tokens_total {2 * self.drafts}\n"
            )
            return httpx.Response(200, text=text)
        assert request.url.path == "/v1/completions"
        body = json.loads(request.content)
        self.completions.append((host, body))
        tokens = list(range(body["max_tokens"]))
        chunks: list[dict[str, Any]] = [
            {"choices": [{"index": 0, "text": "x", "token_ids": [t], "finish_reason": None}]}
            for t in tokens
        ]
        chunks.append({"choices": [{"index": 0, "text": "", "token_ids": [],
                                    "finish_reason": "length"}]})  # fmt: skip
        usage: dict[str, Any] = {"choices": [], "usage": {"completion_tokens": len(tokens)}}
        if host == "spec":
            self.drafts += 2
            if self.per_request:
                usage["metrics"] = {"speculative_decoding": {
                    "num_spec_steps": 2, "num_draft_tokens": 6, "num_accepted_draft_tokens": 3,
                }}  # fmt: skip
        chunks.append(usage)
        stream = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=stream, headers={"content-type": "text/event-stream"})


def measured(per_request: bool) -> tuple[Servers, list[dict[str, Any]]]:
    own = settings(
        {"url": "http://plain", "model_version": VERSION},
        {"url": "http://spec", "model_version": VERSION, "speculative_config": NGRAM},
    )
    model = VllmModel("m", (), "served-m", "served-m", VERSION, 64, 1000, vllm_pools(own))
    requests = [
        TuneRequest("e1", "m", "/v1/completions code", {"max_tokens": 4, "temperature": 0},
                    prompt_ids=(5, 6, 7)),
        TuneRequest("e2", "m", "/v1/chat/completions chat", {"max_tokens": 50, "seed": 3},
                    prompt_ids=(8, 9)),
        TuneRequest("e3", "m", "/v1/completions code", {}, prompt_ids=(1,) * 60),
    ]  # fmt: skip
    servers = Servers(per_request)
    with httpx.Client(transport=httpx.MockTransport(servers)) as client:
        run = measure_vllm_model(model, requests, 2, 6, client)
    assert run.skipped == {"too_long_for_the_context": 1}
    return servers, figures(run)


def test_each_request_goes_to_each_pool_as_recorded_in_a_rotating_order() -> None:
    servers, clusters = measured(per_request=True)
    hosts = [host for host, _ in servers.completions]
    # 2 repeats x 2 requests, the pools' order rotating per request.
    assert hosts == ["plain", "spec", "spec", "plain", "spec", "plain", "plain", "spec"]
    bodies = {(host, tuple(body["prompt"])): body for host, body in servers.completions}
    for host in ("plain", "spec"):
        first, second = bodies[(host, (5, 6, 7))], bodies[(host, (8, 9))]
        assert (first["model"], first["max_tokens"], first["temperature"]) == ("served-m", 4, 0)
        assert (second["max_tokens"], second["seed"]) == (6, 3)  # capped at --max-tokens
    assert [c["cluster"] for c in clusters] == [
        "all", "/v1/chat/completions chat", "/v1/completions code"
    ]
    for cluster in clusters:
        plain, ngram = cluster["rows"]
        assert (plain["method"], plain["k"], plain["acceptance_rate"]) == ("none", None, None)
        assert plain["variant"] == "none (http://plain)"
        assert (ngram["method"], ngram["k"], ngram["variant"]) == (
            "ngram", 3, "ngram k=3 (http://spec)"
        )
        assert ngram["acceptance_rate"] == 0.5  # 3 of 6, vLLM's own per-request figures
        assert ngram["mean_accepted_length"] == 2.5


def test_without_per_request_figures_acceptance_is_the_counters_increase() -> None:
    _, clusters = measured(per_request=False)
    ngram = clusters[0]["rows"][1]
    assert ngram["acceptance_rate"] == round(2 / 3, 4)
    assert ngram["draft_tokens"] == 2 * 2 * 6  # 2 requests, 2 repeats, 6 draft tokens each


def test_apply_writes_a_vllm_models_method_and_leaves_its_pools_k() -> None:
    report = {
        "models": [
            {"name": "local", "backend": "local",
             "recommendation": {"method": "ngram", "k": 4}},
            {"name": "remote", "backend": "vllm",
             "recommendation": {"method": "none", "k": None}},
        ]
    }  # fmt: skip
    document = {"models": [{"name": "local"}, {"name": "remote", "backend": {"kind": "vllm"}}]}
    updated, change = apply_to_config(document, report)
    assert updated["models"] == [
        {"name": "local", "method": "ngram", "num_speculative_tokens": 4},
        {"name": "remote", "backend": {"kind": "vllm"}, "method": "none"},
    ]
    assert change == {"models": [
        {"name": "local", "method": "ngram", "num_speculative_tokens": 4},
        {"name": "remote", "method": "none"},
    ]}  # fmt: skip
