"""The record of processing activities: the operator's declared record (schema, versions in
the audit log) and the compliance report built from it and the log, rendered in Chromium."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from gateway.audit.verify import VerifyReport
from gateway.cli import app as specgate_cli
from gateway.privacy.processing_record import (
    ProcessingRecordError,
    declared_versions,
    load_processing_record,
    record_at_startup,
)
from gateway.privacy.report import ReportData
from gateway.privacy.report_html import render_html
from tests.api_harness import PG_SERVER, LiveGateway, fresh_database, gateway_settings, live_gateway
from tests.tiny_models import build_pair

EXAMPLE = Path(__file__).parents[2] / "docs" / "processing-record.example.yaml"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
BROWSER = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
DECLARED_SECTIONS = (
    "controller", "purposes", "categories", "recipients", "retention", "measures", "transfers",
)  # fmt: skip


def dom_of(page: Path) -> str:
    """The DOM headless Chromium builds from the page."""
    assert Path(CHROMIUM).exists(), "chromium is missing: `apt-get install -y chromium`"
    return subprocess.run(
        [*BROWSER, "--dump-dom", page.as_uri()], check=True, capture_output=True, text=True
    ).stdout


def figure(dom: str, ident: str) -> str:
    found = re.search(rf'id="{ident}">([^<]*)<', dom)
    assert found, f"no figure {ident}"
    return found.group(1)


def test_the_example_record_is_valid() -> None:
    record = load_processing_record(EXAMPLE)
    assert record.transfers_abroad == [] and record.dpo is not None


def test_an_unknown_or_missing_field_is_refused_with_file_and_line(tmp_path: Path) -> None:
    text = EXAMPLE.read_text("utf-8").replace(
        "  contact: privacy@", "  phone: 1\n  contact: privacy@"
    )
    text = text.replace("transfers_abroad: []", "")
    wrong = tmp_path / "record.yaml"
    wrong.write_text(text, "utf-8")
    with pytest.raises(ProcessingRecordError) as refused:
        load_processing_record(wrong)
    line = 1 + text.splitlines().index("  phone: 1")
    assert f"{wrong}:{line}: controller.phone: Extra inputs are not permitted" in str(refused.value)
    top = 1 + next(i for i, row in enumerate(text.splitlines()) if row.startswith("activity:"))
    assert f"{wrong}:{top}: transfers_abroad: Field required" in str(refused.value)
    wrong.write_text("activity: [unclosed\n", "utf-8")
    with pytest.raises(ProcessingRecordError, match=rf"{wrong}:2: not valid YAML"):
        load_processing_record(wrong)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    root = tmp_path_factory.mktemp("processing-record")
    record = root / "processing-record.yaml"
    shutil.copy(EXAMPLE, record)
    with fresh_database() as (name, url):
        settings = gateway_settings(
            build_pair(root / "models"),
            root / "data",
            url,
            store_content=True,
            processing_record_path=record,
        )
        with live_gateway(settings, name) as live:
            yield live


def test_each_version_of_the_record_is_recorded_once(gateway: LiveGateway) -> None:
    services = gateway.services
    path = services.settings.processing_record_path
    assert path is not None
    (started,) = declared_versions(services.db)
    assert started.actor == "specgate" and started.hash_matches
    assert started.record["controller"]["name"] == "Example AG"
    text = path.read_text("utf-8")
    path.write_text("# only a comment added\n" + text, "utf-8")
    record_at_startup(path, services.audit, services.db, "specgate")
    assert declared_versions(services.db) == [started]
    path.write_text(text.replace("Example AG", "Example Holding AG"), "utf-8")
    try:
        record_at_startup(path, services.audit, services.db, "specgate")
        first, changed = declared_versions(services.db)
        assert first == started and changed.seq > started.seq
        assert changed.sha256 != started.sha256
        assert changed.record["controller"]["name"] == "Example Holding AG"
    finally:
        path.write_text(text, "utf-8")
        record_at_startup(path, services.audit, services.db, "specgate")


def chat(gateway: LiveGateway, store_content: bool) -> None:
    response = httpx.post(
        gateway.base_url + "/v1/chat/completions",
        json={
            "model": "target",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "record of processing"}],
            "store_content": store_content,
        },
        headers={"authorization": f"Bearer {gateway.keys['app']}"},
        timeout=60,
    )
    assert response.status_code == 200, response.text


def report(gateway: LiveGateway, since: datetime, out: Path, env: dict[str, str]) -> Any:
    until = datetime.now(UTC) + timedelta(seconds=1)
    return CliRunner().invoke(
        specgate_cli,
        [
            *("compliance", "report", "--since", since.isoformat()),
            *("--until", until.isoformat(), "--out", str(out)),
        ],
        env=env,
    )


def test_the_report_is_a_record_of_processing_in_chromium(
    gateway: LiveGateway, tmp_path: Path
) -> None:
    services = gateway.services
    settings = services.settings
    env = {
        "SPECGATE_DATABASE_URL": f"{PG_SERVER}/{gateway.database}",
        "SPECGATE_AUDIT_MAC_KEY_PATH": str(settings.audit_mac_key_path),
        "SPECGATE_PRIVACY_KEK_PATH": str(settings.privacy_kek_path),
        "SPECGATE_SIGNING_KEY_PATH": str(settings.signing_key_path),
        "SPECGATE_AUDIT_STATE_PATH": str(tmp_path / "report-state.json"),
    }
    since = datetime.now(UTC)
    time.sleep(0.01)
    for store_content in (True, True, False):
        chat(gateway, store_content)
    principal, _ = services.keys.create("auditor", "external-auditor", "cli:dpo")
    services.keys.revoke(principal.key_id, "cli:dpo")
    runner = CliRunner()
    for subject in ("subject-a", "subject-b"):
        erased = runner.invoke(specgate_cli, ["privacy", "erase", "--subject", subject], env=env)
        assert erased.exit_code == 0, erased.output
    services.privacy.expire(1, "specgate", now=datetime.now(UTC) + timedelta(days=2))
    exported = httpx.get(
        gateway.base_url + "/v1/audit/export",
        headers={"authorization": f"Bearer {gateway.keys['auditor']}"},
        timeout=60,
    )
    assert exported.status_code == 200
    out = tmp_path / "report.html"
    result = report(gateway, since, out, env)
    assert result.exit_code == 0, result.output
    dom = dom_of(out)

    assert "<title>Record of processing activities: Specgate LLM gateway</title>" in dom
    assert 'id="no-declared-record"' not in dom
    # The declared record first, its sections in the order of revDSG Art. 12(2).
    order = [dom.index(f'id="{ident}"') for ident in ("declared", *DECLARED_SECTIONS, "evidence")]
    assert order == sorted(order)
    version = declared_versions(services.db)[-1]
    shown = dom[dom.index('id="declared-version"') :].split("</p>")[0]
    assert f"seq {version.seq}</b>" in shown and version.sha256 in shown
    assert "Example AG" in dom
    assert "None: no personal data is disclosed abroad." in dom

    # The evidence, each figure from the log and labelled with its source.
    assert figure(dom, "requests") == "3"
    assert figure(dom, "content-storage") == "ON"
    assert figure(dom, "stored-requests") == "2 of 3"
    assert 'id="content-notice"' in dom
    erasures = int(figure(dom, "erasures"))
    assert erasures == 2
    rows = dom[dom.index('id="erasure-requests"') :].split("</table>")[0]
    assert rows.count("<tr>") == 1 + erasures
    expiries = int(figure(dom, "retention-expiries"))
    assert expiries >= 1  # the data key of the requests whose content was stored
    expired = dom[dom.index('id="retention-expiries-table"') :].split("</table>")[0]
    assert expired.count("<tr>") == 1 + expiries
    assert int(figure(dom, "export-count")) == 1
    changes = dom[dom.index('id="key-changes"') :].split("</table>")[0]
    assert "<td>created</td>" in changes and "<td>revoked</td>" in changes
    assert "external-auditor" in changes and "cli:dpo" in changes
    assert 'class="ok">verified<' in dom
    assert figure(dom, "cosignatures") == "0"
    assert 'id="cosignature-warning"' in dom  # this gateway has no witness
    assert dom.count('class="source"') >= 20
    warnings = dom[dom.index('id="warnings"') :].split("</div>")[0]
    assert 'id="cosignature-warning"' in warnings

    screenshot = tmp_path / "report.png"
    subprocess.run(
        [*BROWSER, "--window-size=1100,3000", f"--screenshot={screenshot}", out.as_uri()],
        check=True,
        capture_output=True,
    )
    assert screenshot.stat().st_size > 20_000
    keep = os.environ.get("SPECGATE_REPORT_SCREENSHOT")
    if keep:
        shutil.copy(screenshot, keep)


def test_a_missing_declared_record_is_a_warning_at_the_top(tmp_path: Path) -> None:
    start = datetime(2026, 3, 1, tzinfo=UTC)
    data = ReportData(since=start, until=start + timedelta(days=1), bucket=timedelta(hours=1))
    data.verification = VerifyReport(True, 0, None, "no events")
    page = tmp_path / "report.html"
    page.write_text(render_html(data), "utf-8")
    dom = dom_of(page)
    warning = dom.index('id="no-declared-record"')
    assert "NO DECLARED RECORD OF PROCESSING" in dom
    assert warning < dom.index('id="declared"') < dom.index('id="evidence"')
    assert dom.index("<h1>") < warning < dom.index("<h2")
    assert figure(dom, "requests") == "0"


def test_a_stale_or_missing_cosignature_is_a_warning() -> None:
    until = datetime(2026, 3, 2, tzinfo=UTC)
    data = ReportData(since=until - timedelta(days=1), until=until, bucket=timedelta(hours=1))
    assert "id='cosignature-warning'>No witness cosignature" in render_html(data, until)
    data.newest_cosignature = until - timedelta(hours=2)
    assert "id='cosignature-warning'" not in render_html(data, until)
    data.newest_cosignature = until - timedelta(days=2)
    assert "is older than 24 hours" in render_html(data, until)
