"""Wall-clock timings of a check script's sections, printed to stderr (the scripts' stdout carries their JSON
result): ``[timing] name: 12.3 s``. Shown by the calling test when the script fails, and by running the
script by hand (``python tests/sharded_decode_check.py > /dev/null``) to see where its time goes."""

from __future__ import annotations

import contextlib
import sys
import time

_START = time.perf_counter()


@contextlib.contextmanager
def section(name: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        now = time.perf_counter()
        print(f"[timing] {name}: {now - t0:.1f} s (at {now - _START:.1f} s)", file=sys.stderr, flush=True)
