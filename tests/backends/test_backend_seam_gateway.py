"""The gateway serves whatever backend it is given: its model card, not the engine behind it,
names the model in `/v1/models` and versions the audit records (as a remote backend's
operator-supplied version would), and its answers reach the client unchanged."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import httpx
import pytest
import sqlalchemy as sa

from engine.api.types import GenerationRequest, SamplingParams, SpeculativeChoice
from gateway.app import FallbackListener, load_local_backend
from gateway.audit.schema import audit_events
from gateway.backends.base import BackendCard, Generation, GenerationBackend
from gateway.backends.local import LocalBackend
from gateway.settings import Settings
from tests.api_harness import LiveGateway, fresh_database, gateway_settings, live_gateway
from tests.tiny_models import build_pair

SERVED_AS = "relabelled-model"
OPERATOR_VERSION = "sha256:" + "ab" * 32


class RelabelledBackend:
    """The built-in engine under another card: what the gateway records must come from the
    card alone."""

    def __init__(self, inner: GenerationBackend) -> None:
        self.inner = inner
        self.card: BackendCard = dataclasses.replace(
            inner.card, model_name=SERVED_AS, target_version=OPERATOR_VERSION
        )
        self.render_chat = inner.render_chat
        self.tokenize = inner.tokenize
        self.compile_constraint = inner.compile_constraint
        self.health = inner.health
        self.fallback_state = inner.fallback_state
        self.speculation_crossover = inner.speculation_crossover
        self.speculation_speedup = inner.speculation_speedup
        self.divergence = inner.divergence
        self.close = inner.close

    def submit(self, request: GenerationRequest) -> Generation:
        return self.inner.submit(request)

    @property
    def queue_depth(self) -> int:
        return self.inner.queue_depth


def load_relabelled(settings: Settings, on_fallback: FallbackListener) -> GenerationBackend:
    return RelabelledBackend(load_local_backend(settings, on_fallback))


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    root = tmp_path_factory.mktemp("seam-gateway")
    models = build_pair(root / "models")
    with fresh_database() as (name, url):
        settings = gateway_settings(models, root / "data", url, method="none")
        with live_gateway(settings, name, load_relabelled) as running:
            yield running


def payloads(gateway: LiveGateway, kind: str) -> list[dict[str, object]]:
    with gateway.services.db.connect() as connection:
        query = sa.select(audit_events.c.payload).where(audit_events.c.kind == kind)
        return [row.payload for row in connection.execute(query.order_by(audit_events.c.seq))]


def test_the_card_names_the_model_and_versions_the_records(gateway: LiveGateway) -> None:
    headers = {"authorization": f"Bearer {gateway.keys['app']}"}
    models = httpx.get(gateway.base_url + "/v1/models", headers=headers, timeout=60).json()
    assert [(m["id"], m["target_version"]) for m in models["data"]] == [
        (SERVED_AS, OPERATOR_VERSION)
    ]
    body = {"model": SERVED_AS, "prompt": "hello there", "max_tokens": 8, "temperature": 0}
    reply = httpx.post(gateway.base_url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == SERVED_AS
    assert reply.json()["system_fingerprint"] == "fp_" + "ab" * 6

    backend = gateway.services.backend
    assert isinstance(backend, RelabelledBackend) and isinstance(backend.inner, LocalBackend)
    direct = backend.inner.engine.generate(
        GenerationRequest(
            prompt_ids=backend.tokenize("hello there"),
            sampling=SamplingParams(max_tokens=8, temperature=0.0),
            speculative=SpeculativeChoice(method="none"),
            request_id="direct",
        )
    )
    assert reply.json()["choices"][0]["text"] == direct.text

    (startup,) = payloads(gateway, "startup")
    assert (startup["model"], startup["target_version"]) == (SERVED_AS, OPERATOR_VERSION)
    assert startup["speculative_config"] == backend.card.speculative_config
    (request,) = payloads(gateway, "request")
    assert (request["model"], request["target_version"]) == (SERVED_AS, OPERATOR_VERSION)


def test_a_request_for_the_engine_own_name_is_not_found(gateway: LiveGateway) -> None:
    headers = {"authorization": f"Bearer {gateway.keys['app']}"}
    body = {"model": "target", "prompt": "hello", "max_tokens": 2}
    reply = httpx.post(gateway.base_url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == "model_not_found"
