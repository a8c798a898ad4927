"""The audit log with telemetry: every append gets a span, a latency sample and, if it
fails, a failure count. Subclassing keeps the audit code free of telemetry and catches
every append (request, completion, fallback, export, checkpoint, startup) in one place."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

from gateway.audit.log import AppendedEvent, AuditLog, TamperDetectedError
from gateway.audit.signing import CheckpointSigner
from gateway.audit.sweep import Sweep
from gateway.observability.telemetry import Telemetry


class ObservedAuditLog(AuditLog):
    def __init__(
        self,
        db: sa.Engine,
        signer: CheckpointSigner | None,
        telemetry: Telemetry,
        **options: Any,
    ) -> None:
        super().__init__(db, signer, **options)
        self._telemetry = telemetry

    def on_tamper(self, error: TamperDetectedError) -> None:
        self._telemetry.metrics.audit_tamper_detected.inc()

    def on_reverified(self, sweep: Sweep) -> None:
        metrics = self._telemetry.metrics
        metrics.audit_reverified.set(self.reverified_at or time.time())
        metrics.audit_reverify_duration.set(time.monotonic() - sweep.started)

    @contextmanager
    def observed(self, kind: str) -> Iterator[Callable[[AppendedEvent], None]]:
        with self._telemetry.audit_write(kind) as span:
            yield lambda appended: span.record(appended.seq, appended.event_id)
