"""The operator's pages (``admin``): the models served, their methods and whether speculation
is switched off now, how fast each model and method has been, recent fallback, acceptance drift
and alarm events; the keys (list, create, revoke); usage per key and model."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from fastapi import Request
from fastapi.responses import Response

from gateway.console import pages, queries
from gateway.console.pages import esc
from gateway.console.web import posted, router, signed_in
from gateway.dependencies import ServicesDep
from gateway.keys import ROLES, KeyStoreError, Principal


@router.get("/models")
async def models_page(request: Request, services: ServicesDep) -> Response:
    viewer = await signed_in(request, services, ("admin",))
    if isinstance(viewer, Response):
        return viewer
    cards = []
    for model in services.models:
        card, backend = model.backend.card, model.backend
        fallback = backend.fallback_state()
        health = backend.health()
        methods = [
            [
                esc(method),
                "default" if method == card.default_method else "",
                "<span class='muted'>plain decoding</span>"
                if method == "none"
                else pages.yes_no(fallback.get(method, False), "OFF: fell back to plain", "on"),
            ]
            for method in card.available_methods
        ]
        facts = [
            ["served by", esc(model.kind)],
            ["aliases", esc(", ".join(model.aliases)) or "<span class='muted'>none</span>"],
            ["target version", f"<span class='mono'>{esc(card.target_version)}</span>"],
            ["dtype", esc((card.dtype or {}).get("chosen", "not reported"))],
            ["batching", esc(card.batching)],
            ["ready", pages.yes_no(not health.ready, f"no: {health.detail}", "yes")],
        ]
        cards.append(
            f"<div class='card model' data-model='{esc(card.model_name)}'>"
            f"<h2>{esc(card.model_name)}</h2><div class='columns'>"
            + pages.table([], facts)
            + pages.table(["method", "", "speculation now"], methods)
            + "</div></div>"
        )
    performance = await services.offload.db(queries.model_performance, services.db)
    perf_rows = [
        [
            esc(row["model"]),
            esc(row["method"]),
            str(row["requests"]),
            pages.number(row["tokens_per_s"], 1),
            pages.number(row["acceptance_rate"]),
            pages.number(row["mean_accepted_length"]),
            str(row["with_fallback"]),
            str(row["errors"]),
        ]
        for row in performance
    ]
    events = await services.offload.db(
        queries.recent_events, services.db, queries.OPERATOR_KINDS, 30
    )
    event_rows = [
        [
            str(e.seq),
            esc(pages.short_time(e.created_at)),
            esc(e.kind),
            esc(e.payload.get("model", "")),
            esc(e.payload.get("method", "")),
            esc(e.payload.get("action", "")),
            esc(e.payload.get("reason", "")),
        ]
        for e in events
    ]
    alarm = services.audit.alarm if services.audit.tamper is not None else None
    banner = (
        f"<div class='banner bad' id='alarm'>Tamper alarm: {esc(alarm.reason)}. The gateway "
        "is not ready; clear it with <code>specgate audit clear-alarm --evidence ...</code>."
        "</div>"
        if alarm is not None
        else ""
    )
    body = (
        banner
        + "".join(cards)
        + f"<h2>Speed over the newest {queries.PERFORMANCE_WINDOW} completions</h2>"
        + pages.table(
            [
                "model",
                "method",
                "requests",
                "tokens/s",
                "acceptance",
                "mean accepted length",
                "with fallback",
                "errors",
            ],
            perf_rows,
            numeric=(2, 3, 4, 5, 6, 7),
            table_id="performance",
            empty="No completion yet.",
        )
        + "<p class='muted'>tokens/s: completion tokens over the request's latency, per "
        "request summed; acceptance: accepted over proposed draft tokens.</p>"
        + "<h2>Fallback, replica and alarm events</h2>"
        + pages.table(
            ["seq", "time (UTC)", "kind", "model", "method", "action", "reason"],
            event_rows,
            table_id="operator-events",
            empty="None recorded.",
        )
    )
    return viewer.page("Models", body, "models")


def _keys_body(keys: list[Principal], csrf: str, created: str = "", problem: str = "") -> str:
    rows = [
        [
            f"<span class='mono'>{esc(key.key_id)}</span>",
            esc(key.name),
            esc(key.role),
            esc(key.team or ""),
            esc({None: "server setting", True: "yes", False: "no"}[key.store_content]),
            f"<form method='post' action='/console/keys/{esc(key.key_id)}/revoke'>"
            f"{pages.csrf_field(csrf)}<button type='submit' class='danger' "
            f"data-revoke='{esc(key.name)}'>Revoke</button></form>",
        ]
        for key in keys
    ]
    roles = "".join(f"<option value='{r}'>{r}</option>" for r in ROLES)
    return (
        created
        + (f"<p class='bad' id='key-error'>{esc(problem)}</p>" if problem else "")
        + "<div class='card'><form class='search' method='post' action='/console/keys' "
        f"id='create-key'>{pages.csrf_field(csrf)}"
        "<label>name<input name='name' required maxlength='100'></label>"
        f"<label>role<select name='role'>{roles}</select></label>"
        "<button type='submit'>Create key</button></form></div>"
        + pages.table(
            ["key id", "name", "role", "team", "stores content", ""],
            rows,
            table_id="keys",
            empty="No active key.",
        )
        + "<p class='muted'>Creating and revoking a key are <code>key</code> audit events.</p>"
    )


@router.get("/keys")
async def keys_page(request: Request, services: ServicesDep) -> Response:
    viewer = await signed_in(request, services, ("admin",))
    if isinstance(viewer, Response):
        return viewer
    keys = await services.offload.db(services.keys.list)
    return viewer.page("Keys", _keys_body(keys, viewer.csrf), "keys")


@router.post("/keys")
async def create_key(request: Request, services: ServicesDep) -> Response:
    checked = await posted(request, services, ("admin",))
    if isinstance(checked, Response):
        return checked
    viewer, form = checked
    role, name = form.get("role", ""), form.get("name", "").strip()
    created, problem, status = "", "", 201
    try:
        if role not in ROLES:
            raise KeyStoreError(f"unknown role {role!r}")
        key, plaintext = await services.offload.db(
            services.keys.create, role, name, viewer.principal.key_id
        )
        created = (
            f"<div class='card'><p class='ok'>Created {esc(key.role)} key {esc(key.name)} "
            f"(<span class='mono'>{esc(key.key_id)}</span>). Copy it now: it is shown once "
            f"and only its hash is kept.</p><p class='secret mono' id='new-key'>{esc(plaintext)}"
            "</p></div>"
        )
    except KeyStoreError as error:
        problem, status = str(error), 409
    keys = await services.offload.db(services.keys.list)
    return viewer.page("Keys", _keys_body(keys, viewer.csrf, created, problem), "keys", status)


@router.post("/keys/{key_id}/revoke")
async def revoke_key(key_id: str, request: Request, services: ServicesDep) -> Response:
    checked = await posted(request, services, ("admin",))
    if isinstance(checked, Response):
        return checked
    viewer, _ = checked
    problem = ""
    try:
        await services.offload.db(services.keys.revoke, key_id, viewer.principal.key_id)
        services.key_cache.forget(key_id)
    except KeyStoreError as error:
        problem = str(error)
    if key_id == viewer.principal.key_id and not problem:
        return viewer.page("Keys", "<p>Your own key is revoked: this session has ended.</p>")
    keys = await services.offload.db(services.keys.list)
    status = 404 if problem else 200
    return viewer.page("Keys", _keys_body(keys, viewer.csrf, problem=problem), "keys", status)


@router.get("/usage")
async def usage_page(request: Request, services: ServicesDep) -> Response:
    viewer = await signed_in(request, services, ("admin",))
    if isinstance(viewer, Response):
        return viewer
    from gateway.usage import usage

    days = 1 if request.query_params.get("period") != "week" else 7
    since = datetime.now(UTC) - timedelta(days=days)
    rows = await services.offload.db(
        usage, services.db, since, None, "hour" if days == 1 else "day"
    )
    cells = [
        [
            esc(pages.short_time(row["bucket"])),
            esc(row["key_name"]),
            esc(row["team"]),
            esc(row["model"]),
            esc(row["method"]),
            str(row["requests"]),
            str(row["errors"]),
            str(row["prompt_tokens"]),
            str(row["completion_tokens"]),
            pages.number(
                row["accepted_tokens"] / row["draft_tokens"] if row["draft_tokens"] else None
            ),
        ]
        for row in rows
    ]
    switch = (
        "<p><a href='/console/usage?period=week'>Last 7 days, by day</a></p>"
        if days == 1
        else "<p><a href='/console/usage'>Last 24 hours, by hour</a></p>"
    )
    body = (
        switch
        + pages.table(
            [
                "from (UTC)",
                "key",
                "team",
                "model",
                "method",
                "requests",
                "errors",
                "prompt tokens",
                "completion tokens",
                "acceptance",
            ],
            cells,
            numeric=(5, 6, 7, 8, 9),
            table_id="usage",
            empty="No request in the period.",
        )
        + "<p class='muted'>Counted from the audit log's request and completion events; as CSV: "
        "<code>GET /v1/admin/usage?format=csv</code>.</p>"
    )
    title = "Usage, last 24 hours" if days == 1 else "Usage, last 7 days"
    return viewer.page(title, body, "usage")
