"""What ``bench/gpu_check.sh`` relies on, checked where there is no GPU: the lossless tests it
runs need none of the gateway's dependencies (the GPU machine's image lacks them), and the
demo's shape travels without its weights and rebuilds into a model of that shape."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench.demo_shape import build, copy_shape
from tests.tiny_models import build_pair

ROOT = Path(__file__).resolve().parents[2]
GPU_TESTS = (
    "tests/engine/test_engine_greedy.py",
    "tests/engine/test_engine_sampling.py",
    "tests/engine/test_engine_behaviour.py",
)
GATEWAY_ONLY = ("psycopg", "sqlalchemy", "alembic", "fastapi", "structlog", "cryptography")


def test_the_gpu_lossless_tests_collect_without_the_gateway_dependencies() -> None:
    script = (ROOT / "bench/gpu_check.sh").read_text()
    assert all(path in script for path in GPU_TESTS)  # the files the script runs
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in GATEWAY_ONLY)
    code = (
        f"import sys; {blocked}; import pytest; "
        f"sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', "
        f"{', '.join(repr(p) for p in GPU_TESTS)}]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "collected" in done.stdout


def test_the_blocked_import_check_has_power(tmp_path: Path) -> None:
    """The same check fails for a test module that imports a gateway dependency."""
    (tmp_path / "test_needs_db.py").write_text("import sqlalchemy\n\ndef test_x():\n    pass\n")
    code = (
        "import sys; sys.modules['sqlalchemy'] = None; import pytest; "
        f"sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', "
        f"{str(tmp_path / 'test_needs_db.py')!r}]))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True)
    assert done.returncode != 0


def test_the_demo_shape_travels_without_weights_and_rebuilds(tmp_path: Path) -> None:
    target, _ = build_pair(tmp_path / "pair")
    shape = tmp_path / "shape"
    copy_shape(target, shape)
    assert not list(shape.glob("*.safetensors"))
    assert sum(f.stat().st_size for f in shape.iterdir()) < 1 << 20
    rebuilt_dir = build(shape, tmp_path / "rebuilt")
    rebuilt = AutoModelForCausalLM.from_pretrained(rebuilt_dir, dtype="auto")
    original = AutoModelForCausalLM.from_pretrained(target)
    assert rebuilt.dtype == torch.bfloat16
    shapes = {name: tuple(p.shape) for name, p in original.named_parameters()}
    assert {name: tuple(p.shape) for name, p in rebuilt.named_parameters()} == shapes
    assert (rebuilt_dir / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()
    assert (shape / "config.json").read_bytes() == (target / "config.json").read_bytes()
    differs = any(
        not torch.equal(p.float(), q.float())
        for p, q in zip(rebuilt.parameters(), original.parameters(), strict=True)
    )
    assert differs  # random weights: the shape is all that travels
