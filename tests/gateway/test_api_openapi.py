"""The served OpenAPI document tells the truth: schemathesis generates requests from it against
a live gateway (bounded examples per operation) and every answer must be a documented status,
content type and body; no 5xx from any generated input."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import (
    ignored_auth,
    negative_data_rejection,
    positive_data_acceptance,
)

from tests.api_harness import LiveGateway, fresh_database, gateway_settings, live_gateway
from tests.tiny_models import build_pair

EXAMPLES_PER_OPERATION = 25
# Whether a schema-valid request is accepted depends on more than the schema can say (the
# prompt's length against the context, the served model's id, stream_options only with
# stream), so the checks that judge acceptance are left out; every answer must still be
# documented (status, content type, body, headers) and none may be a 5xx.
# ``ignored_auth`` re-sends the case with the headers given here still attached; the role
# matrix in test_api_gateway covers missing and wrong keys.
SEMANTIC_CHECKS = [positive_data_acceptance, negative_data_rejection, ignored_auth]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    root = tmp_path_factory.mktemp("openapi")
    models = build_pair(root / "models")
    with fresh_database() as (name, url):
        settings_ = gateway_settings(models, root / "data", url)
        with live_gateway(settings_, name) as live:
            yield live


def _role(path: str) -> str:
    if path.startswith("/v1/audit"):
        return "auditor"
    if path.startswith("/v1/admin"):
        return "admin"
    return "app"


def test_every_generated_request_gets_a_documented_answer(gateway: LiveGateway) -> None:
    schema = schemathesis.openapi.from_url(gateway.base_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 12
    for operation in operations:
        _fuzz(operation, {"authorization": f"Bearer {gateway.keys[_role(operation.path)]}"})


def _fuzz(operation: Any, headers: dict[str, str]) -> None:
    """Bounded examples of one operation; every documented check must pass."""

    @given(case=operation.as_strategy())
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def check(case: schemathesis.Case) -> None:
        case.call_and_validate(headers=headers, timeout=60, excluded_checks=SEMANTIC_CHECKS)

    check()


def test_the_document_promises_no_422_and_names_the_stream_types(gateway: LiveGateway) -> None:
    document = httpx.get(gateway.base_url + "/openapi.json", timeout=30).json()
    for operations in document["paths"].values():
        for operation in operations.values():
            assert "422" not in operation["responses"]
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    assert chat["429"]["headers"]["Retry-After"]
    export = document["paths"]["/v1/audit/export"]["get"]["responses"]["200"]["content"]
    assert set(export) == {"application/x-ndjson", "text/csv"}
    key = document["paths"]["/v1/audit/public-key"]["get"]["responses"]["200"]["content"]
    assert set(key) == {"application/x-pem-file"}


def test_model_ids_with_a_slash_are_routed(gateway: LiveGateway) -> None:
    headers = {"authorization": f"Bearer {gateway.keys['app']}"}
    response = httpx.get(gateway.base_url + "/v1/models/org/model", headers=headers, timeout=30)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
