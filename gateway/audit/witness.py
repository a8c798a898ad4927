"""The witness (``specgate audit witness``), run by the compliance team away from the
gateway: it remembers the last checkpoint it cosigned, and cosigns a new one only if a
consistency proof shows the new tree extends it. A truncation, a fork or a rewrite is
reported by kind. Standard library plus ``cryptography`` only (urllib for HTTP).

A gateway that stops signing would otherwise go unnoticed: it keeps serving its last
checkpoint, and re-cosigning that is consistent. So before it looks at the checkpoint the
witness reads the gateway's ``GET /v1/audit/status`` and alarms

- ``gateway_alarm`` when the gateway reports its tamper alarm (after a rewritten row, a
  forged head or any other failed check it signs no more checkpoints);
- ``stale_checkpoint`` when an event has waited longer than ``max_checkpoint_age_s`` for a
  checkpoint to cover it. A healthy gateway signs every ``checkpoint_interval_s`` whether or
  not traffic arrived, so no event waits much longer than one interval; an idle log has no
  waiting event at all (a checkpoint's own event does not count), so it cannot alarm, however
  long it stays idle or was down before a restart. The age is taken on the gateway's clock
  (the status carries its ``now``), so the two machines' clocks need not agree. The default
  bound, 900 s, is three of the gateway's default 300 s intervals: set it to about three times
  the gateway's ``checkpoint_interval_s``.

State directory: ``log-public-key.pem`` (the gateway's key, pinned at the first run),
``witness-key.pem`` (the witness's Ed25519 key, created at the first run),
``checkpoint`` (the last cosigned note).
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from gateway.audit.merkle import ProofError, verify_consistency
from gateway.audit.note import Checkpoint, NoteError, add_cosignature, verify_checkpoint
from gateway.audit.signing import (
    PublicKeyError,
    load_or_create_private_key,
    load_public_key,
    public_key_pem,
)
from gateway.audit.state import write_atomically

HTTP_TIMEOUT_S = 30.0
DEFAULT_MAX_CHECKPOINT_AGE_S = 900.0


class WitnessAlarm(Exception):
    """The log misbehaved: ``kind`` is truncation, fork, rewrite, bad_signature,
    gateway_alarm or stale_checkpoint."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class WitnessUnavailable(Exception):
    """The gateway could not be asked (network, authentication, a malformed answer)."""


@dataclass(frozen=True)
class WitnessResult:
    old_size: int | None
    checkpoint: Checkpoint
    cosigned: str
    delivered: str  # what the gateway said about the cosignature


class _Client:
    def __init__(self, url: str, key: str) -> None:
        self._base, self._key = url.rstrip("/"), key

    def request(self, path: str, data: bytes | None = None) -> bytes:
        request = urllib.request.Request(
            self._base + path,
            data=data,
            headers={"authorization": f"Bearer {self._key}", "content-type": "text/plain"},
        )
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
                body: bytes = response.read()
                return body
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", "replace")[:300]
            raise WitnessUnavailable(f"{path}: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise WitnessUnavailable(f"{path}: {exc}") from None

    def json(self, path: str) -> Any:
        try:
            return json.loads(self.request(path))
        except ValueError as exc:
            raise WitnessUnavailable(f"{path}: not JSON: {exc}") from None


def witness_once(
    url: str,
    auditor_key: str,
    state: Path,
    name: str,
    max_checkpoint_age_s: float = DEFAULT_MAX_CHECKPOINT_AGE_S,
) -> WitnessResult:
    """One round: check the gateway's status, fetch the checkpoint, check it against the
    remembered one, cosign, store, deliver."""
    client = _Client(url, auditor_key)
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    pinned = state / "log-public-key.pem"
    if not pinned.exists():
        write_atomically(pinned, client.request("/v1/audit/public-key").decode("ascii"))
    try:
        log_key = load_public_key(pinned.read_bytes())
    except PublicKeyError as exc:
        raise WitnessUnavailable(f"{pinned}: {exc}") from None
    witness_key = load_or_create_private_key(state / "witness-key.pem")
    public_file = state / "witness-public-key.pem"
    if not public_file.exists():
        write_atomically(public_file, public_key_pem(witness_key.public_key()).decode("ascii"))
    _check_status(client.json("/v1/audit/status"), max_checkpoint_age_s)
    note = client.request("/v1/audit/checkpoint").decode("utf-8", "replace")
    try:
        new = verify_checkpoint(note, log_key)
    except NoteError as exc:
        raise WitnessAlarm("bad_signature", f"the latest checkpoint is not signed: {exc}") from None
    remembered = state / "checkpoint"
    old = None
    if remembered.exists():
        try:
            old = verify_checkpoint(remembered.read_text("utf-8"), log_key)
        except NoteError as exc:
            raise WitnessUnavailable(f"{remembered} is damaged: {exc}") from None
    if old is not None:
        _check_extends(client, old, new)
    cosigned = add_cosignature(note, name, witness_key, int(time.time()))
    write_atomically(remembered, cosigned)
    try:
        delivered = client.request("/v1/audit/cosignature", cosigned.encode("utf-8")).decode()
    except WitnessUnavailable as exc:
        delivered = f"not accepted: {exc}"
    return WitnessResult(old.size if old else None, new, cosigned, delivered)


def _check_status(status: Any, max_checkpoint_age_s: float) -> None:
    """Alarm on the gateway's own tamper alarm, or on an event that has waited longer than
    the bound for a checkpoint to cover it."""
    if not isinstance(status, dict) or not isinstance(status.get("tamper"), dict | None):
        raise WitnessUnavailable(f"malformed audit status: {status!r:.300}")
    tamper = status["tamper"]
    if tamper is not None:
        raise WitnessAlarm(
            "gateway_alarm",
            f"the gateway reports tampering at event {tamper.get('first_bad_seq')}: "
            f"{tamper.get('reason')}; it signs no more checkpoints",
        )
    waited_s = _uncovered_wait_s(status)
    if waited_s > max_checkpoint_age_s:
        raise WitnessAlarm(
            "stale_checkpoint",
            f"an event written at {status['oldest_uncovered_event_at']} has waited "
            f"{waited_s:.0f} s for a checkpoint (bound {max_checkpoint_age_s:g} s): "
            "the gateway stopped signing",
        )


def _uncovered_wait_s(status: dict[str, Any]) -> float:
    """How long the oldest event no checkpoint covers has waited, on the gateway's clock
    (0 when none waits)."""
    since = status.get("oldest_uncovered_event_at")
    if since is None:
        return 0.0
    try:
        waited = datetime.fromisoformat(status["now"]) - datetime.fromisoformat(since)
    except (KeyError, TypeError, ValueError) as exc:
        raise WitnessUnavailable(f"malformed audit status times: {exc}") from None
    return waited.total_seconds()


def _check_extends(client: _Client, old: Checkpoint, new: Checkpoint) -> None:
    if new.origin != old.origin:
        raise WitnessAlarm("fork", f"the log's origin changed: {old.origin!r} -> {new.origin!r}")
    if new.size < old.size:
        raise WitnessAlarm(
            "truncation",
            f"the log shrank from {old.size} to {new.size} events: events "
            f"{new.size + 1}..{old.size} were removed",
        )
    if new.size == old.size:
        if new.root != old.root:
            raise WitnessAlarm(
                "fork", f"two different checkpoints of size {new.size}: the log forked"
            )
        return
    answer = client.json(f"/v1/audit/consistency?from={old.size}&to={new.size}")
    try:
        proof = [base64.b64decode(h, validate=True) for h in answer["proof"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise WitnessUnavailable(f"malformed consistency proof: {exc}") from None
    try:
        verify_consistency(old.size, new.size, proof, old.root, new.root)
    except ProofError as exc:
        raise WitnessAlarm(
            "rewrite",
            f"the tree of {new.size} events does not extend the cosigned tree of {old.size}: {exc}",
        ) from None
