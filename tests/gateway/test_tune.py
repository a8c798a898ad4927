"""``specgate tune``: a small company's traffic recorded through a live gateway with content
stored, then measured offline on the configured tiny target (plain, n-gram, draft model and
Medusa heads, adaptive and fixed k), recommended, applied to a configuration file and
watched for acceptance drift. One subject is erased and one held before the measurement:
neither's content may be replayed."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import torch
import yaml
from typer.testing import CliRunner

from engine.models.loading import load_model, load_tokenizer
from engine.models.versioning import model_version
from engine.training.heads.train import HeadsSpec, build_data, train_medusa
from gateway.audit.log import record_from_row
from gateway.audit.records import EventRecord
from gateway.audit.schema import audit_events
from gateway.cli import app as specgate_cli
from gateway.privacy.store import user_subject
from gateway.tune.recommend import recommend
from tests.api_harness import LiveGateway, fresh_database, gateway_settings, live_gateway
from tests.heads_harness import quiet
from tests.tiny_models import SAMPLE_TEXT, build_model, build_noisy_copy, build_tokenizer

CANARY = "QZXCANARY"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SPEC = HeadsSpec(
    num_heads=2, snippets=8, prompt_tokens=8, answer_tokens=8, generation_batch=8,
    steps=8, rows_per_step=32, lr=1e-2,
)
MAX_TOKENS = "6"


@dataclass
class Company:
    gateway: LiveGateway
    config: Path
    ids: dict[str, list[str]]  # request event ids by user
    subject_refs: dict[str, str]


def _post(live: LiveGateway, key: str, route: str, body: dict[str, Any]) -> str:
    response = httpx.post(
        live.base_url + route,
        json={"model": "target", "max_tokens": 8, "temperature": 0, **body},
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.headers["x-specgate-audit-id"]


def _traffic(live: LiveGateway) -> dict[str, list[str]]:
    """A support bot (chat) and a code assistant (completions) for four users, and a third
    application whose key stores no content."""
    keys = live.services.keys
    support = keys.create("app", "support-bot", "tests")[1]
    code = keys.create("app", "code-assistant", "tests")[1]
    unstored = keys.create("app", "no-content-app", "tests", store_content=False)[1]
    ids: dict[str, list[str]] = {}
    users = ("alice", "bob", "carol", "dave")
    for index in range(16):
        user = users[index % 4]
        text = SAMPLE_TEXT[index % 5]
        body = {"messages": [{"role": "user", "content": f"{CANARY} {text}"}], "user": user}
        if index % 3 == 0:
            body["speculative"] = {"method": "ngram"}
        ids.setdefault(user, []).append(_post(live, support, "/v1/chat/completions", body))
    for index in range(12):
        user = users[index % 4]
        body = {"prompt": SAMPLE_TEXT[index % 5] + CANARY, "user": user}
        ids.setdefault(user, []).append(_post(live, code, "/v1/completions", body))
    for index in range(2):
        body = {"messages": [{"role": "user", "content": SAMPLE_TEXT[index]}], "user": "erin"}
        ids.setdefault("erin", []).append(_post(live, unstored, "/v1/chat/completions", body))
    return ids


@pytest.fixture(scope="module")
def company(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Company]:
    root = tmp_path_factory.mktemp("tune")
    target = build_model(root / "target", build_tokenizer(), seed=0, hidden=64, layers=2)
    draft = build_noisy_copy(target, root / "draft", noise=0.3)
    model = load_model(target, torch.device("cpu"), "float32")
    version = model_version(target)
    data = build_data(model, load_tokenizer(target), SAMPLE_TEXT, SPEC, version, quiet)
    heads, _ = train_medusa(model, data, SPEC, version, quiet)
    heads.save(root / "medusa")
    options: dict[str, Any] = {"acceptance_threshold": 0.0, "fallback_min_speedup": 0.0}
    with recorded_company(root, target, draft, root / "medusa", "draft", **options) as company:
        yield company


@contextmanager
def recorded_company(
    root: Path, target: Path, draft: Path, heads: Path, method: str, **options: Any
) -> Iterator[Company]:
    """A live gateway on a fresh PostgreSQL database serving ``target`` with ``heads`` (and
    ``draft`` loaded) by ``method``, content stored, ``options`` besides; the company's traffic
    recorded through it, bob's data erased and carol under a legal hold; its configuration
    file written as `specgate tune` reads it."""
    with fresh_database() as (name, url):
        settings = gateway_settings(
            (target, draft), root / "data", url, heads=heads, method=method,
            store_content=True, **options,
        )  # fmt: skip
        config = root / "gateway.yaml"
        written = {
            "target": str(target), "heads": str(heads), "method": method, "database_url": url,
            "data_dir": str(root / "data"), "device": "cpu", "dtype": "float32",
            "store_content": True,
        }  # fmt: skip
        if method == "draft":  # the file names the draft only where it serves by it
            written["draft"] = str(draft)
        config.write_text(yaml.safe_dump(written))
        with live_gateway(settings, name) as live:
            ids = _traffic(live)
            privacy = live.services.privacy
            refs = {user: privacy.subject_ref(user_subject(user)) for user in ids}
            privacy.erase_subject(refs["bob"], "tests")
            privacy.place_hold(refs["carol"], "tests")
            yield Company(live, config, ids, refs)


def _tune(company: Company, out: Path, *options: str) -> Any:
    result = CliRunner().invoke(
        specgate_cli,
        ["tune", "measure", "--config", str(company.config), "--out", str(out),
         "--max-tokens", MAX_TOKENS, "--k", "2", "--k", "4", *options],
    )
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def measured(company: Company, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tune-report")
    _tune(company, out)
    return out


def _events(company: Company, kind: str) -> list[EventRecord]:
    query = sa.select(audit_events).where(audit_events.c.kind == kind)
    with company.gateway.services.db.connect() as connection:
        return [record_from_row(row) for row in connection.execute(query)]


def test_measure_replays_every_method_per_cluster_without_erased_or_held_subjects(
    company: Company, measured: Path
) -> None:
    report = json.loads((measured / "tune.json").read_text())
    (model,) = report["models"]
    assert model["methods"] == ["none", "ngram", "draft", "medusa"]
    measured_ids = {r["id"] for r in report["requests"]}
    # The erased subject's, the held subject's and the unstored key's requests are not replayed.
    for user in ("bob", "carol", "erin"):
        assert not measured_ids & set(company.ids[user]), user
    assert measured_ids == set(company.ids["alice"] + company.ids["dave"])
    assert report["source"]["skipped"] == {"erased": 7, "legal_hold": 7, "content_not_stored": 2}
    clusters = {c["cluster"]: c for c in model["clusters"]}
    assert set(clusters) == {
        "all", "/v1/chat/completions support-bot", "/v1/completions code-assistant"
    }
    for cluster in clusters.values():
        variants = {(row["method"], row["k"]) for row in cluster["rows"]}
        assert variants == {("none", None)} | {
            (m, k) for m in ("ngram", "draft", "medusa") for k in ("auto", 2, 4)
        }
        for row in cluster["rows"]:
            assert row["tokens_per_second"] > 0
            assert row["latency_p50_s"] <= row["latency_p90_s"] <= row["latency_p99_s"]
            assert row["speedup_low"] <= row["speedup"] <= row["speedup_high"]
            if row["method"] == "none":
                assert row["acceptance_rate"] is None and row["speedup"] == 1.0
            else:
                assert 0.0 <= row["acceptance_rate"] <= 1.0
                assert 1.0 <= row["mean_accepted_length"] <= 1 + (row["k"] if row["k"] != "auto"
                                                                   else 32)
        assert cluster["recommendation"]["verdict"] in ("on", "off", "no_gain_shown")
    # The noisy-copy draft agrees with the target on most tokens.
    draft_rows = [r for r in clusters["all"]["rows"] if r["method"] == "draft"]
    assert max(r["acceptance_rate"] for r in draft_rows) > 0.3


def test_the_measure_run_is_an_audit_event_naming_the_sample_and_the_subjects_read(
    company: Company, measured: Path
) -> None:
    report = json.loads((measured / "tune.json").read_text())
    (event,) = [e for e in _events(company, "tune_measure") if e.event_id ==
                report["measure_event_id"]]
    payload = event.payload
    assert event.actor.startswith("cli:")
    assert set(payload["request_event_ids"]) == {r["id"] for r in report["requests"]}
    refs = company.subject_refs
    assert sorted(payload["subject_refs"]) == sorted([refs["alice"], refs["dave"]])
    assert payload["skipped"] == report["source"]["skipped"]


def test_the_report_holds_no_content(company: Company, measured: Path) -> None:
    for name in ("tune.json", "tune.html"):
        assert CANARY not in (measured / name).read_text()
    assert sorted(p.name for p in measured.iterdir()) == ["tune.html", "tune.json"]


def test_the_html_report_is_self_contained_and_renders_in_chromium(measured: Path) -> None:
    page = (measured / "tune.html").read_text()
    assert "<script" not in page and not re.search(r"(src|href)=[\"']?(https?:)?//", page)
    assert Path(CHROMIUM).exists(), "chromium is missing: `apt-get install -y chromium`"
    browser = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    dom = subprocess.run(
        [*browser, "--dump-dom", (measured / "tune.html").as_uri()],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout
    assert dom.count("<svg") == 1
    assert dom.count("<table>") == 3  # all, and each cluster
    assert "medusa k=auto" in dom and "support-bot" in dom


def test_the_chart_labels_fit_in_the_chart_whatever_their_length(tmp_path: Path) -> None:
    """Variant labels (a retrained artefact's, a vLLM pool's with its URL) are drawn whole:
    Chromium lays them out at x >= 0 in the SVG."""
    from gateway.tune.report import speedup_chart

    labels = ("none", "medusa k=4 (retrained)", "ngram k=3 (http://127.0.0.1:40123)")
    rows = [
        {"variant": label, "method": label.split()[0], "speedup": 1.0 + i / 4,
         "speedup_low": 0.9 + i / 4, "speedup_high": 1.1 + i / 4}
        for i, label in enumerate(labels)
    ]  # fmt: skip
    page = tmp_path / "chart.html"
    page.write_text(
        "<!doctype html><body>" + speedup_chart(rows) + "<script>document.body.dataset.left ="
        " Math.min(...[...document.querySelectorAll('text')].map(t => t.getBBox().x));"
        "</script></body>"
    )
    browser = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    dom = subprocess.run(
        [*browser, "--dump-dom", page.as_uri()],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout
    found = re.search(r'data-left="(-?[0-9.e-]+)"', dom)
    assert found is not None, dom[-500:]
    assert float(found.group(1)) >= 0


def test_apply_writes_the_recommendation_and_an_audit_event_with_the_report_hash(
    company: Company, measured: Path, tmp_path: Path
) -> None:
    config = tmp_path / "gateway.yaml"
    shutil.copy(company.config, config)
    report_path = measured / "tune.json"
    result = CliRunner().invoke(
        specgate_cli, ["tune", "apply", "--report", str(report_path), "--config", str(config)]
    )
    assert result.exit_code == 0, result.output
    recommendation = json.loads(report_path.read_text())["models"][0]["recommendation"]
    written = yaml.safe_load(config.read_text())
    assert written["method"] == recommendation["method"]
    k = recommendation["k"]
    assert written["num_speculative_tokens"] == (k if isinstance(k, int) else None)
    assert written["target"] == yaml.safe_load(company.config.read_text())["target"]
    digest = hashlib.sha256(report_path.read_bytes()).hexdigest()
    (event,) = [e for e in _events(company, "tune_apply") if e.payload["config"] ==
                str(config.resolve())]
    assert event.payload["report_sha256"] == digest
    assert event.payload["change"]["method"] == recommendation["method"]


def test_recommendation_is_off_where_speculation_slows_down_and_advises_under_60_percent() -> None:
    def row(method: str, k: Any, speedup: float, low: float, high: float, rate: float | None
            ) -> dict[str, Any]:
        return {"variant": f"{method} {k}", "method": method, "k": k, "speedup": speedup,
                "speedup_low": low, "speedup_high": high, "acceptance_rate": rate}

    plain = row("none", None, 1.0, 1.0, 1.0, None)
    slower = recommend([plain, row("ngram", "auto", 0.8, 0.7, 0.9, 0.2)])
    assert slower["verdict"] == "off" and slower["method"] == "none"
    assert any("under 60%" in a for a in slower["advice"])
    assert any("draft model or EAGLE" in a for a in slower["advice"])
    unclear = recommend([plain, row("draft", 4, 1.1, 0.95, 1.3, 0.7)])
    assert unclear["verdict"] == "no_gain_shown" and unclear["method"] == "none"
    faster = recommend(
        [plain, row("draft", 4, 1.6, 1.3, 1.9, 0.8), row("draft", 2, 1.7, 0.9, 2.5, 0.9)]
    )
    assert (faster["verdict"], faster["method"], faster["k"]) == ("on", "draft", 4)
    assert (faster["speedup_low"], faster["speedup_high"]) == (1.3, 1.9)


def test_watch_flags_acceptance_below_the_measured_rate_or_the_floor(
    company: Company, measured: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = json.loads((measured / "tune.json").read_text())
    for row in report["models"][0]["clusters"][0]["rows"]:
        if row["method"] != "none":
            row["acceptance_rate"] = 1.0  # the traffic now accepts less than this
    expecting = tmp_path / "expecting.json"
    expecting.write_text(json.dumps(report))
    metrics = tmp_path / "tune.prom"
    base = ["tune", "watch", "--config", str(company.config), "--window-tokens", "10000"]
    drifting = CliRunner().invoke(
        specgate_cli, [*base, "--report", str(expecting), "--metrics-file", str(metrics)]
    )
    assert drifting.exit_code == 1, drifting.output
    assert "target draft:" in drifting.output and "DRIFT" in drifting.output
    text = metrics.read_text()
    assert 'specgate_tune_acceptance_drift{model="target",method="draft"} 1' in text
    assert 'specgate_tune_expected_acceptance{model="target",method="draft"} 1' in text
    calm = CliRunner().invoke(
        specgate_cli,
        [*base, "--report", str(expecting), "--floor", "0", "--margin", "1"],
    )
    assert calm.exit_code == 0, calm.output


def test_measure_reads_an_operator_jsonl_file(company: Company, tmp_path: Path) -> None:
    requests = tmp_path / "requests.jsonl"
    lines = [
        {"model": "target", "messages": [{"role": "user", "content": text}], "temperature": 0,
         "metadata": {"app": "wiki"}}
        for text in SAMPLE_TEXT[:3]
    ] + [{"model": "target", "prompt": SAMPLE_TEXT[3], "max_tokens": 4}]
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    _tune(company, out, "--requests", str(requests))
    report = json.loads((out / "tune.json").read_text())
    assert [r["id"] for r in report["requests"]] == [f"requests.jsonl:{n}" for n in range(1, 5)]
    clusters = {c["cluster"] for c in report["models"][0]["clusters"]}
    assert clusters == {"all", "/v1/chat/completions wiki", "/v1/completions"}
    (event,) = [e for e in _events(company, "tune_measure") if e.event_id ==
                report["measure_event_id"]]
    assert event.payload["source"] == "file" and event.payload["subject_refs"] == []
    assert event.payload["sha256"] == hashlib.sha256(requests.read_bytes()).hexdigest()


def test_the_compliance_report_lists_each_tuning_run_and_the_content_it_read(
    company: Company, measured: Path
) -> None:
    from datetime import UTC, datetime, timedelta

    from gateway.privacy.report import collect
    from gateway.privacy.report_html import render_html

    report = json.loads((measured / "tune.json").read_text())
    now = datetime.now(UTC)
    data = collect(company.gateway.services.db, now - timedelta(hours=1), now + timedelta(hours=1))
    (run,) = [r for r in data.tuning_runs
              if set(r.get("request_event_ids", ())) == {q["id"] for q in report["requests"]}]
    assert len(run["subject_refs"]) == 2
    page = render_html(data)
    rows = page.split("id='tuning-runs'")[1].split("</table>")[0]
    assert "<td>audit_log</td><td>14</td><td>2</td>" in rows
    assert "content_not_stored: 2, erased: 7, legal_hold: 7" in rows


@pytest.mark.parametrize("command", ["measure", "train"])
def test_nothing_is_read_when_the_run_cannot_be_recorded(
    company: Company, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """Neither measuring nor training reads content (or trains) unless its run is recorded."""
    from gateway.audit.log import AuditLog, AuditUnavailableError
    from gateway.privacy.store import PrivacyStore

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise AuditUnavailableError("audit store unavailable: test")

    reads: list[Any] = []
    monkeypatch.setattr(AuditLog, "append", refuse)
    monkeypatch.setattr(PrivacyStore, "read_content", lambda _self, c: reads.append(c))
    result = CliRunner().invoke(
        specgate_cli,
        ["tune", command, "--config", str(company.config), "--out", str(tmp_path / "out")],
    )
    assert result.exit_code == 1
    assert "nothing was read" in result.output
    assert reads == [] and not (tmp_path / "out").exists()
