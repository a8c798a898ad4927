"""Part I of the compliance report: the operator's declared record of processing, in the order
of revDSG Art. 12(2) (GDPR Art. 30(1) alongside), as the audit log holds its version."""

from __future__ import annotations

import json

from pydantic import ValidationError

from gateway.audit.canonical import format_timestamp
from gateway.privacy.processing_record import DeclaredVersion, Party, ProcessingRecord
from gateway.privacy.report_parts import esc, facts, source, table, warning

MISSING = (
    "NO DECLARED RECORD OF PROCESSING. The audit log holds no processing_record event before "
    "the end of this period, so this page lacks the controller, purposes, categories of data "
    "and of data subjects, recipients, transfers abroad, retention periods and measures, and "
    "is NOT a complete record of processing activities (revDSG Art. 12, GDPR Art. 30). "
    "Declare them in a YAML file (processing_record_path, or specgate compliance record "
    "--file) and produce the report again."
)


def missing_record_warning() -> str:
    return warning("no-declared-record", MISSING)


def declared_part(version: DeclaredVersion | None, changes: list[DeclaredVersion]) -> str:
    if version is None:
        return "<h2 id='declared'>Part I. Declared record of processing</h2>" + warning(
            "declared-missing", "Not declared: see the warning at the top of this page."
        )
    parts = [
        "<h2 id='declared'>Part I. Declared record of processing</h2>",
        _version_line(version),
    ]
    try:
        record = ProcessingRecord.model_validate(version.record)
    except ValidationError as error:
        parts.append(
            warning(
                "declared-unreadable",
                f"The recorded declaration does not fit the schema: "
                f"{error.error_count()} problems; shown as recorded.",
            )
        )
        parts.append(f"<pre>{esc(json.dumps(version.record, indent=2))}</pre>")
    else:
        parts.extend(_sections(record))
    parts.append(_history(changes))
    return "".join(parts)


def _version_line(version: DeclaredVersion) -> str:
    integrity = (
        "<span class='ok'>matches its content</span>"
        if version.hash_matches
        else "<span class='bad'>DOES NOT match its content</span>"
    )
    recorded = esc(format_timestamp(version.created_at))
    origin = f"by {esc(version.actor)} from {esc(version.file)}"
    return (
        "<p class='version' id='declared-version'>Version in force at the end of the period: "
        f"audit event <b>seq {version.seq}</b>, recorded {recorded} {origin}; "
        f"hash <code>{esc(version.sha256)}</code> ({integrity}).</p>"
    )


def _sections(record: ProcessingRecord) -> list[str]:
    return [
        f"<p>Processing activity: <b id='activity'>{esc(record.activity)}</b></p>",
        _heading("controller", "I.1 Controller", "12(2)(a)", "30(1)(a)"),
        _party("Controller", record.controller),
        _party("Representative", record.representative),
        _party("Data protection officer", record.dpo),
        _heading("purposes", "I.2 Purposes of the processing", "12(2)(b)", "30(1)(b)"),
        table(
            ["purpose", "legal basis"],
            [[p.purpose, p.legal_basis or ""] for p in record.purposes],
            "None declared.",
        ),
        _heading(
            "categories",
            "I.3 Categories of data subjects and of personal data",
            "12(2)(c)",
            "30(1)(c)",
        ),
        table(["data subjects"], [[s] for s in record.data_subjects], "None declared."),
        table(
            ["personal data", "description", "sensitive / special category"],
            [
                [c.category, c.description or "", "yes" if c.sensitive else "no"]
                for c in record.personal_data
            ],
            "None declared.",
        ),
        _heading("recipients", "I.4 Categories of recipients", "12(2)(d)", "30(1)(d)"),
        table(
            ["recipient", "description"],
            [[r.recipient, r.description or ""] for r in record.recipients],
            "No recipients: the data is disclosed to nobody.",
        ),
        _heading("retention", "I.5 Retention periods", "12(2)(e)", "30(1)(f)"),
        table(
            ["data", "kept for"], [[r.data, r.period] for r in record.retention], "None declared."
        ),
        _heading("measures", "I.6 Measures ensuring data security", "12(2)(f)", "30(1)(g)"),
        table(["technical measures"], [[m] for m in record.measures.technical], "None declared."),
        table(
            ["organisational measures"],
            [[m] for m in record.measures.organisational],
            "None declared.",
        ),
        _heading("transfers", "I.7 Disclosure abroad", "12(2)(g)", "30(1)(e)"),
        table(
            ["country", "recipient", "guarantees"],
            [[t.country, t.recipient, t.safeguards] for t in record.transfers_abroad],
            "None: no personal data is disclosed abroad.",
        ),
    ]


def _heading(ident: str, title: str, revdsg: str, gdpr: str) -> str:
    laws = f"(revDSG Art. {revdsg}; GDPR Art. {gdpr})"
    return f"<h3 id='{ident}'>{esc(title)} <small>{laws}</small></h3>"


def _party(role: str, party: Party | None) -> str:
    if party is None:
        return f"<p class='empty'>{esc(role)}: none designated.</p>"
    return facts([(role, party.name), ("Address", party.address or ""), ("Contact", party.contact)])


def _history(changes: list[DeclaredVersion]) -> str:
    rows = [[v.seq, format_timestamp(v.created_at), v.actor, v.sha256, v.file] for v in changes]
    return (
        "<h3>Versions of the declaration recorded in the period</h3>"
        + table(
            ["seq", "recorded", "by", "hash", "file"],
            rows,
            "None: the declaration did not change in the period.",
            "declared-history",
        )
        + source("processing_record events of the audit log")
    )
