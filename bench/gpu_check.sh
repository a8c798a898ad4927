#!/usr/bin/env bash
# The checks that need a GPU, as one prepared script for a lent CUDA machine (< 5 minutes):
# the lossless tests on CUDA (the engine picks CUDA when present), plain decoding of the demo
# target's shape beside Hugging Face `generate`, and every method end to end.
#
# The machine has PyTorch and transformers and no network. Prepare here, once:
#   make gpu-wheels      # .whl/: the packages it lacks (bench/gpu_wheels.txt), the demo's shape
# then run with the wheels carried (the device tool's `carry: [".whl"]`):
#   bash bench/gpu_check.sh      # from the repository root; writes into ${OUT:-bench/results}
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
if [ -d .whl ]; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/specgate-site .whl/*.whl
  export PYTHONPATH="/tmp/specgate-site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
"$PYTHON" - <<'PY' | tee "$OUT/gpu_device.txt"
import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__, "cuda",
      torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
import engine.serving.service  # noqa: F401  (the engine imports with what is here)
PY
# Lossless checks on CUDA: greedy token equality and chi-square exactness.
timeout 150 "$PYTHON" -m pytest -q -p no:cacheprovider tests/engine/test_engine_greedy.py \
  tests/engine/test_engine_sampling.py tests/engine/test_engine_behaviour.py 2>&1 \
  | tee "$OUT/gpu_lossless.txt" || true
# Plain decoding of the demo target's shape: the engine's step beside Hugging Face `generate`
# and its compiled decode step, ms per token (bench.step_profile). The demo's weights do not
# travel; random ones of its shape time the same (bench/demo_shape.py).
SHAPE=/tmp/specgate-demo-shape
if [ -d .whl/demo-shape ]; then
  "$PYTHON" -m bench.demo_shape .whl/demo-shape "$SHAPE"
  timeout 240 "$PYTHON" -m bench.step_profile --target "$SHAPE" --dtype bfloat16 --rounds 3 \
    --compiled --no-profile 2>&1 | tee "$OUT/gpu_step_profile.txt" || true
fi
# Speculative decoding end to end (`specgate bench`) on tiny random models: it shows that
# every method runs on CUDA; their figures mean nothing.
TINY="$OUT/tiny-models"
"$PYTHON" -c "from pathlib import Path; from tests.tiny_models import build_pair; build_pair(Path('$TINY'))"
timeout 120 "$PYTHON" -m bench --target "$TINY/target" --draft "$TINY/draft" --out "$OUT" \
  --repeats 1 --limit 2 2>&1 | tee "$OUT/gpu_bench.txt"
