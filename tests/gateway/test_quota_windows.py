"""Quota windows in the database, on PostgreSQL and SQLite: the check and the count of a
request are one transaction under a row lock, so no number of threads (or replicas) admits
more requests in a window than its limit; tokens are charged as served."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from gateway.quota_limits import Limits
from gateway.quota_windows import QuotaWindows

NOON = datetime(2026, 3, 14, 12, 0, 30, tzinfo=UTC)


def test_concurrent_admissions_never_exceed_the_request_limit(db: sa.Engine) -> None:
    windows = QuotaWindows(db)
    checks = [("key:a", Limits(rpm_limit=25)), ("team:t", Limits(rpm_limit=40))]
    with ThreadPoolExecutor(8) as pool:
        verdicts = list(pool.map(lambda _: windows.admit(checks, NOON), range(60)))
    assert sum(verdict.allowed for verdict in verdicts) == 25
    assert windows.counted("key:a", "minute", NOON) == (25, 0)
    assert windows.counted("team:t", "minute", NOON) == (25, 0)
    refused = [verdict for verdict in verdicts if not verdict.allowed]
    assert {(v.refusal.subject, v.refusal.dimension) for v in refused if v.refusal} == {
        ("key:a", "requests")
    }


def test_a_refusal_by_the_team_counts_nothing_against_the_key(db: sa.Engine) -> None:
    windows = QuotaWindows(db)
    checks = [("key:a", Limits(rpm_limit=10)), ("team:t", Limits(rpm_limit=2))]
    allowed = [windows.admit(checks, NOON).allowed for _ in range(5)]
    assert allowed == [True, True, False, False, False]
    assert windows.counted("key:a", "minute", NOON) == (2, 0)
    last = windows.admit(checks, NOON)
    assert last.refusal is not None and last.refusal.subject == "team:t"
    # The header figures are the binding limit's: the team's, with nothing left.
    assert last.requests is not None and (last.requests.limit, last.requests.remaining) == (2, 0)
    assert last.requests.reset_s == 30


def test_windows_start_afresh_each_minute(db: sa.Engine) -> None:
    windows = QuotaWindows(db)
    checks = [("key:a", Limits(rpm_limit=1))]
    assert windows.admit(checks, NOON).allowed
    assert not windows.admit(checks, NOON + timedelta(seconds=29)).allowed
    assert windows.admit(checks, NOON + timedelta(seconds=30)).allowed


def test_tokens_admit_below_the_limit_and_are_charged_as_served(db: sa.Engine) -> None:
    windows = QuotaWindows(db)
    checks = [("key:a", Limits(tpm_limit=10, token_budget=30, budget_period="day"))]
    first = windows.admit(checks, NOON)
    assert first.allowed and first.tokens is not None
    assert (first.tokens.limit, first.tokens.remaining) == (10, 10)
    windows.charge(first.charges, 8, NOON)
    second = windows.admit(checks, NOON)
    assert second.allowed and second.tokens is not None and second.tokens.remaining == 2
    windows.charge(second.charges, 8, NOON)  # served past the limit: counted as served
    refused = windows.admit(checks, NOON)
    assert not refused.allowed and refused.refusal is not None
    assert refused.refusal.dimension == "tokens" and refused.tokens is not None
    assert refused.tokens.remaining == 0
    # Next minute the per-minute limit has room (10 left, fewer than the day's 14).
    later = NOON + timedelta(minutes=1)
    third = windows.admit(checks, later)
    assert third.allowed and third.tokens is not None
    assert (third.tokens.limit, third.tokens.remaining) == (10, 10)
    windows.charge(third.charges, 14, later)
    spent = windows.admit(checks, later + timedelta(minutes=1))
    assert spent.refusal is not None and spent.refusal.dimension == "budget"
    assert spent.tokens is not None and spent.tokens.reset_s == 11 * 3600 + 57 * 60 + 30
    assert windows.counted("key:a", "day", later) == (0, 30)
    assert windows.admit(checks, NOON + timedelta(days=1)).allowed


def test_a_monthly_budget_resets_on_the_first_of_the_month(db: sa.Engine) -> None:
    windows = QuotaWindows(db)
    checks = [("team:t", Limits(token_budget=5, budget_period="month"))]
    admitted = windows.admit(checks, NOON)
    windows.charge(admitted.charges, 5, NOON)
    assert not windows.admit(checks, datetime(2026, 3, 31, 23, 59, tzinfo=UTC)).allowed
    assert windows.admit(checks, datetime(2026, 4, 1, tzinfo=UTC)).allowed
