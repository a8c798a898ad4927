"""Specgate's speculative-decoding engine. Never imports ``gateway``."""

import os

# OpenMP threads that spin between parallel regions take the cores from every other thread
# and process, and a decode step has hundreds of short regions: on shared cores spinning
# threads (the default) make a step several times slower than passive ones (figures:
# bench/results/2026-12-06-engine-batching-and-kernels.md). Only takes effect when set before
# torch is first imported, which importing ``engine`` first guarantees for ``specgate``.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
