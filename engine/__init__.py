"""Specgate's speculative-decoding engine. Never imports ``gateway``."""

import os

# OpenMP threads that spin between parallel regions take the cores from every other thread
# and process, and a decode step has hundreds of short regions: on 2 shared cores (load 6)
# one SmolLM2-135M bfloat16 step took 150-1100 ms with spinning threads (the default) and
# 31-44 ms with passive ones. Only takes effect when set before torch is first imported,
# which importing ``engine`` first guarantees for the ``specgate`` command.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
