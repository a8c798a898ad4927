"""Instance leases: who is alive, so that the requests of a gateway that never comes back are
marked `interrupted` by one that is.

Each running gateway holds one row in ``instance_leases`` and renews it every
``lease_renew_s``; the row says it is alive until ``expires_at`` (``lease_ttl_s`` after the
renewal, by the database's clock, so replicas' own clocks never matter). A gateway that
crashes stops renewing. Any live gateway, at startup and on every renewal, looks for expired
leases of other instances and, in one transaction per pass, marks each such instance's
unanswered requests `interrupted` and deletes its lease.

Race safety: marking an instance happens only while holding its lease row's lock. Another
gateway's pass skips a row that is locked (``FOR UPDATE SKIP LOCKED``) and, once the holder
has committed, no longer sees it; an instance restarting under the same id takes its own row
(waiting for a pass in progress) before it marks its previous run's requests. So each request
is marked once.

What a lease cannot tell: a gateway cut off from the database for longer than ``lease_ttl_s``
but still alive is taken for dead. Its requests in flight are then marked `interrupted` and
later also get their `completion` (both events stay; nothing is rewritten), and its next
renewal finds the lease gone, logs ``lease_lost`` and takes a new one.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
import structlog

from gateway.audit.log import AuditLog, AuditUnavailableError
from gateway.audit.schema import metadata
from gateway.db import write_connection
from gateway.recovery import RESTART_REASON, mark_interrupted_in

log = structlog.get_logger(__name__)

instance_leases = sa.Table(
    "instance_leases",
    metadata,
    sa.Column("instance_id", sa.String(100), primary_key=True),
    sa.Column("renewed_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False, index=True),
)

EXPIRED_REASON = "the gateway serving the request stopped renewing its lease and did not return"


def database_now(connection: sa.Connection) -> datetime:
    """PostgreSQL's clock (UTC): one clock for every replica. SQLite is embedded (every
    instance on one host) and its clock counts whole seconds, so there: this host's."""
    if connection.dialect.name != "postgresql":
        return datetime.now(UTC)
    now: datetime = connection.execute(sa.select(sa.func.now())).scalar_one()
    return now.astimezone(UTC)


class Leases:
    """This instance's lease, and the marking of instances whose lease expired."""

    def __init__(self, audit: AuditLog, db: sa.Engine, instance: str, ttl_s: float) -> None:
        self._audit = audit
        self._db = db
        self.instance = instance
        self.ttl_s = ttl_s

    def take(self) -> int:
        """At startup: mark the requests this instance's previous run left unanswered and
        take (or renew) its lease, in one transaction that holds the lease row. Returns how
        many requests were marked."""
        try:
            with write_connection(self._db) as connection, connection.begin():
                own = self._lock(connection, [self.instance], skip_locked=False)
                marked = mark_interrupted_in(
                    self._audit, connection, self.instance, RESTART_REASON, self.instance
                )
                self._store(connection, exists=bool(own))
                return marked
        except sa.exc.SQLAlchemyError as error:
            raise AuditUnavailableError(f"audit store unavailable: {error}") from error

    def renew(self) -> None:
        """Extend this instance's lease; a lease that was taken for expired meanwhile is
        taken anew (and ``lease_lost`` logged)."""
        try:
            with write_connection(self._db) as connection, connection.begin():
                now = database_now(connection)
                renewed = connection.execute(
                    sa.update(instance_leases)
                    .where(instance_leases.c.instance_id == self.instance)
                    .values(renewed_at=now, expires_at=now + timedelta(seconds=self.ttl_s))
                )
                if renewed.rowcount == 0:
                    log.warning(
                        "lease_lost",
                        instance_id=self.instance,
                        hint="the database did not hear from this gateway for longer than "
                        "lease_ttl_s; its requests in flight then were marked interrupted",
                    )
                    self._store(connection, exists=False, now=now)
        except sa.exc.SQLAlchemyError as error:
            raise AuditUnavailableError(f"audit store unavailable: {error}") from error

    def mark_expired(self) -> dict[str, int]:
        """Mark the unanswered requests of every other instance whose lease has expired and
        delete those leases; returns {instance id: requests marked}."""
        try:
            with write_connection(self._db) as connection, connection.begin():
                now = database_now(connection)
                query = sa.select(instance_leases.c.instance_id).where(
                    instance_leases.c.expires_at < now,
                    instance_leases.c.instance_id != self.instance,
                )
                if connection.dialect.name == "postgresql":
                    query = query.with_for_update(skip_locked=True)
                expired = list(connection.scalars(query))
                marked = {}
                for instance in expired:
                    marked[instance] = mark_interrupted_in(
                        self._audit, connection, instance, EXPIRED_REASON, self.instance
                    )
                if expired:
                    connection.execute(
                        sa.delete(instance_leases).where(instance_leases.c.instance_id.in_(expired))
                    )
                return marked
        except sa.exc.SQLAlchemyError as error:
            raise AuditUnavailableError(f"audit store unavailable: {error}") from error

    def release(self) -> None:
        """At a clean shutdown (every request answered and recorded): give the lease up, so
        that no other instance looks into this one's requests."""
        try:
            with write_connection(self._db) as connection, connection.begin():
                connection.execute(
                    sa.delete(instance_leases).where(instance_leases.c.instance_id == self.instance)
                )
        except sa.exc.SQLAlchemyError as error:
            raise AuditUnavailableError(f"audit store unavailable: {error}") from error

    def _lock(
        self, connection: sa.Connection, instances: list[str], *, skip_locked: bool
    ) -> list[str]:
        query = sa.select(instance_leases.c.instance_id).where(
            instance_leases.c.instance_id.in_(instances)
        )
        if connection.dialect.name == "postgresql":
            query = query.with_for_update(skip_locked=skip_locked)
        return list(connection.scalars(query))

    def _store(
        self, connection: sa.Connection, *, exists: bool, now: datetime | None = None
    ) -> None:
        now = now or database_now(connection)
        values = {"renewed_at": now, "expires_at": now + timedelta(seconds=self.ttl_s)}
        if exists:
            connection.execute(
                sa.update(instance_leases)
                .where(instance_leases.c.instance_id == self.instance)
                .values(**values)
            )
        else:
            connection.execute(
                sa.insert(instance_leases).values(instance_id=self.instance, **values)
            )
