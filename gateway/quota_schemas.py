"""Request and response bodies of the team, quota and usage admin endpoints."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.quota_limits import Limits

_LIMIT = "None: no limit of this kind."


class QuotaRequest(BaseModel):
    """A whole quota: a limit left out is no limit."""

    model_config = ConfigDict(extra="forbid")

    rpm_limit: int | None = Field(default=None, ge=0, description=f"Requests per minute. {_LIMIT}")
    tpm_limit: int | None = Field(
        default=None, ge=0, description=f"Prompt + completion tokens per minute. {_LIMIT}"
    )
    token_budget: int | None = Field(
        default=None, ge=0, description=f"Tokens per budget period. {_LIMIT}"
    )
    budget_period: Literal["day", "month"] = Field(
        default="day", description="The token budget's period, a UTC calendar day or month."
    )

    def limits(self) -> Limits:
        return Limits(self.rpm_limit, self.tpm_limit, self.token_budget, self.budget_period)


class QuotaInfo(QuotaRequest):
    model_config = ConfigDict(extra="forbid")

    subject: str = Field(description="key:<key id> or team:<name>.")

    @classmethod
    def of(cls, subject: str, limits: Limits) -> QuotaInfo:
        return cls(subject=subject, **limits.as_payload())


class TeamCreateRequest(QuotaRequest):
    name: str = Field(min_length=1, max_length=100)


class TeamInfo(BaseModel):
    name: str
    quota: QuotaInfo


class TeamMembershipRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    team: str | None = Field(description="The team's name; null: out of any team.")


class KeyTeamInfo(BaseModel):
    key_id: str
    name: str
    team: str | None
