"""Console sessions: a key is POSTed once, and the browser gets back a signed, expiring token
in an HttpOnly, SameSite=Strict cookie (Secure over HTTPS). The key itself is never kept,
put in a URL or logged.

The token is ``base64url(key_id|role|expiry|nonce).hex(MAC)`` with a sub-key of the audit MAC
key (``EventMac.derived``): every replica holding that file accepts it, a session MAC never
verifies as an event or key-row MAC, and whoever can write the database cannot mint one. The
role is part of what is signed, so a changed key row cannot change a session's role; the key
must still be active on every page (a revoked key's sessions end at once).

Every state-changing form carries a CSRF token, a MAC of the session token under another
sub-key; the sign-in form, before there is a session, one bound to a random pre-session
cookie (double submit). A POST whose ``Origin`` names another site is refused as well.
"""

from __future__ import annotations

import base64
import secrets
import time
from dataclasses import dataclass

from fastapi import Request, Response

from gateway.audit.mac import EventMac
from gateway.keys import ROLES, Role

SESSION_COOKIE = "sg_console"
LOGIN_COOKIE = "sg_console_login"
COOKIE_PATH = "/console"
SESSION_TTL_S = 8 * 3600
SESSION_LABEL = b"specgate console session v1"
CSRF_LABEL = b"specgate console csrf v1"


@dataclass(frozen=True)
class Session:
    key_id: str
    role: Role
    expires: int
    token: str


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class SessionKeys:
    """The two sub-keys of the audit MAC key the console signs with."""

    def __init__(self, mac: EventMac) -> None:
        self._session = mac.derived(SESSION_LABEL)
        self._csrf = mac.derived(CSRF_LABEL)

    def issue(self, key_id: str, role: Role, now: float | None = None) -> Session:
        expires = int(now if now is not None else time.time()) + SESSION_TTL_S
        body = _b64(f"{key_id}|{role}|{expires}|{secrets.token_hex(8)}".encode())
        token = f"{body}.{self._session.mac(body.encode())}"
        return Session(key_id, role, expires, token)

    def read(self, token: str | None, now: float | None = None) -> Session | None:
        """The session a cookie holds, or None when it is missing, forged or expired."""
        if not token or len(token) > 512 or "." not in token:
            return None
        body, _, mac = token.partition(".")
        if not self._session.valid(body.encode(), mac):
            return None
        try:
            key_id, role, expires, _nonce = _unb64(body).decode().split("|")
            expiry = int(expires)
        except (ValueError, UnicodeDecodeError):
            return None
        if role not in ROLES or expiry <= (now if now is not None else time.time()):
            return None
        return Session(key_id, role, expiry, token)

    def csrf(self, bound_to: str) -> str:
        """The CSRF token for forms of the session (or pre-session nonce) ``bound_to``."""
        return self._csrf.mac(bound_to.encode())[:32]

    def csrf_ok(self, bound_to: str | None, sent: str | None) -> bool:
        if not bound_to or not isinstance(sent, str):
            return False
        return secrets.compare_digest(self.csrf(bound_to).encode(), sent.encode())


def same_origin(request: Request) -> bool:
    """False when the browser says the form came from another site (``Origin``); a request
    without the header (not a browser, or an old one) is left to the CSRF token."""
    origin = request.headers.get("origin")
    if origin is None:
        return True
    own = f"{request.url.scheme}://{request.headers.get('host', request.url.netloc)}"
    return origin == own


def set_cookie(response: Response, request: Request, name: str, value: str, max_age: int) -> None:
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        path=COOKIE_PATH,
        httponly=True,
        secure=request.url.scheme == "https",
        samesite="strict",
    )


def clear_cookie(response: Response, request: Request, name: str) -> None:
    response.delete_cookie(
        name,
        path=COOKIE_PATH,
        httponly=True,
        secure=request.url.scheme == "https",
        samesite="strict",
    )
