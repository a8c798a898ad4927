"""The auditor's pages (log status, event search, one event with its receipt and the
in-browser check, erasures and legal holds, the compliance report) and an app key's view of
its own requests. An app key's restriction is applied in the queries, not in what is shown."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from fastapi import Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from gateway.audit.canonical import format_timestamp
from gateway.audit.log import AuditUnavailableError
from gateway.audit.receipt import ReceiptError, verify_receipt
from gateway.audit.records import EventRecord, b64
from gateway.audit.status import log_status
from gateway.console import pages, queries
from gateway.console.pages import esc
from gateway.console.web import REPORT_CSP, Viewer, router, security_headers, signed_in
from gateway.dependencies import Services, ServicesDep

AUDIT_KINDS = ("tamper_detected", "alarm_cleared")


def _event_link(event: EventRecord) -> str:
    return f"<a href='/console/events/{esc(event.event_id)}'>{event.seq}</a>"


def _actor(event: EventRecord) -> str:
    return f"<span class='mono'>{esc(event.actor)}</span>" if event.actor else ""


# --- status ------------------------------------------------------------------------------


@router.get("/status")
async def status_page(request: Request, services: ServicesDep) -> Response:
    viewer = await signed_in(request, services, ("auditor",))
    if isinstance(viewer, Response):
        return viewer
    audit = services.audit
    status = await services.offload.db(log_status, audit, services.db)
    cosignatures = await services.offload.db(
        queries.recent_events, services.db, ("cosignature",), 10
    )
    alarms = await services.offload.db(queries.recent_events, services.db, AUDIT_KINDS, 10)
    note = await services.offload.db(audit.latest_checkpoint)
    now = pages.parse_time(status["now"]) or datetime.now(UTC)
    alarm = audit.alarm if audit.tamper is not None else None
    if alarm is not None:
        banner = (
            "<div class='banner bad' id='alarm'>TAMPER ALARM since "
            f"{esc(pages.short_time(alarm.detected_at))}: {esc(alarm.reason)}"
            f"{f' (first bad event: {alarm.first_bad_seq})' if alarm.first_bad_seq else ''}."
            " No checkpoint is signed until an admin clears it with evidence.</div>"
        )
    else:
        banner = "<div class='banner ok' id='alarm'>No tamper alarm.</div>"
    waiting = status["oldest_uncovered_event_at"]
    reverified = audit.reverified_at
    newest_cosigned = cosignatures[0].payload.get("cosigned_at") if cosignatures else None
    figures = "".join(
        [
            pages.stat("Tree size (events)", f"{status['tree_size']:,}", "tree-size"),
            pages.stat(
                "Newest checkpoint",
                f"{status['newest_checkpoint_size'] or 0:,} events<br><span class='muted'>"
                f"{esc(pages.age(pages.seconds_since(status['newest_checkpoint_signed_at'], now)))}"
                "</span>",
                "checkpoint",
            ),
            pages.stat(
                "Waiting for a checkpoint",
                "nothing"
                if waiting is None
                else f"since {esc(pages.age(pages.seconds_since(waiting, now)))}",
            ),
            pages.stat(
                "Last full verification",
                "not yet since this gateway started"
                if reverified is None
                else f"{esc(pages.age(time.time() - reverified))}",
                "reverified",
            ),
            pages.stat(
                "Newest witness cosignature",
                "none"
                if newest_cosigned is None
                else f"{esc(pages.age(time.time() - float(newest_cosigned)))}",
                "cosigned",
            ),
        ]
    )
    cosigned_rows = [
        [
            _event_link(event),
            esc(event.payload.get("witness")),
            f"{event.payload.get('size', '')}",
            esc(
                datetime.fromtimestamp(float(event.payload.get("cosigned_at", 0)), UTC).strftime(
                    "%Y-%m-%d %H:%M:%S"
                )
            ),
            esc(pages.age(time.time() - float(event.payload.get("cosigned_at", 0)))),
        ]
        for event in cosignatures
    ]
    alarm_rows = [
        [
            _event_link(e),
            esc(pages.short_time(e.created_at)),
            esc(e.kind),
            pages.pretty_json(e.payload),
        ]
        for e in alarms
    ]
    body = (
        f"{banner}<div class='grid'>{figures}</div>"
        "<h2>Witness cosignatures</h2>"
        + pages.table(
            ["event", "witness", "tree size", "cosigned (UTC)", "age"],
            cosigned_rows,
            numeric=(2,),
            table_id="cosignatures",
            empty="No witness has cosigned yet.",
        )
        + "<h2>Alarms and their clearing</h2>"
        + pages.table(
            ["event", "time (UTC)", "kind", "evidence"],
            alarm_rows,
            table_id="alarms",
            empty="No alarm was ever raised.",
        )
        + "<h2>Latest signed checkpoint</h2>"
        f"<pre id='checkpoint-note'>{esc(note)}</pre>"
        "<p class='muted'>Compare it with the checkpoints your witness keeps; the public key to "
        "check its signature is on every event page.</p>"
    )
    return viewer.page("Audit log status", body, "status")


# --- event search ------------------------------------------------------------------------


def _query(viewer: Viewer, params: dict[str, str], key_id: str | None) -> queries.EventQuery:
    before = params.get("before", "")
    return queries.EventQuery(
        since=pages.parse_time(params.get("since")),
        until=pages.parse_time(params.get("until")),
        kind=params.get("kind") or None,
        # An app key sees its own events only, whatever the form says.
        actor=viewer.principal.key_id if viewer.role == "app" else key_id,
        model=params.get("model") or None,
        before=int(before) if before.isdigit() else None,
    )


@router.get("/events")
async def events_page(request: Request, services: ServicesDep) -> Response:
    viewer = await signed_in(request, services, ("auditor", "app"))
    if isinstance(viewer, Response):
        return viewer
    params = {k: v.strip() for k, v in request.query_params.items()}
    key = params.get("key") or None
    key_id = await services.offload.db(queries.key_id_for, services.db, key) if key else None
    problem = ""
    try:
        query = _query(viewer, params, key_id)
    except ValueError:
        query, problem = (
            queries.EventQuery(actor=_query(viewer, {}, None).actor),
            ("<p class='bad'>A time is not ISO 8601; showing the newest events.</p>"),
        )
    events, older = await services.offload.db(queries.search_events, services.db, query)
    kinds = await services.offload.db(queries.event_kinds, services.db)
    options = "".join(
        f"<option value='{esc(k)}'{' selected' if k == query.kind else ''}>{esc(k)}</option>"
        for k in ["", *kinds]
    )
    key_field = (
        ""
        if viewer.role == "app"
        else f"<label>key (id or name)<input name='key' value='{esc(key or '')}'></label>"
    )
    form = (
        "<form class='search card' method='get' action='/console/events' id='search'>"
        f"<label>since (UTC)<input type='datetime-local' step='1' name='since' "
        f"value='{esc(params.get('since', ''))}'></label>"
        f"<label>until (UTC)<input type='datetime-local' step='1' name='until' "
        f"value='{esc(params.get('until', ''))}'></label>"
        f"<label>kind<select name='kind'>{options}</select></label>{key_field}"
        f"<label>model<input name='model' value='{esc(params.get('model', ''))}'></label>"
        "<button type='submit'>Search</button></form>"
    )
    rows = [
        [
            _event_link(e),
            esc(pages.short_time(e.created_at)),
            esc(e.kind),
            _actor(e),
            esc(e.payload.get("model", "")),
            f"<a href='/console/events/{esc(e.event_id)}' class='mono'>{esc(e.event_id)}</a>",
        ]
        for e in events
    ]
    pager = ""
    if older is not None:
        link = urlencode({**{k: v for k, v in params.items() if v}, "before": older})
        pager = (
            f"<p class='pager'><a id='older' href='/console/events?{esc(link)}'>"
            "Older events</a></p>"
        )
    title = "My requests' events" if viewer.role == "app" else "Events"
    body = (
        problem
        + form
        + pages.table(
            ["seq", "time (UTC)", "kind", "actor (key id)", "model", "event id"],
            rows,
            table_id="events",
            empty="No event matches.",
        )
        + pager
    )
    return viewer.page(title, body, "events")


# --- one event and its receipt ----------------------------------------------------------


async def _visible_event(viewer: Viewer, services: Services, event_id: str) -> EventRecord | None:
    """The event, if this viewer may see it: an auditor any, an app key its own."""
    record = await services.offload.db(services.audit.event, event_id)
    if record is None or (viewer.role == "app" and record.actor != viewer.principal.key_id):
        return None
    return record


def _not_found(viewer: Viewer, event_id: str) -> HTMLResponse:
    return viewer.page(
        "No such event",
        f"<p class='bad' id='not-found'>No audit event {esc(event_id)} for this key.</p>",
        "events",
        status=404,
    )


@router.get("/events/{event_id}")
async def event_page(event_id: str, request: Request, services: ServicesDep) -> Response:
    viewer = await signed_in(request, services, ("auditor", "app"))
    if isinstance(viewer, Response):
        return viewer
    record = await _visible_event(viewer, services, event_id)
    if record is None:
        return _not_found(viewer, event_id)
    facts = [
        ["seq", str(record.seq)],
        ["event id", f"<span class='mono'>{esc(record.event_id)}</span>"],
        ["time (UTC)", esc(record.created_at)],
        ["kind", esc(record.kind)],
        ["actor", _actor(record)],
        ["event hash", f"<span class='mono'>{esc(record.event_hash)}</span>"],
        ["previous hash", f"<span class='mono'>{esc(record.prev_hash)}</span>"],
    ]
    head = pages.table(["field", "value"], facts, table_id="event")
    payload = (
        "<details class='card'><summary>Payload</summary>"
        + pages.pretty_json(record.payload)
        + "</details>"
    )
    try:
        receipt = await services.offload.db(services.audit.receipt, record)
    except AuditUnavailableError as error:
        body = head + payload + f"<p class='bad'>No receipt can be given now: {esc(error)}</p>"
        return viewer.page(f"Event {record.seq}", body, "events")
    pem = services.signer.public_key_pem().decode("ascii")
    try:
        server = f"<span class='ok'>verified: {esc(verify_receipt(receipt, pem.encode()))}</span>"
    except ReceiptError as error:
        server = f"<span class='bad'>failed: {esc(error)}</span>"
    data: dict[str, Any] = {
        "canonical": b64(record.canonical_bytes()),
        "event_hash": record.event_hash,
        "leaf_index": receipt["leaf_index"],
        "tree_size": receipt["tree_size"],
        "inclusion_proof": receipt["inclusion_proof"],
        "checkpoint": receipt["checkpoint"],
    }
    proof = "".join(f"<li class='mono'>{esc(h)}</li>" for h in receipt["inclusion_proof"])
    body = (
        "<h2>Receipt: is this event in the signed log?</h2><div class='columns'>"
        "<div class='card'><p>This browser recomputes the event's hashes and the Merkle "
        "inclusion proof with WebCrypto and checks the checkpoint's Ed25519 signature with the "
        "public key below, without relying on the server's verdict.</p>"
        "<p><span class='verdict' id='browser-verdict' data-verdict='running'>needs JavaScript"
        "</span> <button type='button' id='verify-button'>Verify in the browser</button></p>"
        "<ol id='browser-steps'></ol>"
        "<label class='muted'>The log's public key (paste your own pinned copy to check against "
        f"it)<textarea id='public-key' spellcheck='false'>{esc(pem)}</textarea></label></div>"
        f"<div class='card'><p>Server's own check: <span id='server-verdict'>{server}</span></p>"
        f"<p>Leaf {receipt['leaf_index']} of the tree of {receipt['tree_size']:,} events; "
        f"leaf hash <span class='mono'>{esc(receipt['leaf_hash'])}</span></p>"
        f"<p>Inclusion proof ({len(receipt['inclusion_proof'])} hashes):</p>"
        f"<ol class='proof' id='proof'>{proof}</ol>"
        f"<p>Checkpoint:</p><pre id='receipt-checkpoint'>{esc(receipt['checkpoint'])}</pre>"
        f"<p><a href='/console/events/{esc(record.event_id)}/receipt.json' download>Download "
        "the receipt</a> for <code>specgate audit verify-receipt</code>.</p></div></div>"
        + pages.json_block("receipt-data", data)
        + "<h2>The event</h2>"
        + head
        + payload
    )
    return viewer.page(f"Event {record.seq} ({record.kind})", body, "events")


@router.get("/events/{event_id}/receipt.json")
async def receipt_file(event_id: str, request: Request, services: ServicesDep) -> Response:
    viewer = await signed_in(request, services, ("auditor", "app"))
    if isinstance(viewer, Response):
        return viewer
    record = await _visible_event(viewer, services, event_id)
    if record is None:
        return _not_found(viewer, event_id)
    receipt = await services.offload.db(services.audit.receipt, record)
    headers = {
        **security_headers(),
        "content-disposition": f'attachment; filename="receipt-{record.seq}.json"',
    }
    return JSONResponse(receipt, headers=headers)


# --- erasures and legal holds ------------------------------------------------------------


@router.get("/privacy")
async def privacy_page(request: Request, services: ServicesDep) -> Response:
    viewer = await signed_in(request, services, ("auditor",))
    if isinstance(viewer, Response):
        return viewer
    holds = await services.offload.db(services.privacy.holds)
    erasures = await services.offload.db(queries.recent_events, services.db, ("erasure",), 100)
    hold_events = await services.offload.db(
        queries.recent_events, services.db, ("legal_hold",), 100
    )
    erasure_rows = [
        [
            _event_link(e),
            esc(pages.short_time(e.created_at)),
            esc(e.payload.get("cause")),
            f"<span class='mono'>{esc(e.payload.get('subject_ref', ''))}</span>",
            pages.yes_no(
                e.payload.get("outcome") not in ("erased", "expired", None),
                str(e.payload.get("outcome")),
                str(e.payload.get("outcome")),
            ),
            str(len(e.payload.get("key_refs") or [])),
            str(e.payload.get("content_rows_deleted", "")),
            _actor(e),
        ]
        for e in erasures
    ]
    hold_rows = [
        [
            _event_link(e),
            esc(pages.short_time(e.created_at)),
            esc(e.payload.get("action")),
            f"<span class='mono'>{esc(e.payload.get('subject_ref'))}</span>",
            _actor(e),
        ]
        for e in hold_events
    ]
    held = "".join(f"<li class='mono'>{esc(ref)}</li>" for ref in holds)
    body = (
        "<p>Data subjects are named by keyed reference only. Erasure destroys a subject's data "
        "keys: the events stay and verify, their content can no longer be read.</p>"
        f"<h2>Legal holds in force ({len(holds)})</h2>"
        + (f"<ul id='holds'>{held}</ul>" if held else "<p class='muted' id='holds'>None.</p>")
        + "<h2>Erasures and retention</h2>"
        + pages.table(
            [
                "event",
                "time (UTC)",
                "cause",
                "subject",
                "outcome",
                "keys destroyed",
                "content rows",
                "actor",
            ],
            erasure_rows,
            numeric=(5, 6),
            table_id="erasures",
            empty="No erasure yet.",
        )
        + "<h2>Legal hold history</h2>"
        + pages.table(
            ["event", "time (UTC)", "action", "subject", "actor"],
            hold_rows,
            table_id="hold-events",
            empty="No legal hold was ever placed.",
        )
    )
    return viewer.page("Erasures and legal holds", body, "privacy")


# --- compliance report -------------------------------------------------------------------


@router.get("/report")
async def report_form(request: Request, services: ServicesDep) -> Response:
    viewer = await signed_in(request, services, ("auditor",))
    if isinstance(viewer, Response):
        return viewer
    today = datetime.now(UTC).date()
    body = (
        "<div class='card'><p>The record of processing activities (revDSG Art. 12, GDPR Art. "
        "30) for a period, as <code>specgate compliance report</code> writes it: the declared "
        "record, the evidence counted from the audit log and the chain verified now. Making it "
        "is recorded as a <code>compliance_report</code> event.</p>"
        "<form class='search' method='get' action='/console/report/view' id='report'>"
        f"<label>since (UTC)<input type='date' name='since' "
        f"value='{today - timedelta(days=30)}'></label>"
        f"<label>until (exclusive)<input type='date' name='until' "
        f"value='{today + timedelta(days=1)}'></label>"
        "<label><span>&nbsp;</span><select name='download'><option value=''>open it here"
        "</option><option value='1'>download the HTML file</option></select></label>"
        "<button type='submit'>Make the report</button></form></div>"
    )
    return viewer.page("Compliance report", body, "report")


def _report(services: Services, since: datetime, until: datetime, actor: str) -> str:
    from gateway.privacy.report import COSIGNATURE_MAX_AGE, collect
    from gateway.privacy.report_html import render_html

    max_age_s = services.settings.witness_max_age_s
    max_age = timedelta(seconds=max_age_s) if max_age_s is not None else COSIGNATURE_MAX_AGE
    data = collect(services.db, since, until, max_age)
    data.verification = services.audit.verify(since, until)
    services.audit.append(
        "compliance_report",
        actor,
        {
            "since": format_timestamp(since),
            "until": format_timestamp(until),
            "verified": data.verification.ok,
        },
    )
    return render_html(data)


@router.get("/report/view")
async def report_view(request: Request, services: ServicesDep) -> Response:
    viewer = await signed_in(request, services, ("auditor",))
    if isinstance(viewer, Response):
        return viewer
    try:
        since = pages.parse_time(request.query_params.get("since"))
        until = pages.parse_time(request.query_params.get("until"))
    except ValueError:
        since = until = None
    if since is None or until is None or since >= until:
        return viewer.page(
            "Compliance report",
            "<p class='bad'>Give a period: since before until.</p>",
            "report",
            status=400,
        )
    page = await services.offload.db(_report, services, since, until, viewer.principal.key_id)
    headers = security_headers(REPORT_CSP)
    if request.query_params.get("download"):
        name = f"specgate-report-{since.date()}-{until.date()}.html"
        headers["content-disposition"] = f'attachment; filename="{name}"'
    return HTMLResponse(page, headers=headers)
