"""The operator's declared record of processing activities (revDSG Art. 12, GDPR Art. 30).

The operator keeps it in a YAML file (``processing_record_path``, ``specgate compliance
record``). The file is checked against a strict schema, and each new version of it is
appended to the audit log as a ``processing_record`` event (its canonical hash and content),
so that a compliance report names the declaration in force and since when, from the
append-only log rather than from a file that may have changed since.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import sqlalchemy as sa
import structlog
import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from gateway.audit.canonical import canonical_json
from gateway.audit.log import AuditLog
from gateway.audit.schema import audit_events
from gateway.settings import ConfigError

log = structlog.get_logger(__name__)

PROCESSING_RECORD_KIND = "processing_record"

Text = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Party(_Strict):
    """A controller, representative or data protection officer."""

    name: Text
    address: Text | None = None
    contact: Text = Field(description="Where data subjects and authorities reach them.")


class Purpose(_Strict):
    purpose: Text
    legal_basis: Text | None = None


class DataCategory(_Strict):
    category: Text
    description: Text | None = None
    sensitive: bool = Field(
        default=False,
        description="Sensitive personal data (revDSG Art. 5 c), special categories (GDPR Art. 9).",
    )


class Recipient(_Strict):
    recipient: Text
    description: Text | None = None


class Transfer(_Strict):
    """A disclosure abroad: the state and the guarantees (revDSG Art. 16 f)."""

    country: Text
    recipient: Text
    safeguards: Text


class RetentionPeriod(_Strict):
    data: Text
    period: Text


class Measures(_Strict):
    """The general description of the measures ensuring data security (revDSG Art. 8)."""

    technical: list[Text] = Field(min_length=1)
    organisational: list[Text] = Field(min_length=1)


class ProcessingRecord(_Strict):
    """Every field a record needs is required, ``transfers_abroad`` included: an empty list
    states that nothing is disclosed abroad, rather than leaving the question unanswered."""

    activity: Text = Field(description="The processing activity this record describes.")
    controller: Party
    representative: Party | None = None
    dpo: Party | None = None
    purposes: list[Purpose] = Field(min_length=1)
    data_subjects: list[Text] = Field(min_length=1)
    personal_data: list[DataCategory] = Field(min_length=1)
    recipients: list[Recipient]
    transfers_abroad: list[Transfer]
    retention: list[RetentionPeriod] = Field(min_length=1)
    measures: Measures


class ProcessingRecordError(ConfigError):
    """The file cannot be read or is not a valid record; the message names file and line."""


def load_processing_record(path: Path) -> ProcessingRecord:
    try:
        text = path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ProcessingRecordError(f"{path}: cannot read the processing record: {error}") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ProcessingRecordError(f"{where}: not valid YAML: {error}") from None
    try:
        return ProcessingRecord.model_validate(data)
    except ValidationError as error:
        problems = [
            f"{path}:{_line_of(node, problem['loc'])}: "
            f"{'.'.join(map(str, problem['loc'])) or 'the file'}: {problem['msg']}"
            for problem in error.errors()
        ]
        raise ProcessingRecordError("\n".join(problems)) from None


def _line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int:
    """The line of the deepest YAML node on the error's path (for a missing field: the line
    of the mapping that lacks it)."""
    if node is None:
        return 1
    for part in loc:
        child = _child(node, part)
        if child is None:
            break
        node = child
    return node.start_mark.line + 1


def _child(node: yaml.Node, part: Any) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        return next((value for key, value in node.value if key.value == part), None)
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
        child: yaml.Node = node.value[part]
        return child
    return None


def record_hash(record: dict[str, Any]) -> str:
    """SHA-256 over the canonical JSON of the record: comments and layout of the file do not
    count, so only a change of what is declared makes a new version."""
    return "sha256:" + hashlib.sha256(canonical_json(record).encode()).hexdigest()


@dataclass(frozen=True)
class DeclaredVersion:
    """One ``processing_record`` event: a version of the declared record."""

    seq: int
    created_at: datetime
    actor: str | None
    sha256: str
    record: dict[str, Any]
    file: str

    @property
    def hash_matches(self) -> bool:
        return record_hash(self.record) == self.sha256


def declared_versions(db: sa.Engine, until: datetime | None = None) -> list[DeclaredVersion]:
    """The versions recorded before ``until`` (all when None), oldest first."""
    events = audit_events.c
    query = (
        sa.select(events.seq, events.created_at, events.actor, events.payload)
        .where(events.kind == PROCESSING_RECORD_KIND)
        .order_by(events.seq)
    )
    if until is not None:
        query = query.where(events.created_at < until)
    with db.connect() as connection:
        return [_version(*row) for row in connection.execute(query)]


def _version(seq: int, created_at: datetime, actor: str | None, payload: Any) -> DeclaredVersion:
    payload = payload if isinstance(payload, dict) else {}
    record = payload.get("record")
    return DeclaredVersion(
        seq=seq,
        created_at=created_at if created_at.tzinfo else created_at.replace(tzinfo=UTC),
        actor=actor,
        sha256=str(payload.get("sha256")),
        record=record if isinstance(record, dict) else {},
        file=str(payload.get("file")),
    )


def record_declared(
    audit: AuditLog, db: sa.Engine, path: Path, actor: str
) -> tuple[DeclaredVersion, bool]:
    """Append the file's record as a ``processing_record`` event unless the newest such event
    already has its hash; the version in force, and whether it was appended now."""
    record = load_processing_record(path).model_dump(mode="json")
    digest = record_hash(record)
    versions = declared_versions(db)
    if versions and versions[-1].sha256 == digest:
        return versions[-1], False
    payload = {"sha256": digest, "file": str(path), "record": record}
    appended = audit.append(PROCESSING_RECORD_KIND, actor, payload)
    version = DeclaredVersion(appended.seq, appended.created_at, actor, digest, record, str(path))
    return version, True


def record_at_startup(path: Path | None, audit: AuditLog, db: sa.Engine, actor: str) -> None:
    """At every start: the configured record, if it changed (an invalid file stops the start);
    without one, a warning (the compliance report then opens with the same warning)."""
    if path is None:
        log.warning("processing_record_not_declared", setting="processing_record_path")
        return
    version, appended = record_declared(audit, db, path, actor)
    log.info("processing_record", seq=version.seq, sha256=version.sha256, new_version=appended)
