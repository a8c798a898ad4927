"""The offline tools (verify, verify-receipt, witness) run with the standard library and
``cryptography`` alone: imported in a subprocess where torch, FastAPI, Starlette, SQLAlchemy,
pydantic, structlog and typer cannot be imported, they verify a real export and receipt."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import sqlalchemy as sa

from gateway.audit.log import AuditLog
from gateway.audit.mac import EventMac
from gateway.audit.signing import CheckpointSigner

BLOCKED = [
    "torch",
    "fastapi",
    "starlette",
    "sqlalchemy",
    "pydantic",
    "structlog",
    "typer",
    "psycopg",
    "transformers",
    "uvicorn",
]

SCRIPT = """
import importlib.abc, json, sys
from pathlib import Path

BLOCKED = set(sys.argv[1].split(","))

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Block())
from gateway.audit.mac import EventMac
from gateway.audit.receipt import verify_receipt
from gateway.audit.verify import verify_export
import gateway.audit.witness  # noqa: F401  (importable alone too)

folder = Path(sys.argv[2])
pem = (folder / "pub.pem").read_bytes()
lines = (folder / "export.jsonl").read_text("utf-8").splitlines(keepends=True)
mac = EventMac.from_file(folder / "mac.key")
trusted = (folder / "trusted").read_text("utf-8")
report = verify_export(lines, pem, mac=mac, trusted_checkpoint=trusted)
receipt = verify_receipt(json.loads((folder / "receipt.json").read_text()), pem)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print(json.dumps({"ok": report.ok, "reason": report.reason, "receipt": receipt,
                  "loaded": loaded}))
"""


def test_offline_tools_need_neither_torch_nor_the_web_stack_nor_sqlalchemy(
    db: sa.Engine, tmp_path: Path
) -> None:
    signer = CheckpointSigner.load_or_create(tmp_path / "signing.pem")
    mac = EventMac.load_or_create(tmp_path / "mac.key")
    log = AuditLog(db, signer, mac)
    request = log.append("request", "key_a", {"prompt_sha256": "ab" * 32})
    trusted = log.checkpoint()["note"]
    log.append("completion", "key_a", {"request_event_id": request.event_id})
    (tmp_path / "trusted").write_text(trusted)
    (tmp_path / "pub.pem").write_bytes(signer.public_key_pem())
    (tmp_path / "export.jsonl").write_text("".join(log.export(None, None, "jsonl", "aud")))
    record = log.event(request.event_id)
    assert record is not None
    (tmp_path / "receipt.json").write_text(json.dumps(log.receipt(record)))
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, ",".join(BLOCKED), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    assert outcome["ok"], outcome["reason"]
    assert "consistent with the trusted checkpoint of size 1" in outcome["reason"]
    assert outcome["receipt"].startswith("event 1 ")
    assert outcome["loaded"] == []
