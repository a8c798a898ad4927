"""What a key or a team may use: requests and tokens per minute, and a token budget per day or
month. Windows are fixed and in UTC: a minute, a calendar day, a calendar month."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, get_args

Period = Literal["day", "month"]
PERIODS: tuple[Period, ...] = get_args(Period)
Window = Literal["minute", "day", "month"]


@dataclass(frozen=True)
class Limits:
    """None: no limit of that kind. Tokens are prompt plus completion tokens, as served."""

    rpm_limit: int | None = None
    tpm_limit: int | None = None
    token_budget: int | None = None
    budget_period: Period = "day"

    def __post_init__(self) -> None:
        for name in ("rpm_limit", "tpm_limit", "token_budget"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} is a whole number of 0 or more, or none")
        if self.budget_period not in PERIODS:
            raise ValueError(f"budget_period is one of {', '.join(PERIODS)}")

    @property
    def any(self) -> bool:
        return (self.rpm_limit, self.tpm_limit, self.token_budget) != (None, None, None)

    def as_payload(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> Limits:
        return cls(
            **{name: payload.get(name) for name in ("rpm_limit", "tpm_limit", "token_budget")},
            budget_period=payload.get("budget_period") or "day",
        )


def window_bounds(window: Window, now: datetime) -> tuple[datetime, datetime]:
    """The start and end of the ``window`` that holds ``now`` (UTC)."""
    now = now.astimezone(UTC)
    if window == "minute":
        start = now.replace(second=0, microsecond=0)
        return start, start + timedelta(minutes=1)
    start = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if window == "day":
        return start, start + timedelta(days=1)
    start = start.replace(day=1)
    following = (start + timedelta(days=32)).replace(day=1)
    return start, following


def seconds_left(window: Window, now: datetime) -> int:
    """Whole seconds until ``window`` ends, at least 1 (what a client waits at most)."""
    _, end = window_bounds(window, now)
    return max(1, round((end - now.astimezone(UTC)).total_seconds()))
