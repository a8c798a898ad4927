"""A backend outage (every vLLM replica down) answers 503 `backend_unavailable`, and the
metrics and the request log record that 503, not a 500 with a traceback."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from engine.api.types import BackendUnavailableError
from tests.api_harness import LiveGateway, tiny_pair_gateway


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    with tiny_pair_gateway(tmp_path_factory.mktemp("outage")) as live:
        yield live


def test_a_backend_outage_is_counted_as_the_503_it_answers(
    gateway: LiveGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    def down(*_args: object, **_kwargs: object) -> tuple[int, ...]:
        raise BackendUnavailableError("no vLLM replica is up to tokenize the prompt")

    monkeypatch.setattr(gateway.services.backend, "tokenize", down)
    headers = {"authorization": f"Bearer {gateway.keys['app']}"}
    body = {"model": "target", "prompt": "hi", "max_tokens": 2}
    for _ in range(2):
        answer = httpx.post(gateway.base_url + "/v1/completions", json=body, headers=headers)
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "backend_unavailable"
    metrics = httpx.get(gateway.base_url + "/metrics").text
    assert 'specgate_requests_total{route="/v1/completions",status="503"} 2.0' in metrics
    assert 'route="/v1/completions",status="500"' not in metrics


def test_the_outage_leaves_no_traceback(
    gateway: LiveGateway, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    def down(*_args: object, **_kwargs: object) -> tuple[int, ...]:
        raise BackendUnavailableError("no vLLM replica is up to tokenize the prompt")

    monkeypatch.setattr(gateway.services.backend, "tokenize", down)
    headers = {"authorization": f"Bearer {gateway.keys['app']}"}
    body = {"model": "target", "prompt": "hi", "max_tokens": 2}
    answer = httpx.post(gateway.base_url + "/v1/completions", json=body, headers=headers)
    assert answer.status_code == 503
    logged = capfd.readouterr()
    assert "Traceback" not in logged.out + logged.err
    assert "unhandled_error" not in logged.out + logged.err

