"""The unauthenticated probes besides ``/readyz``: ``/healthz`` and ``/livez`` (the process
answers), vLLM's ``/health`` and ``/version``, as probes and vLLM clients call them."""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import httpx
import pytest

from tests.api_harness import LiveGateway, tiny_pair_gateway

PROBES = ("/healthz", "/livez", "/health", "/version")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    with tiny_pair_gateway(Path(tmp_path_factory.mktemp("probes"))) as live:
        yield live


@pytest.mark.parametrize("path", ["/healthz", "/livez", "/health"])
def test_liveness_probes_answer_200_without_a_key(gateway: LiveGateway, path: str) -> None:
    reply = httpx.get(gateway.base_url + path)
    assert reply.status_code == 200
    assert reply.json() == {"status": "ok"}


def test_version_names_the_installed_package(gateway: LiveGateway) -> None:
    reply = httpx.get(gateway.base_url + "/version")
    assert reply.status_code == 200
    assert reply.json() == {"version": version("specgate")}


def test_the_document_lists_the_probes_without_key_errors(gateway: LiveGateway) -> None:
    paths = httpx.get(gateway.base_url + "/openapi.json").json()["paths"]
    for path in PROBES:
        assert set(paths[path]["get"]["responses"]) == {"200"}, path
