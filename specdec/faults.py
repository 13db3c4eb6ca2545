"""Named fault points: realistic bugs that tests switch on at run time.

Production code asks ``active(name)`` at the few places where a known bug
pattern would live (e.g. the pre-fix draft attention token count); the set is
empty unless a test or ``specdec mutate`` injects a fault, so the check is one
set lookup. Injecting at run time keeps every mutant tied to the real code path
instead of an edited copy of a source file.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

KNOWN_FAULTS = {
    "ar_decode_attention_rows_from_desc": "AR draft decode metadata built with desc.num_tokens (DP pad included) "
    "as its attention token count: the pre-fix vLLM behaviour behind the DeepSeek-V3.2 DP crash",
    "block_attention_rows_from_desc": "block-drafter (DFlash) metadata built with desc.num_tokens (DP pad included) "
    "as its attention token count outside FULL mode: the follow-up vLLM bug (FlashInfer q.shape[0] != qo_indptr[-1])",
}

_ACTIVE: set[str] = set()


def active(name: str) -> bool:
    return name in _ACTIVE


@contextmanager
def inject(*names: str) -> Iterator[None]:
    """Switch faults on for the duration of a block (test-only)."""
    unknown = [n for n in names if n not in KNOWN_FAULTS]
    if unknown:
        raise ValueError(f"unknown fault(s) {unknown}; known: {sorted(KNOWN_FAULTS)}")
    added = [n for n in names if n not in _ACTIVE]
    _ACTIVE.update(added)
    try:
        yield
    finally:
        _ACTIVE.difference_update(added)
