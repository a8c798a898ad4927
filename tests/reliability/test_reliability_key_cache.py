"""The key cache: a repeat caller is authenticated without a database call, and a revoked key
stops working within ``key_cache_ttl_s`` (at once when revoked through this gateway)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.key_cache import KeyCache
from gateway.keys import Principal
from tests.api_harness import LiveGateway, fresh_database, gateway_settings, live_gateway
from tests.tiny_models import build_pair

TTL_S = 1.0
ALICE = Principal("key_1", "alice", "app")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_entry_lives_for_the_ttl_from_when_its_lookup_started() -> None:
    clock = FakeClock()
    cache = KeyCache(5.0, clock)
    assert cache.get("sg-a") is None
    lookup = cache.lookup()
    clock.now += 1.0  # the database took a second to answer
    cache.remember("sg-a", ALICE, lookup)
    assert cache.get("sg-a") == ALICE
    assert cache.get("sg-b") is None
    clock.now += 3.999
    assert cache.get("sg-a") == ALICE
    clock.now += 0.001  # 5 s after the lookup started
    assert cache.get("sg-a") is None


def test_a_revocation_here_forgets_by_id_or_name_and_outruns_a_lookup_in_flight() -> None:
    clock = FakeClock()
    cache = KeyCache(5.0, clock)
    cache.remember("sg-a", ALICE, cache.lookup())
    cache.forget("alice")
    assert cache.get("sg-a") is None
    cache.remember("sg-a", ALICE, cache.lookup())
    cache.forget("key_1")
    assert cache.get("sg-a") is None
    in_flight = cache.lookup()
    cache.forget("key_1")  # revoked while the lookup was on its way
    cache.remember("sg-a", ALICE, in_flight)
    assert cache.get("sg-a") is None


def test_a_zero_ttl_remembers_nothing() -> None:
    cache = KeyCache(0.0)
    cache.remember("sg-a", ALICE, cache.lookup())
    assert cache.get("sg-a") is None


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    root = tmp_path_factory.mktemp("key-cache")
    models = build_pair(root / "models")
    with fresh_database() as (name, url):
        settings = gateway_settings(models, root / "data", url, key_cache_ttl_s=TTL_S)
        with live_gateway(settings, name) as live:
            yield live


def _models(gateway: LiveGateway, key: str) -> int:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.get(gateway.base_url + "/v1/models", headers=headers, timeout=30).status_code


def test_a_cached_key_needs_no_database_call(
    gateway: LiveGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, key = gateway.services.keys.create("app", "cached-caller", "tests")
    assert _models(gateway, key) == 200
    calls: list[str] = []
    monkeypatch.setattr(gateway.services.keys, "authenticate", lambda key: calls.append(key))
    assert [_models(gateway, key) for _ in range(5)] == [200] * 5
    assert calls == []


def test_a_key_revoked_elsewhere_stops_working_within_the_ttl(gateway: LiveGateway) -> None:
    """Revoked in the database directly (another replica, ``specgate keys revoke``): the
    cached entry still serves until it is TTL_S old, and not a moment after."""
    _, key = gateway.services.keys.create("app", "revoked-elsewhere", "tests")
    assert _models(gateway, key) == 200
    revoked_at = time.monotonic()
    gateway.services.keys.revoke("revoked-elsewhere", "another-replica")
    while True:
        sent = time.monotonic()
        if _models(gateway, key) != 200:
            break
        assert sent - revoked_at < TTL_S, "served after the TTL"
        time.sleep(0.02)
    assert _models(gateway, key) == 401


def test_a_key_revoked_through_this_gateway_stops_working_at_once(gateway: LiveGateway) -> None:
    _, key = gateway.services.keys.create("app", "revoked-here", "tests")
    assert _models(gateway, key) == 200
    admin = {"authorization": f"Bearer {gateway.keys['admin']}"}
    response = httpx.delete(
        gateway.base_url + "/v1/admin/keys/revoked-here", headers=admin, timeout=30
    )
    assert response.status_code == 200
    assert _models(gateway, key) == 401


def test_an_unknown_key_is_asked_about_every_time(
    gateway: LiveGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = gateway.services.keys
    calls: list[str] = []
    real = keys.authenticate

    def counted(plaintext: str) -> Principal | None:
        calls.append(plaintext)
        return real(plaintext)

    monkeypatch.setattr(keys, "authenticate", counted)
    assert [_models(gateway, "sg-unknown") for _ in range(3)] == [401] * 3
    assert len(calls) == 3
