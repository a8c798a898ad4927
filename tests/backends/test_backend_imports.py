"""The gateway's backend seam and the vLLM backend load without PyTorch: a gateway that
fronts vLLM needs none of the engine's model code (``engine.api.types``, ``engine.api.chat`` and the
configuration are torch-free)."""

from __future__ import annotations

import subprocess
import sys

import pytest

TORCH_FREE = ["gateway.backends.base", "gateway.backends.vllm", "gateway.settings"]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_the_module_imports_with_torch_blocked(module: str) -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any import of torch now raises ImportError\n"
        f"import {module}\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_blocking_torch_is_felt() -> None:
    """Power check: the same block stops a module that needs torch."""
    code = "import sys\nsys.modules['torch'] = None\nimport engine.serving.service\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0 and "torch" in done.stderr
