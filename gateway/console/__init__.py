"""The web console, served by the gateway under ``/console``: log status, event search and
receipts checked in the browser, erasures and holds, the compliance report (``auditor``);
models, speculation fallback, keys and usage (``admin``); an ``app`` key's own requests.
docs/auditors.md ("Console") says what it guarantees and which test holds each."""

from __future__ import annotations

from gateway.console import auditor, operator
from gateway.console.web import router

__all__ = ["auditor", "operator", "router"]
