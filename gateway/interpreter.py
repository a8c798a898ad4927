"""The interpreter's settings while the gateway serves, for the event loop's latency when the
engine decodes in the same process.

- **GIL switch interval.** The engine's worker thread runs Python between its torch calls; a
  thread that wants the GIL waits up to ``sys.getswitchinterval()`` (5 ms by default) for a
  holder that does not release it, and the event loop waits like that after each of its
  system calls (accept, read, write). A 429 or a health probe answered in a few system calls
  then took tens of milliseconds with 128 streams decoding. A shorter interval hands the GIL
  to the loop sooner; the loop sleeps in ``epoll`` (without the GIL) when it has nothing to
  do, so the engine is interrupted only when a request is waiting.
- **Startup objects frozen.** After startup (models, tokenizers, imported modules) the heap
  holds millions of long-lived objects, and every full collection walked them all: a
  single one stopped the process for 2.4 s under load. ``gc.freeze()`` moves them out of the
  collector's reach; what requests allocate is still collected. They are unfrozen at
  shutdown, so that an in-process restart (the tests) can collect the old ones.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def tuned_for_serving(switch_interval_s: float) -> Iterator[None]:
    previous = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval_s)
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        sys.setswitchinterval(previous)
