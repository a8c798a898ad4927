"""Events record every versioned artefact in one generic list; events written before it (a
``draft``/``draft_version`` pair) are still read, by replay and by the compliance report."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from gateway.backends.base import BackendCard
from gateway.privacy.replay import configuration_differences
from gateway.privacy.report import ReportData, _count
from gateway.privacy.report_html import render_html
from gateway.recording import models_in_use, recorded_artefacts

DRAFT = {"kind": "draft_model", "name": "demo-draft", "version": "sha256:" + "d" * 64}
HEADS = {"kind": "medusa_heads", "name": "heads", "version": "sha256:" + "h" * 64}


def _card(*artefacts: dict[str, str | None]) -> BackendCard:
    return BackendCard(
        model_name="m",
        target_version="sha256:t",
        max_context=64,
        vocab_size=64,
        available_methods=("none", "draft"),
        speculative_config={"method": "draft"},
        default_method="draft",
        default_num_speculative_tokens=None,
        artefacts=artefacts,
    )


def _legacy(draft_version: str | None) -> dict[str, Any]:
    """A `request` event's model fields in the earliest format, before the artefacts list."""
    return {
        "model": "m",
        "target_version": "sha256:t",
        "draft": "demo-draft" if draft_version else None,
        "draft_version": draft_version,
        "speculative": {"config": {"method": "draft"}},
    }


def test_events_name_artefacts_in_the_list_only() -> None:
    fields = models_in_use(_card(DRAFT, HEADS))
    assert fields == {"model": "m", "target_version": "sha256:t", "artefacts": [DRAFT, HEADS]}
    assert recorded_artefacts(fields) == [DRAFT, HEADS]


def test_older_events_read_as_the_draft_artefact_they_describe() -> None:
    assert recorded_artefacts(_legacy(DRAFT["version"])) == [DRAFT]
    assert recorded_artefacts(_legacy(None)) == []


def test_replay_compares_artefact_versions_of_old_and_new_records() -> None:
    new = {**models_in_use(_card(DRAFT)), "speculative": {"config": {"method": "draft"}}}
    assert configuration_differences(new, _card(DRAFT)) == []
    assert configuration_differences(_legacy(DRAFT["version"]), _card(DRAFT)) == []
    changed = {**DRAFT, "version": "sha256:" + "e" * 64}
    (difference,) = configuration_differences(_legacy(DRAFT["version"]), _card(changed))
    assert difference.startswith("artefacts: recorded") and "e" * 64 in difference
    (missing,) = configuration_differences(new, _card())
    assert missing.startswith("artefacts:")


def test_the_report_lists_old_and_new_records_alike() -> None:
    start = datetime(2026, 12, 1, tzinfo=UTC)
    data = ReportData(since=start, until=start + timedelta(days=1), bucket=timedelta(hours=1))
    _count(data, start, "request", "key", _legacy(DRAFT["version"]))
    _count(data, start, "request", "key", {"key_name": "k", **models_in_use(_card(DRAFT))})
    served = f"<td>sha256:t</td><td>draft_model demo-draft {DRAFT['version']}</td><td>"
    assert served in render_html(data)
    assert data.versions == {
        ("m", "sha256:t", f"draft_model demo-draft {DRAFT['version']}"): [
            "2026-12-01T00:00:00.000000+00:00",
            2,
        ]
    }
