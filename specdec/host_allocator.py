"""Keep freed heap memory in the process, so a step does not fault in again the megabytes the last one released.

Every decoding step allocates the same few-megabyte tensors (a batch's logits,
the sampler's probabilities) and frees them. glibc's malloc serves a block above
its mmap threshold with a fresh mapping, unmapped when freed, and hands the
heap's top back to the kernel once more than its trim threshold lies free
there; both thresholds adapt to the blocks freed so far. Whether a step's
tensors land on memory the process still holds, or on pages the kernel must
map and zero again, therefore depends on what else lives on the heap. Measured
on a 2-core Intel host (SmolLM2-135M in bf16, batch 8, T = 1, drafting nothing):
the sampling of an engine with a drafter attached took a median 7.6-10.1 ms a
step in 5 of 8 (process, backend) measurements and 5.8-6.3 ms in the others,
against 5.6-6.4 ms for plain decoding, the same work on the same tensors; with
both thresholds fixed high, 5.9-6.3 ms for every engine.

``keep_freed_memory`` fixes the thresholds (``mallopt``), the way tcmalloc or
jemalloc keep freed memory for reuse. The cost is resident memory: the process
keeps the peak of its small and mid-sized blocks instead of returning it.
Allocator settings in the environment (glibc's threshold variables such as
``MALLOC_TRIM_THRESHOLD_``, malloc entries in ``GLIBC_TUNABLES``, a preloaded
tcmalloc or jemalloc) are the user's choice and are left alone; so is any C
library other than glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Mapping

TRIM_THRESHOLD = 1 << 30
"""Free memory at the heap's top that glibc may keep before returning it to the kernel (1 GiB)."""
MMAP_THRESHOLD = 32 << 20
"""Blocks from this size up (32 MiB) still get mappings of their own: a large prefill's, not a step's tensors."""
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_PRELOADED_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")
_THRESHOLD_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

_applied: str | None = None


def keep_freed_memory() -> str:
    """Fix glibc's trim and mmap thresholds for this process; what was done, in words (for reports).

    Idempotent: a second call reports the first call's outcome. Allocator
    settings in ``os.environ`` win over this function.
    """
    global _applied
    if _applied is not None:
        return _applied
    reason = _left_alone(os.environ)
    if reason is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1 or libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
            reason = "left as is: glibc refused mallopt"
    _applied = reason or (
        f"glibc malloc keeps freed memory (trim threshold {TRIM_THRESHOLD >> 20} MiB, "
        f"mmap threshold {MMAP_THRESHOLD >> 20} MiB)"
    )
    return _applied


def _left_alone(env: Mapping[str, str]) -> str | None:
    """Why the allocator is not this function's to set, or None when it is."""
    if not sys.platform.startswith("linux") or not _is_glibc():
        return "left as is: not glibc"
    tuned = sorted(k for k in _THRESHOLD_VARIABLES if k in env)
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        tuned.append("GLIBC_TUNABLES")
    if tuned:
        return f"left as is: {', '.join(tuned)} set in the environment"
    preload = env.get("LD_PRELOAD", "")
    named = [name for name in _PRELOADED_ALLOCATORS if name in preload]
    if named:
        return f"left as is: {named[0]} preloaded"
    return None


def _is_glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):
        return False
