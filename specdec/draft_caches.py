"""The engine's commit and rollback of draft KV caches around a drafter's ``propose``.

A drafter writes rows into its draft caches; it never decides how long they
are. Before ``propose`` every cache is opened for the step: each scheduled
request is present, holds exactly the tokens the target had cached before the
step (``num_computed_tokens``) and has blocks for the step's rows (``seq_len``).
After ``propose`` every cache is closed: each running request holds exactly its
committed length (speculative positions past it rolled back, blocks released),
finished requests are freed, and KV-1, KV-2 and KV-4 are checked against the
engine's own account.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from specdec.kv_cache import KVCacheManager

if TYPE_CHECKING:
    from specdec.speculator import TargetStep


class DraftCacheError(RuntimeError):
    """A draft cache does not hold what the engine committed to it: some step bypassed the engine."""


def open_cache(name: str, cache: KVCacheManager, step: TargetStep) -> None:
    """Make ``cache`` ready for ``step``: requests added, lengths at the step's start, blocks for its rows."""
    for s in step.scheduled:
        if s.req_id not in cache:
            cache.add_request(s.req_id)
        held = cache.length(s.req_id)
        if held != s.num_computed_tokens:
            raise DraftCacheError(
                f"draft cache {name!r} holds {held} tokens of request {s.req_id!r} but the target step starts at "
                f"{s.num_computed_tokens}: only the engine's close after a step may set a draft cache's length"
            )
    cache.ensure_capacities({s.req_id: s.seq_len for s in step.scheduled})


def close_cache(name: str, cache: KVCacheManager, step: TargetStep, running: Mapping[str, int] | None) -> None:
    """Commit ``step`` to ``cache``: committed lengths exactly, finished requests freed, then KV-1/KV-2/KV-4.

    ``running`` is the engine's account after the step: every request still
    running and its committed length, scheduled this step or not. Without it
    (a replay that only sees the steps) the step's own requests are checked.
    """
    for rid, n in step.committed_lengths.items():
        cache.commit(rid, n)
    for s in step.scheduled:
        if s.req_id not in step.committed_lengths and s.req_id in cache:  # finished in this step
            cache.free(s.req_id)
    committed = step.committed_lengths if running is None else running
    cache.check(committed, live_requests=None if running is None else running.keys(), component=f"draft cache {name!r}")


def release(caches: Iterable[KVCacheManager], req_ids: Iterable[str]) -> None:
    """Free every block of requests that stopped running (preempted); ids a cache does not hold are skipped."""
    ids = list(req_ids)
    for cache in caches:
        for rid in ids:
            if rid in cache:
                cache.free(rid)
