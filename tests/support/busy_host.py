"""Another job on every core, for as long as a test needs the host busy."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

SPIN = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end:\n    pass\n"
"""A busy loop that ends by itself, should the test that started it die before stopping it."""


@contextmanager
def busy_host() -> Iterator[None]:
    """One spinning process per core (two per core where fewer than two cores), stopped on exit."""
    cores = os.cpu_count() or 1
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(max(cores, 2))]
    try:
        time.sleep(0.3)  # let them start
        yield
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()
