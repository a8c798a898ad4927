"""Teams, quotas and usage over real HTTP: two gateway replicas on one PostgreSQL database,
keys and teams with request and token limits set through the admin API, OpenAI's rate-limit
headers and 429s, the audit events of every change, and usage that adds up."""

from __future__ import annotations

import csv
import io
import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from gateway.audit.schema import audit_events
from tests.api_harness import LiveGateway, fresh_database, gateway_settings, live_gateway
from tests.tiny_models import build_pair

MODEL = "target"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 4}
HEADERS = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)
DURATION = re.compile(r"^(\d+h)?(\d+m)?\d+s$")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveGateway, ...]]:
    """Two gateways on one database, as two replicas behind a load balancer."""
    root = tmp_path_factory.mktemp("quotas")
    models = build_pair(root / "models")
    with fresh_database() as (name, url):
        # The replicas share the deployment's keys (in Kubernetes, Secrets), not their data.
        shared = {
            "key_cache_ttl_s": 0.0,
            "signing_key_path": root / "keys" / "signing.pem",
            "audit_mac_key_path": root / "keys" / "audit-mac-key",
            "privacy_kek_path": root / "keys" / "privacy-kek",
        }
        first = gateway_settings(models, root / "a", url, **shared)
        second = gateway_settings(models, root / "b", url, **shared)
        with (
            live_gateway(first, name, key_prefix="a") as a,
            live_gateway(second, name, key_prefix="b") as b,
        ):
            yield a, b


@pytest.fixture(scope="module")
def gateway(replicas: tuple[LiveGateway, ...]) -> LiveGateway:
    return replicas[0]


def admin(
    gateway: LiveGateway, method: str, path: str, body: Any = None, **params: str
) -> httpx.Response:
    return httpx.request(
        method,
        gateway.base_url + path,
        json=body,
        params=params,
        headers={"authorization": f"Bearer {gateway.keys['admin']}"},
        timeout=60,
    )


def app_key(gateway: LiveGateway, name: str, **quota: Any) -> tuple[str, str]:
    """A new app key (id, plaintext), with ``quota`` set if given."""
    created = admin(gateway, "POST", "/v1/admin/keys", {"role": "app", "name": name})
    assert created.status_code == 201, created.text
    key_id, plaintext = created.json()["key_id"], created.json()["key"]
    if quota:
        answer = admin(gateway, "PUT", f"/v1/admin/keys/{key_id}/quota", quota)
        assert answer.status_code == 200, answer.text
    return key_id, plaintext


def generate(
    gateway: LiveGateway, key: str, body: dict[str, Any] = CHAT, path: str = "/v1/chat/completions"
) -> httpx.Response:
    return httpx.post(
        gateway.base_url + path,
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )


def events(gateway: LiveGateway, kind: str) -> list[sa.Row[Any]]:
    with gateway.services.db.connect() as connection:
        query = sa.select(audit_events).where(audit_events.c.kind == kind)
        return list(connection.execute(query.order_by(audit_events.c.seq)))


def away_from_a_minute_boundary() -> None:
    """Start a burst where the minute window cannot roll over during it."""
    second = datetime.now(UTC).second
    if second > 45:
        time.sleep(61 - second)


def test_every_response_of_a_key_with_quotas_carries_the_rate_limit_headers(
    gateway: LiveGateway,
) -> None:
    _, key = app_key(gateway, "headers", rpm_limit=3, tpm_limit=100_000)
    away_from_a_minute_boundary()
    first = generate(gateway, key)
    assert first.status_code == 200, first.text
    assert all(name in first.headers for name in HEADERS), first.headers
    assert first.headers["x-ratelimit-limit-requests"] == "3"
    assert first.headers["x-ratelimit-remaining-requests"] == "2"
    assert first.headers["x-ratelimit-limit-tokens"] == "100000"
    assert first.headers["x-ratelimit-remaining-tokens"] == "100000"
    assert DURATION.match(first.headers["x-ratelimit-reset-requests"])
    assert DURATION.match(first.headers["x-ratelimit-reset-tokens"])

    with httpx.stream(
        "POST",
        gateway.base_url + "/v1/completions",
        json={**COMPLETION, "stream": True},
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    ) as streamed:
        assert streamed.status_code == 200
        assert all(name in streamed.headers for name in HEADERS)
        assert streamed.headers["x-ratelimit-remaining-requests"] == "1"
        used = first.json()["usage"]["total_tokens"]
        assert streamed.headers["x-ratelimit-remaining-tokens"] == str(100_000 - used)
        assert "[DONE]" in streamed.read().decode()

    bad = generate(gateway, key, {**CHAT, "speculative": {"method": "medusa"}})
    assert bad.status_code == 400
    assert all(name in bad.headers for name in HEADERS)

    refused = generate(gateway, key)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.json()["error"]["type"] == "requests"
    assert "3 requests per minute" in refused.json()["error"]["message"]
    assert all(name in refused.headers for name in HEADERS)
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert int(refused.headers["retry-after"]) >= 1


def test_an_exhausted_token_budget_is_429_with_the_headers(gateway: LiveGateway) -> None:
    _, key = app_key(gateway, "budget", token_budget=10, budget_period="day")
    served = generate(gateway, key)
    assert served.status_code == 200
    assert served.headers["x-ratelimit-limit-tokens"] == "10"
    assert served.json()["usage"]["total_tokens"] > 10  # admitted below the budget

    refused = generate(gateway, key)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
    assert refused.headers["x-ratelimit-limit-tokens"] == "10"
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
    now = datetime.now(UTC)
    midnight = datetime(now.year, now.month, now.day, tzinfo=UTC) + timedelta(days=1)
    hours, minutes, seconds = re.fullmatch(
        r"(?:(\d+)h)?(?:(\d+)m)?(\d+)s", refused.headers["x-ratelimit-reset-tokens"]
    ).groups()  # type: ignore[union-attr]
    reset = int(hours or 0) * 3600 + int(minutes or 0) * 60 + int(seconds)
    assert abs(reset - (midnight - now).total_seconds()) < 5
    # No request limit applies: the request headers are left out.
    assert "x-ratelimit-limit-requests" not in refused.headers


def test_two_replicas_admit_no_more_than_the_request_limit_between_them(
    replicas: tuple[LiveGateway, ...],
) -> None:
    a, b = replicas
    limit = 6
    _, solo = app_key(a, "burst", rpm_limit=limit)
    created = admin(a, "POST", "/v1/admin/teams", {"name": "burst-team", "rpm_limit": limit})
    assert created.status_code == 201, created.text
    members = []
    for name in ("burst-1", "burst-2"):
        key_id, key = app_key(a, name)
        moved = admin(a, "PUT", f"/v1/admin/keys/{key_id}/team", {"team": "burst-team"})
        assert moved.status_code == 200 and moved.json()["team"] == "burst-team"
        members.append(key)
    body = {**CHAT, "max_tokens": 1}
    for keys in ([solo], members):
        away_from_a_minute_boundary()
        calls = [(replica, keys[i % len(keys)]) for i, replica in enumerate([a, b] * 9)]
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(lambda call: generate(*call, body).status_code, calls))
        assert statuses.count(200) == limit, statuses
        assert statuses.count(429) == len(calls) - limit


def test_a_token_limit_is_passed_by_at_most_the_requests_in_flight(
    replicas: tuple[LiveGateway, ...],
) -> None:
    a, b = replicas
    _, key = app_key(a, "tokens", tpm_limit=1)
    away_from_a_minute_boundary()
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda replica: generate(replica, key), [a, b, a, b]))
    served = [answer for answer in answers if answer.status_code == 200]
    assert served  # nothing charged yet: the first is admitted
    # All of them ran at once at most; once charged, the window is closed.
    for replica in (a, b):
        after = generate(replica, key)
        assert after.status_code == 429 and after.json()["error"]["type"] == "tokens"
        charged = sum(answer.json()["usage"]["total_tokens"] for answer in served)
        assert after.headers["x-ratelimit-remaining-tokens"] == "0"
        assert charged >= 1


def test_quota_and_team_changes_are_audit_events(gateway: LiveGateway) -> None:
    key_id, _ = app_key(gateway, "audited", rpm_limit=5)
    team = admin(gateway, "POST", "/v1/admin/teams", {"name": "audited-team", "tpm_limit": 900})
    assert team.status_code == 201
    changed = admin(
        gateway,
        "PUT",
        "/v1/admin/teams/audited-team/quota",
        {"tpm_limit": 1000, "token_budget": 50_000, "budget_period": "month"},
    )
    assert changed.status_code == 200 and changed.json()["token_budget"] == 50_000
    moved = admin(gateway, "PUT", f"/v1/admin/keys/{key_id}/team", {"team": "audited-team"})
    assert moved.status_code == 200
    unknown = admin(gateway, "PUT", f"/v1/admin/keys/{key_id}/team", {"team": "nobody"})
    assert unknown.status_code == 404

    admin_id = gateway.services.keys.authenticate(gateway.keys["admin"])
    assert admin_id is not None
    quotas = [(row.actor, row.payload) for row in events(gateway, "quota")]
    assert (
        admin_id.key_id,
        {
            "subject": f"key:{key_id}",
            "rpm_limit": 5,
            "tpm_limit": None,
            "token_budget": None,
            "budget_period": "day",
        },
    ) in quotas
    team_quotas = [payload for _, payload in quotas if payload["subject"] == "team:audited-team"]
    assert [q["tpm_limit"] for q in team_quotas] == [900, 1000]
    assert [row.payload["name"] for row in events(gateway, "team")].count("audited-team") == 1
    membership = [
        row.payload
        for row in events(gateway, "key")
        if row.payload["key_id"] == key_id and row.payload["action"] == "team"
    ]
    assert [payload["team"] for payload in membership] == ["audited-team"]

    listed = admin(gateway, "GET", "/v1/admin/teams").json()
    audited = next(team for team in listed if team["name"] == "audited-team")
    assert audited["quota"]["tpm_limit"] == 1000
    assert admin(gateway, "GET", f"/v1/admin/keys/{key_id}/quota").json()["rpm_limit"] == 5


def test_usage_csv_and_json_sum_to_the_requests_made(gateway: LiveGateway) -> None:
    since = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=1)
    admin(gateway, "POST", "/v1/admin/teams", {"name": "billing"})
    made: dict[str, dict[str, int]] = {}
    for name, path, body, count in (
        ("usage-chat", "/v1/chat/completions", CHAT, 3),
        ("usage-text", "/v1/completions", COMPLETION, 2),
    ):
        key_id, key = app_key(gateway, name)
        admin(gateway, "PUT", f"/v1/admin/keys/{key_id}/team", {"team": "billing"})
        totals = made.setdefault(
            key_id, {"requests": 0, "prompt": 0, "completion": 0, "accepted": 0}
        )
        for _ in range(count):
            answer = generate(gateway, key, body, path)
            assert answer.status_code == 200
            totals["requests"] += 1
            totals["prompt"] += answer.json()["usage"]["prompt_tokens"]
            totals["completion"] += answer.json()["usage"]["completion_tokens"]
            totals["accepted"] += answer.json()["speculative"]["num_accepted_tokens"]
    exported = admin(gateway, "GET", "/v1/admin/usage", since=since.isoformat(), format="csv")
    assert exported.status_code == 200, exported.text
    assert exported.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(exported.text)))
    for key_id, totals in made.items():
        mine = [row for row in rows if row["key_id"] == key_id]
        assert {row["team"] for row in mine} == {"billing"}
        assert {row["model"] for row in mine} == {MODEL}
        assert all(row["bucket"].endswith(":00:00+00:00") for row in mine)
        assert sum(int(row["requests"]) for row in mine) == totals["requests"]
        assert sum(int(row["prompt_tokens"]) for row in mine) == totals["prompt"]
        assert sum(int(row["completion_tokens"]) for row in mine) == totals["completion"]
        assert sum(int(row["accepted_tokens"]) for row in mine) == totals["accepted"]
        assert sum(int(row["errors"]) for row in mine) == 0
    as_json = admin(gateway, "GET", "/v1/admin/usage", since=since.isoformat(), team="billing")
    assert as_json.status_code == 200
    assert sum(row["requests"] for row in json.loads(as_json.text)["data"]) == 5
