"""What every console page shares: the security headers, the signed-in viewer and the role
and CSRF checks, sign-in and sign-out, and the two static files."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from importlib import resources
from urllib.parse import parse_qs

import structlog
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from gateway.console import pages, queries
from gateway.console.session import (
    LOGIN_COOKIE,
    SESSION_COOKIE,
    SESSION_TTL_S,
    Session,
    SessionKeys,
    clear_cookie,
    same_origin,
    set_cookie,
)
from gateway.dependencies import Services, ServicesDep
from gateway.keys import Principal, Role

log = structlog.get_logger(__name__)

router = APIRouter(prefix="/console", include_in_schema=False)

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'; "
    "object-src 'none'"
)
# The compliance report is a standalone document whose charts carry inline styles (matplotlib's
# SVG): it is served sandboxed (an opaque origin, no script at all) and may fetch nothing.
REPORT_CSP = (
    "sandbox; default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)
MAX_FORM_BYTES = 16 * 1024
STATIC = {
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}


def security_headers(csp: str = CSP) -> dict[str, str]:
    """The headers of every console response."""
    return {
        "content-security-policy": csp,
        "x-content-type-options": "nosniff",
        "x-frame-options": "DENY",
        "referrer-policy": "same-origin",
        "cache-control": "no-store",
        "cross-origin-opener-policy": "same-origin",
    }


def html(page: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(page, status_code=status, headers=security_headers())


def redirect(path: str) -> RedirectResponse:
    return RedirectResponse(path, status_code=303, headers=security_headers())


@dataclass(frozen=True)
class Viewer:
    principal: Principal
    session: Session
    csrf: str

    @property
    def role(self) -> Role:
        return self.principal.role

    def page(self, title: str, body: str, active: str = "", status: int = 200) -> HTMLResponse:
        return html(pages.layout(title, body, self.principal, self.csrf, active), status)


def session_keys(services: Services) -> SessionKeys:
    mac = services.audit.mac
    if mac is None:  # a KeyStore refuses to run without it, so a serving gateway has one
        raise RuntimeError("the console needs the audit MAC key")
    return SessionKeys(mac)


async def viewer_of(request: Request, services: Services) -> Viewer | None:
    """The signed-in viewer: a valid, unexpired session of a key still active with the
    role it was signed in with."""
    keys = session_keys(services)
    session = keys.read(request.cookies.get(SESSION_COOKIE))
    if session is None:
        return None
    principal = await services.offload.db(queries.active_key, services.db, session.key_id)
    if principal is None or principal.role != session.role:
        return None
    return Viewer(principal, session, keys.csrf(session.token))


async def signed_in(
    request: Request, services: Services, roles: tuple[Role, ...]
) -> Viewer | Response:
    """The viewer, or the response to give instead: sign-in for none, 403 for another role."""
    viewer = await viewer_of(request, services)
    if viewer is None:
        return redirect("/console/login")
    if viewer.role not in roles:
        message = f"This page is not for the '{viewer.role}' role."
        return viewer.page(
            "Not for this key", f"<p class='bad'>{pages.esc(message)}</p>", status=403
        )
    return viewer


async def read_form(request: Request) -> dict[str, str]:
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        return {}
    fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    return {name: values[0] for name, values in fields.items()}


async def posted(
    request: Request, services: Services, roles: tuple[Role, ...]
) -> tuple[Viewer, dict[str, str]] | Response:
    """A state-changing form of a signed-in viewer with ``roles``: its fields once the CSRF
    token and the origin check pass, else the response (403)."""
    viewer = await signed_in(request, services, roles)
    if isinstance(viewer, Response):
        return viewer
    form = await read_form(request)
    keys = session_keys(services)
    if not same_origin(request) or not keys.csrf_ok(viewer.session.token, form.get("csrf")):
        log.warning("console_csrf_refused", key_id=viewer.principal.key_id, path=request.url.path)
        return viewer.page(
            "Form refused",
            "<p class='bad' id='csrf-refused'>The form's CSRF "
            "token is missing or wrong. Reload the page and try again.</p>",
            status=403,
        )
    return viewer, form


# --- sign-in, sign-out, static files -------------------------------------------------------


def _login_page(
    keys: SessionKeys, request: Request, message: str = "", status: int = 200
) -> HTMLResponse:
    nonce = secrets.token_hex(16)
    problem = f"<p class='bad' id='login-error'>{pages.esc(message)}</p>" if message else ""
    body = (
        "<div class='card login'>"
        f"{problem}<form class='stack' method='post' action='/console/login' id='login'>"
        f"{pages.csrf_field(keys.csrf('login:' + nonce))}"
        "<label>API key (admin, auditor or app)"
        "<input type='password' name='key' id='key' autocomplete='off' required></label>"
        "<button type='submit' id='sign-in'>Sign in</button></form>"
        "<p class='muted'>The key is sent once, in the body of this form; the console then "
        "keeps a signed session cookie, never the key.</p></div>"
    )
    response = html(pages.layout("Sign in", body), status)
    set_cookie(response, request, LOGIN_COOKIE, nonce, 3600)
    return response


@router.get("")
@router.get("/")
async def console_home(request: Request, services: ServicesDep) -> Response:
    viewer = await viewer_of(request, services)
    return redirect(pages.home(viewer.role) if viewer else "/console/login")


@router.get("/login")
async def login_form(request: Request, services: ServicesDep) -> Response:
    viewer = await viewer_of(request, services)
    if viewer is not None:
        return redirect(pages.home(viewer.role))
    return _login_page(session_keys(services), request)


@router.post("/login")
async def login(request: Request, services: ServicesDep) -> Response:
    keys = session_keys(services)
    form = await read_form(request)
    nonce = request.cookies.get(LOGIN_COOKIE)
    if not same_origin(request) or not keys.csrf_ok(nonce and "login:" + nonce, form.get("csrf")):
        return _login_page(keys, request, "The sign-in form expired; try again.", 403)
    principal = await services.offload.db(services.keys.authenticate, form.get("key", "").strip())
    if principal is None:
        log.info("console_sign_in_refused")
        return _login_page(keys, request, "Incorrect or revoked key.", 401)
    session = keys.issue(principal.key_id, principal.role)
    log.info("console_signed_in", key_id=principal.key_id, role=principal.role)
    response = redirect(pages.home(principal.role))
    set_cookie(response, request, SESSION_COOKIE, session.token, SESSION_TTL_S)
    clear_cookie(response, request, LOGIN_COOKIE)
    return response


@router.post("/logout")
async def logout(request: Request, services: ServicesDep) -> Response:
    checked = await posted(request, services, ("admin", "auditor", "app"))
    if isinstance(checked, Response):
        return checked
    response = redirect("/console/login")
    clear_cookie(response, request, SESSION_COOKIE)
    return response


@router.get("/static/{name}")
async def static_file(name: str) -> Response:
    if name not in STATIC:
        return Response(status_code=404, headers=security_headers())
    data = resources.files("gateway.console").joinpath("static", name).read_bytes()
    return Response(data, media_type=STATIC[name], headers=security_headers())
