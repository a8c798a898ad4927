"""With ``metrics_vllm_names`` the gateway's /metrics also carries vLLM's own series
(``vllm:spec_decode_*``, ``vllm:prompt_tokens``, ``vllm:generation_tokens``, labelled
``model_name``), with the same counts as the gateway's series, so a dashboard built for vLLM
reads the gateway unchanged; without it, no ``vllm:`` series appears."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.observability.metrics import Metrics
from tests.api_harness import LiveGateway, fresh_database, gateway_settings, live_gateway
from tests.tiny_models import build_pair

MODEL = "target"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    root = tmp_path_factory.mktemp("vllm-names")
    target, draft = build_pair(root / "models")
    with fresh_database() as (name, url):
        settings = gateway_settings(
            (target, draft), root / "data", url, metrics_vllm_names=True, cpu_threads=1
        )
        with live_gateway(settings, name) as running:
            yield running


def series(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_vllm_series_count_what_the_gateway_series_count(live: LiveGateway) -> None:
    headers = {"authorization": f"Bearer {live.keys['app']}"}
    for prompt in ([5, 9, 13] * 6, [7, 7, 30, 12] * 4):
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 24,
            "temperature": 0.0,
            "speculative": {"method": "ngram", "num_speculative_tokens": 3},
        }
        answer = httpx.post(
            live.base_url + "/v1/completions", json=body, headers=headers, timeout=60
        )
        assert answer.status_code == 200, answer.text
    found = series(httpx.get(live.base_url + "/metrics", timeout=30).text)
    model = frozenset({("model_name", MODEL)})
    ours = frozenset({("method", "ngram"), ("model", MODEL)})
    for figure in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        vllm = found[(f"vllm:spec_decode_{figure}_total", model)]
        assert vllm == found[(f"specgate_spec_decode_{figure}_total", ours)]
    assert found[("vllm:spec_decode_num_drafts_total", model)] > 0
    for tokens in ("prompt_tokens", "generation_tokens"):
        gateway = found[(f"specgate_{tokens}_total", frozenset({("model", MODEL)}))]
        assert found[(f"vllm:{tokens}_total", model)] == gateway
    per_pos = {
        dict(labels)["position"]: count
        for (name, labels), count in found.items()
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    }
    assert per_pos and sum(per_pos.values()) == found[
        ("vllm:spec_decode_num_accepted_tokens_total", model)
    ]


def test_without_the_option_no_vllm_series_appear() -> None:
    assert b"vllm:" not in Metrics().exposition()
