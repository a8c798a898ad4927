"""The console's HTML: small f-string templates, every value escaped. No inline script or
style: the one stylesheet and the one script are files of this package (``static/``), and the
data the receipt check reads is a JSON block the browser never executes."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from html import escape
from typing import Any

from gateway.keys import Principal, Role

# (page id, path, label) per role; the first is where sign-in lands.
NAV: dict[Role, tuple[tuple[str, str, str], ...]] = {
    "auditor": (
        ("status", "/console/status", "Log status"),
        ("events", "/console/events", "Events"),
        ("privacy", "/console/privacy", "Erasures & holds"),
        ("report", "/console/report", "Compliance report"),
    ),
    "admin": (
        ("models", "/console/models", "Models"),
        ("keys", "/console/keys", "Keys"),
        ("usage", "/console/usage", "Usage"),
    ),
    "app": (("events", "/console/events", "My requests"),),
}


def esc(value: object) -> str:
    return escape("" if value is None else str(value), quote=True)


def home(role: Role) -> str:
    return NAV[role][0][1]


def csrf_field(csrf: str) -> str:
    return f"<input type='hidden' name='csrf' value='{esc(csrf)}'>"


def layout(
    title: str, body: str, viewer: Principal | None = None, csrf: str = "", active: str = ""
) -> str:
    header = "<header><span class='brand'>Specgate console</span>"
    if viewer is not None:
        links = "".join(
            f"<a href='{path}'{' class=active' if page == active else ''}>{esc(label)}</a>"
            for page, path, label in NAV[viewer.role]
        )
        header += (
            f"<nav>{links}</nav><span class='who'>{esc(viewer.name)} ({esc(viewer.role)})</span>"
            f"<form method='post' action='/console/logout'>{csrf_field(csrf)}"
            "<button type='submit' id='sign-out'>Sign out</button></form>"
        )
    header += "</header>"
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>{esc(title)} · Specgate</title>"
        "<link rel='icon' href='/console/static/favicon.svg' type='image/svg+xml'>"
        "<link rel='stylesheet' href='/console/static/console.css'>"
        "<script src='/console/static/console.js' defer></script>"
        f"</head><body>{header}<main><h1>{esc(title)}</h1>{body}</main></body></html>"
    )


def table(
    headers: Sequence[str],
    rows: Iterable[Sequence[str]],
    numeric: Sequence[int] = (),
    table_id: str = "",
    empty: str = "None.",
) -> str:
    """A table of already-escaped cells; ``numeric``: column numbers aligned right."""

    def cell(tag: str, i: int, html: str) -> str:
        return f"<{tag} class='num'>{html}</{tag}>" if i in numeric else f"<{tag}>{html}</{tag}>"

    body = "".join(
        "<tr>" + "".join(cell("td", i, c) for i, c in enumerate(row)) + "</tr>" for row in rows
    )
    if not body:
        return f"<p class='muted'>{esc(empty)}</p>"
    head = "".join(cell("th", i, esc(h)) for i, h in enumerate(headers))
    thead = f"<thead><tr>{head}</tr></thead>" if headers else ""
    ident = f" id='{esc(table_id)}'" if table_id else ""
    return f"<table{ident}>{thead}<tbody>{body}</tbody></table>"


def stat(label: str, value: str, ident: str = "") -> str:
    """A figure; ``value`` is already-escaped HTML."""
    ident_attr = f" id='{esc(ident)}'" if ident else ""
    return (
        f"<div class='card stat'{ident_attr}><div class='label'>{esc(label)}</div>"
        f"<div class='value'>{value}</div></div>"
    )


def age(seconds: float | None) -> str:
    if seconds is None:
        return ""
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit} ago"
    return f"{seconds:.0f} s ago"


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    moment = datetime.fromisoformat(text)
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def seconds_since(iso: str | None, now: datetime) -> float | None:
    moment = parse_time(iso)
    return None if moment is None else (now - moment).total_seconds()


def short_time(iso: str | None) -> str:
    """``2026-01-05 10:15:00`` (UTC) from an ISO timestamp."""
    moment = parse_time(iso)
    return "" if moment is None else moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def pretty_json(value: Any) -> str:
    return f"<pre>{esc(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False))}</pre>"


def json_block(ident: str, value: Any) -> str:
    """Data for the script, in a block the browser does not execute; ``<`` is escaped so
    that no value can close the element."""
    text = json.dumps(value, sort_keys=True).replace("<", "\\u003c").replace(">", "\\u003e")
    return f"<script type='application/json' id='{esc(ident)}'>{text}</script>"


def yes_no(flag: bool, yes: str, no: str) -> str:
    return f"<span class='bad'>{esc(yes)}</span>" if flag else f"<span class='ok'>{esc(no)}</span>"


def number(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:,.{digits}f}"
