"""What an operator or a user should know about how this gateway serves, beyond ready or not:
said once here, logged at startup and shown in ``/readyz`` and the ``/v1/models`` card."""

from __future__ import annotations

from gateway.backends.base import BackendCard
from gateway.settings import Settings

DEMO_DRAFT_MISSING = (
    "The demo's draft model is not built yet, so only n-gram speculation is served. "
    "`make draft` (specgate models build-demo) distils it (about 15 minutes on 2 cores); "
    "restart the gateway to serve with it."
)


def demo_draft_missing(settings: Settings, draft: object | None) -> bool:
    """The demo (no target given) is served without a draft (``draft``: its path or name)."""
    return settings.target is None and draft is None


def serving_notes(settings: Settings, card: BackendCard) -> list[str]:
    draft = True if card.has_artefact("draft_model") else None
    return [DEMO_DRAFT_MISSING] if demo_draft_missing(settings, draft) else []
