"""Privacy by design on a live gateway and real PostgreSQL: content encrypted outside the chain,
keyed commitments, erasure by crypto-shredding, retention, legal holds, exact replay."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from engine.api.types import GenerationRequest, SamplingParams, SpeculativeChoice
from gateway.audit.canonical import canonical_json
from gateway.audit.schema import audit_events
from gateway.audit.verify import verify_export
from gateway.cli import app as specgate_cli
from gateway.privacy.commitments import ContentUnreadableError
from gateway.privacy.replay import Recorded, find_recorded, replay
from gateway.privacy.schema import privacy_content, privacy_data_keys
from gateway.privacy.store import LegalHoldError, PrivacyStore
from tests.api_harness import PG_SERVER, LiveGateway, fresh_database, gateway_settings, live_gateway
from tests.tiny_models import build_noisy_copy, build_pair

MODEL = "target"
CANARY = "canary-privacy-5d1e-Anna-Muster-salary"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    root = tmp_path_factory.mktemp("privacy")
    target, _ = build_pair(root / "models")
    # A draft that mostly agrees with the target: proposals are accepted in runs, so adaptive
    # k varies from step to step and the replays below exercise real schedules.
    models = (target, build_noisy_copy(target, root / "models" / "close", noise=0.3))
    with fresh_database() as (name, url):
        settings = gateway_settings(
            models,
            root / "data",
            url,
            store_content=True,
            # Speculation stays on, so that replays exercise the proposers.
            acceptance_threshold=0.0,
            fallback_min_speedup=0.0,
        )
        with live_gateway(settings, name) as live:
            yield live


@pytest.fixture()
def cli_env(gateway: LiveGateway, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = gateway.services.settings
    monkeypatch.setenv("SPECGATE_DATABASE_URL", f"{PG_SERVER}/{gateway.database}")
    monkeypatch.setenv("SPECGATE_AUDIT_MAC_KEY_PATH", str(settings.audit_mac_key_path))
    monkeypatch.setenv("SPECGATE_PRIVACY_KEK_PATH", str(settings.privacy_kek_path))


def privacy(gateway: LiveGateway) -> PrivacyStore:
    return gateway.services.privacy


def post(gateway: LiveGateway, body: dict[str, Any]) -> httpx.Response:
    headers = {"authorization": f"Bearer {gateway.keys['app']}"}
    response = httpx.post(
        gateway.base_url + "/v1/chat/completions",
        json={"model": MODEL, "max_tokens": 12, **body},
        headers=headers,
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response


def chat(gateway: LiveGateway, content: str, **body: Any) -> tuple[Recorded, str]:
    """Post a chat request; its recorded request and completion events, and its text."""
    response = post(gateway, {"messages": [{"role": "user", "content": content}], **body})
    event_id = response.headers["x-specgate-audit-id"]
    deadline = time.monotonic() + 10
    while True:
        try:
            recorded = find_recorded(gateway.services.audit, gateway.services.db, event_id)
            break
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    return recorded, response.json()["choices"][0]["message"]["content"]


def replay_http(gateway: LiveGateway, event_id: str, role: str = "auditor", **params: Any) -> Any:
    headers = {"authorization": f"Bearer {gateway.keys[role]}"}
    return httpx.post(
        f"{gateway.base_url}/v1/audit/replay/{event_id}",
        params=params,
        headers=headers,
        timeout=120,
    )


def export(gateway: LiveGateway, path: Path) -> str:
    headers = {"authorization": f"Bearer {gateway.keys['auditor']}"}
    text = httpx.get(gateway.base_url + "/v1/audit/export", headers=headers, timeout=60).text
    path.write_text(text, "utf-8")
    return text


def database_dump(gateway: LiveGateway) -> str:
    return subprocess.run(
        ["pg_dump", "--data-only", f"{PG_SERVER}/{gateway.database}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def test_content_is_encrypted_outside_the_chain_and_decrypts(gateway: LiveGateway) -> None:
    recorded, text = chat(gateway, CANARY, user="subject-roundtrip", temperature=0)
    request, completion = recorded.request.payload, recorded.completion.payload
    assert request["commitment_key"]["type"] == "data_key"
    assert completion["commitment_key"] == request["commitment_key"]
    stored = privacy(gateway).read_content(request["content"])
    assert stored["prompt"] == [{"role": "user", "content": CANARY}]
    assert (
        stored["prompt_token_ids"] and len(stored["prompt_token_ids"]) == request["prompt_tokens"]
    )
    output = privacy(gateway).read_content(completion["content"])
    assert output["choices"][0]["text"] == text
    key = privacy(gateway).existing_key(request["commitment_key"]["key_ref"])
    assert key is not None
    assert key.commitments.confirms(text.encode(), completion["completion_commitments"][0])


def test_no_text_or_subject_in_the_database_or_the_export(
    gateway: LiveGateway, tmp_path: Path
) -> None:
    stored, _ = chat(gateway, CANARY + "-dump", user="subject-canary-77")
    assert "content" in stored.request.payload
    plain, _ = chat(gateway, CANARY + "-unstored", user="subject-canary-77", store_content=False)
    assert plain.request.payload["commitment_key"]["type"] == "deployment"
    assert "content" not in plain.request.payload
    for where in (database_dump(gateway), export(gateway, tmp_path / "export.jsonl")):
        assert CANARY not in where
        assert "subject-canary-77" not in where
        # Not even a bare hash of the text someone might guess.
        assert hashlib.sha256((CANARY + "-dump").encode()).hexdigest() not in where


def test_erasure_shreds_content_and_commitments_while_the_log_verifies(
    gateway: LiveGateway, cli_env: None, tmp_path: Path
) -> None:
    recorded, text = chat(gateway, CANARY + "-erase", user="subject-erase", temperature=0)
    request, completion = recorded.request.payload, recorded.completion.payload
    key_ref = request["commitment_key"]["key_ref"]
    assert content_rows(gateway, key_ref) == 2  # the prompt's and the completion's
    runner = CliRunner()
    result = runner.invoke(specgate_cli, ["privacy", "erase", "--subject", "subject-erase"])
    assert result.exit_code == 0, result.output
    # The undecryptable ciphertext is deleted with the key; the chain keeps its commitments.
    assert content_rows(gateway, key_ref) == 0
    with pytest.raises(ContentUnreadableError, match="erased"):
        privacy(gateway).read_content(request["content"])
    # No key left in the deployment confirms the recorded commitment to the true text.
    with gateway.services.db.connect() as connection:
        refs = connection.execute(sa.select(privacy_data_keys.c.key_ref)).scalars().all()
    assert request["commitment_key"]["key_ref"] not in refs
    keys = [privacy(gateway).existing_key(ref) for ref in refs]
    candidates = [key.commitments for key in keys if key] + [
        privacy(gateway).deployment_commitments
    ]
    assert not any(
        c.confirms(text.encode(), completion["completion_commitments"][0]) for c in candidates
    )
    with gateway.services.db.connect() as connection:
        erasure = connection.execute(
            sa.select(audit_events.c.payload)
            .where(audit_events.c.kind == "erasure")
            .order_by(audit_events.c.seq.desc())
        ).first()
    assert erasure is not None
    assert erasure.payload["key_refs"] == [key_ref]
    assert erasure.payload["content_rows_deleted"] == 2
    assert "subject-erase" not in json.dumps(erasure.payload)
    # The export marks both events' content as erased and still verifies offline.
    lines = export(gateway, tmp_path / "export.jsonl").splitlines()
    erased = [json.loads(line) for line in lines if '"record":"erased"' in line]
    assert len(erased) == 1
    assert {recorded.request.event_id, recorded.completion.event_id} <= set(erased[0]["event_ids"])
    public_key = tmp_path / "public.pem"
    public_key.write_bytes(gateway.services.signer.public_key_pem())
    mac_key = str(gateway.services.settings.audit_mac_key_path)
    verified = runner.invoke(
        specgate_cli,
        [
            *("audit", "verify", str(tmp_path / "export.jsonl")),
            *("--public-key", str(public_key), "--mac-key", mac_key),
        ],
    )
    assert verified.exit_code == 0, verified.output
    assert "events erased" in verified.output
    assert gateway.services.audit.verify().ok
    assert replay_http(gateway, recorded.request.event_id).status_code == 409


def content_rows(gateway: LiveGateway, key_ref: str) -> int:
    with gateway.services.db.connect() as connection:
        count = sa.select(sa.func.count()).where(privacy_content.c.key_ref == key_ref)
        return int(connection.execute(count).scalar_one())


def test_erased_record_cannot_name_events_the_export_lacks(
    gateway: LiveGateway, tmp_path: Path
) -> None:
    lines = export(gateway, tmp_path / "export.jsonl").splitlines(keepends=True)
    lines = [line for line in lines if '"record":"erased"' not in line]
    forged = canonical_json({"record": "erased", "event_ids": ["not-an-event"]})
    tampered = [*lines[:-1], forged + "\n", lines[-1]]
    public_key = gateway.services.signer.public_key_pem()
    assert verify_export(lines, public_key).ok
    report = verify_export(tampered, public_key)
    assert not report.ok and "erased events not exported" in report.reason


def test_retention_destroys_exactly_the_expired_keys_and_holds_block_both(
    gateway: LiveGateway, cli_env: None, tmp_path: Path
) -> None:
    store = privacy(gateway)
    now = datetime.now(UTC)
    old, recent, held = (store.subject_ref(f"user:retention-{n}") for n in ("old", "new", "held"))
    old_data_key = store.data_key(old, now - timedelta(days=400))
    old_key = old_data_key.key_ref
    store.append_with_content("request", "tests", {}, old_data_key, "prompt", [CANARY])
    recent_key = store.data_key(recent, now - timedelta(days=100)).key_ref
    held_key = store.data_key(held, now - timedelta(days=400)).key_ref
    runner = CliRunner()
    placed = runner.invoke(specgate_cli, ["privacy", "hold", "--subject", "retention-held"])
    assert placed.exit_code == 0, placed.output

    destroyed = store.expire(365, "tests")
    assert destroyed == [old_key]
    assert content_rows(gateway, old_key) == 0
    assert store.existing_key(recent_key) is not None
    assert store.existing_key(held_key) is not None
    # The held subject cannot be erased either; the refusal is recorded.
    with pytest.raises(LegalHoldError):
        store.erase_subject(held, "tests")
    refused = runner.invoke(specgate_cli, ["privacy", "erase", "--subject", "retention-held"])
    assert refused.exit_code == 1
    assert store.existing_key(held_key) is not None

    released = runner.invoke(specgate_cli, ["privacy", "release", "--subject", "retention-held"])
    assert released.exit_code == 0, released.output
    expired = runner.invoke(specgate_cli, ["privacy", "expire", "--days", "365"])
    assert expired.exit_code == 0 and "1 data keys destroyed" in expired.output
    assert store.existing_key(held_key) is None

    with gateway.services.db.connect() as connection:
        rows = connection.execute(
            sa.select(audit_events.c.kind, audit_events.c.payload)
            .where(audit_events.c.kind.in_(["erasure", "legal_hold"]))
            .order_by(audit_events.c.seq)
        ).all()
    retention = [p for k, p in rows if k == "erasure" and p["cause"] == "retention"]
    assert [p["key_refs"] for p in retention] == [[old_key], [held_key]]
    assert [p["content_rows_deleted"] for p in retention] == [1, 0]
    holds = [(p["action"], p["subject_ref"]) for k, p in rows if k == "legal_hold"]
    assert holds == [("placed", held), ("released", held)]
    refusals = [p for k, p in rows if k == "erasure" and p["outcome"] == "refused_legal_hold"]
    assert [p["subject_ref"] for p in refusals] == [held, held]
    # With the expired ciphertext deleted, the log and an export still verify.
    assert gateway.services.audit.verify().ok
    lines = export(gateway, tmp_path / "export.jsonl").splitlines(keepends=True)
    assert verify_export(lines, gateway.services.signer.public_key_pem()).ok


@pytest.mark.parametrize("method", ["none", "ngram", "draft"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 11}])
def test_replay_is_bit_identical_for_each_method(
    gateway: LiveGateway, method: str, sampling: dict[str, Any]
) -> None:
    # 48 tokens: a greedy n-gram request's adaptive k proposes at least its probes then (one
    # after 8 plain steps that had a match), whatever the pass costs timed on a busy machine;
    # in 12 tokens of this random model's reply it may find too few matches to probe.
    recorded, _ = chat(
        gateway, "the cat sat on the mat the cat sat", speculative={"method": method},
        max_tokens=48, **sampling,
    )
    schedule = recorded.completion.payload["schedules"][0]
    assert schedule["method"] == method and not schedule["fallback_active"]
    proposed = sum(k * count for k, count in schedule["proposal_lengths"])
    assert (proposed > 0) == (method != "none")
    response = replay_http(gateway, recorded.request.event_id)
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["replayed"] and report["match"], report
    assert schedule["max_batch_size"] == report["choices"][0]["shared_batch"] == 1


def test_replay_of_an_unseeded_sampled_request_uses_the_drawn_seed_and_schedule(
    gateway: LiveGateway, cli_env: None
) -> None:
    recorded, _ = chat(gateway, "one two three one two three", temperature=1.0, max_tokens=32)
    sampling = recorded.request.payload["sampling"]
    assert sampling["seed_drawn"] is True and isinstance(sampling["seed"], int)
    schedule = recorded.completion.payload["schedules"][0]
    assert schedule["method"] == "draft" and not schedule["fallback_active"]
    assert len({k for k, _ in schedule["proposal_lengths"]}) > 1  # adaptive: k varied
    result = CliRunner().invoke(
        specgate_cli,
        [
            *("audit", "replay", recorded.request.event_id),
            *("--url", gateway.base_url, "--key", gateway.keys["admin"]),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "MATCH" in result.output


def test_replay_across_methods_greedy_matches_in_float32(gateway: LiveGateway) -> None:
    recorded, _ = chat(
        gateway, "a b c a b c a b", temperature=0, max_tokens=20, speculative={"method": "draft"}
    )
    for other in ("none", "ngram"):
        report = replay_http(gateway, recorded.request.event_id, method=other).json()
        assert report["replayed"] and report["match"], report


def test_replay_refuses_a_changed_model_version_and_sampled_cross_method(
    gateway: LiveGateway,
) -> None:
    recorded, _ = chat(gateway, "versions", temperature=0)
    changed = recorded.request.payload | {"target_version": "sha256:0000"}
    altered = Recorded(replace(recorded.request, payload=changed), recorded.completion)
    report = asyncio.run(replay(gateway.services.backend, privacy(gateway), altered))
    assert report["replayed"] is False and report["match"] is False
    assert any(d.startswith("target_version") for d in report["differences"])
    sampled, _ = chat(gateway, "sampled", temperature=0.8, seed=5)
    refused = replay_http(gateway, sampled.request.event_id, method="none")
    assert refused.status_code == 400
    assert replay_http(gateway, sampled.request.event_id, role="app").status_code == 403


def test_a_sampled_replay_needs_the_recorded_schedule(gateway: LiveGateway) -> None:
    """Seeded sampling draws differently under another schedule: the schedule is part of
    what makes a replay exact (here the recorded fixed k = 4 against k = 1 at every step)."""
    recorded, text = chat(
        gateway,
        "schedule",
        temperature=1.0,
        seed=11,
        max_tokens=24,
        speculative={"method": "draft"},
    )
    schedule = recorded.completion.payload["schedules"][0]
    lengths = [k for k, count in schedule["proposal_lengths"] for _ in range(count)]
    assert max(lengths) == 4
    prompt = privacy(gateway).read_content(recorded.request.payload["content"])
    sampling = recorded.request.payload["sampling"]
    request = GenerationRequest(
        tuple(prompt["prompt_token_ids"]),
        SamplingParams(max_tokens=24, temperature=1.0, seed=sampling["seed"]),
        SpeculativeChoice(method="draft", schedule=(1,) * len(lengths)),
    )
    other = gateway.services.backend.submit(request)
    assert asyncio.run(other.result_async()).text != text
    same = gateway.services.backend.submit(
        replace(request, speculative=SpeculativeChoice(method="draft", schedule=tuple(lengths)))
    )
    assert asyncio.run(same.result_async()).text == text


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def test_compliance_report_has_this_tests_figures_and_renders_in_chromium(
    gateway: LiveGateway, cli_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    settings = gateway.services.settings
    monkeypatch.setenv("SPECGATE_SIGNING_KEY_PATH", str(settings.signing_key_path))
    monkeypatch.setenv("SPECGATE_AUDIT_STATE_PATH", str(tmp_path / "report-state.json"))
    since = datetime.now(UTC)
    time.sleep(0.01)
    drafted = accepted = 0
    for index in range(3):
        body = {"messages": [{"role": "user", "content": f"report {index} a b a b"}]}
        usage = post(gateway, {**body, "temperature": 0, "speculative": {"method": "draft"}})
        drafted += usage.json()["speculative"]["num_draft_tokens"]
        accepted += usage.json()["speculative"]["num_accepted_tokens"]
    runner = CliRunner()
    erased = runner.invoke(specgate_cli, ["privacy", "erase", "--subject", "report-subject"])
    assert erased.exit_code == 0, erased.output
    until = datetime.now(UTC) + timedelta(seconds=1)
    out = tmp_path / "report.html"
    result = runner.invoke(
        specgate_cli,
        [
            *("compliance", "report", "--since", since.isoformat()),
            *("--until", until.isoformat(), "--out", str(out)),
        ],
    )
    assert result.exit_code == 0, result.output
    page = out.read_text("utf-8")
    assert drafted > 0
    # Self-contained: no script, nothing fetched from elsewhere.
    assert "<script" not in page and not re.search(r"(src|href)=[\"']?(https?:)?//", page)
    # A real browser renders it: the figures of this test's traffic are in the DOM it built.
    assert Path(CHROMIUM).exists(), "chromium is missing: `apt-get install -y chromium`"
    browser = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    dom = subprocess.run(
        [*browser, "--dump-dom", out.as_uri()], check=True, capture_output=True, text=True
    ).stdout
    assert 'id="requests">3<' in dom
    assert f'id="acceptance">{accepted / drafted:.1%}<' in dom
    assert 'id="erasures">1<' in dom
    assert 'class="ok">verified<' in dom
    assert dom.count("<svg") == 3
    assert "test-app" in dom and "auditor" in dom
    card = gateway.services.backend.card
    (draft,) = card.artefacts
    served = (
        f"<td>{card.target_version}</td>"
        f"<td>draft_model {draft['name']} {draft['version']}</td>"
    )
    assert f"{served}<td>" in dom
    screenshot = tmp_path / "report.png"
    subprocess.run(
        [*browser, "--window-size=1100,2600", f"--screenshot={screenshot}", out.as_uri()],
        check=True,
        capture_output=True,
    )
    assert screenshot.stat().st_size > 20_000
    keep = os.environ.get("SPECGATE_REPORT_SCREENSHOT")
    if keep:
        shutil.copy(screenshot, keep)


def test_content_storage_per_key_and_per_request(gateway: LiveGateway) -> None:
    """The server stores content here; a key can opt out, and a request's field wins."""
    _, plaintext = gateway.services.keys.create("app", "no-content", "tests", store_content=False)
    headers = {"authorization": f"Bearer {plaintext}"}

    def request_event(body: dict[str, Any]) -> dict[str, Any]:
        response = httpx.post(
            gateway.base_url + "/v1/chat/completions",
            json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
            | body,
            headers=headers,
            timeout=60,
        )
        assert response.status_code == 200, response.text
        record = gateway.services.audit.event(response.headers["x-specgate-audit-id"])
        assert record is not None
        return record.payload

    assert "content" not in request_event({})
    assert request_event({})["commitment_key"]["type"] == "deployment"
    assert "content" in request_event({"store_content": True})


def test_admin_api_sets_a_keys_content_storage_and_audits_it(gateway: LiveGateway) -> None:
    """Over HTTP: a key created with ``store_content``, listed with it, changed with PATCH
    (true, false, null: the server's setting), each change a `key` event by the admin."""
    admin = {"authorization": f"Bearer {gateway.keys['admin']}"}
    base = gateway.base_url + "/v1/admin/keys"
    created = httpx.post(
        base, json={"role": "app", "name": "api-no-content", "store_content": False},
        headers=admin, timeout=30,
    )  # fmt: skip
    assert created.status_code == 201, created.text
    assert created.json()["store_content"] is False
    key_id, plaintext = created.json()["key_id"], created.json()["key"]

    def listed() -> dict[str, Any]:
        response = httpx.get(base, headers=admin, timeout=30)
        assert response.status_code == 200, response.text
        return {key["name"]: key["store_content"] for key in response.json()}

    assert listed()["api-no-content"] is False and listed()["test-app"] is None

    def stores_content() -> bool:
        response = httpx.post(
            gateway.base_url + "/v1/chat/completions",
            json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "k"}]},
            headers={"authorization": f"Bearer {plaintext}"},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        record = gateway.services.audit.event(response.headers["x-specgate-audit-id"])
        assert record is not None
        return "content" in record.payload

    assert not stores_content()
    for value in (True, None, False):
        changed = httpx.patch(
            f"{base}/api-no-content", json={"store_content": value}, headers=admin, timeout=30
        )
        assert changed.status_code == 200, changed.text
        assert changed.json() == {
            "key_id": key_id, "name": "api-no-content", "role": "app", "store_content": value,
        }  # fmt: skip
        assert listed()["api-no-content"] is value
        # The server stores content here, so null (its setting) stores it as true does.
        assert stores_content() is (value is not False)

    for body, status in (({}, 400), ({"store_content": "yes"}, 400), ({"store": True}, 400)):
        refused = httpx.patch(f"{base}/{key_id}", json=body, headers=admin, timeout=30)
        assert refused.status_code == status and refused.json()["error"]["param"], refused.text
    missing = httpx.patch(f"{base}/no-such-key", json={"store_content": True}, headers=admin)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "key_not_found"
    app = {"authorization": f"Bearer {gateway.keys['app']}"}
    forbidden = httpx.patch(f"{base}/{key_id}", json={"store_content": True}, headers=app)
    assert forbidden.status_code == 403

    with gateway.services.db.connect() as connection:
        events = connection.execute(
            sa.select(audit_events.c.actor, audit_events.c.payload)
            .where(audit_events.c.kind == "key")
            .order_by(audit_events.c.seq)
        ).all()
    mine = [(actor, p) for actor, p in events if p["key_id"] == key_id]
    admin_id = gateway.services.keys.authenticate(gateway.keys["admin"])
    assert admin_id is not None
    assert [(p["action"], p.get("store_content", "absent")) for _, p in mine] == [
        ("created", False), ("updated", True), ("updated", None), ("updated", False),
    ]  # fmt: skip
    assert {actor for actor, _ in mine} == {admin_id.key_id}
    document = httpx.get(gateway.base_url + "/openapi.json", timeout=30).json()
    patch = document["paths"]["/v1/admin/keys/{key}"]["patch"]
    assert {"200", "400", "403", "404"} <= set(patch["responses"])
    info = document["components"]["schemas"]["KeyInfo"]["properties"]
    assert "store_content" in info
