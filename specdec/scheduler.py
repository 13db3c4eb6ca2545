"""Continuous batching: which requests run this step, how many tokens each, and KV for them.

Running requests go first (a decoding request verifies ``[last token] +
drafts``; drafts that do not fit the token budget or the model length are
dropped, never the last token), then waiting requests are admitted as prefill
chunks. When KV blocks run out the newest running request is preempted: its
blocks are freed and it is recomputed later, so nothing is overwritten.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from specdec.attn_metadata import ScheduledRequest
from specdec.kv_cache import KVCacheManager, OutOfBlocksError, blocks_for
from specdec.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 64
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError(f"scheduler limits must be >= 1, got {self}")


@dataclass(frozen=True)
class ScheduledItem:
    """One request's share of a step: its query tokens and whether a token is sampled after it."""

    request: Request
    query_tokens: tuple[int, ...]
    num_drafts: int

    @property
    def samples(self) -> bool:
        """A step samples for a request whose query reaches its last known token."""
        return self.request.num_computed + len(self.query_tokens) == self.request.num_tokens + self.num_drafts

    def as_scheduled(self) -> ScheduledRequest:
        return ScheduledRequest(self.request.req_id, self.request.num_computed, len(self.query_tokens))


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, *, spec_headroom: int = 0) -> None:
        self.config = config
        self.kv = kv
        self.spec_headroom = spec_headroom
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._preempted: list[str] = []

    def drain_preempted(self) -> list[str]:
        """Requests preempted since the last call, so the engine can free their draft caches and drafter state too."""
        out, self._preempted = self._preempted, []
        return out

    def add(self, request: Request) -> None:
        longest = min(len(request.prompt) + request.max_tokens + self.spec_headroom, self.config.max_model_len)
        if blocks_for(longest, self.kv.block_size) > self.kv.num_blocks:
            raise ValueError(
                f"request {request.req_id!r} may need {longest} tokens of KV "
                f"({blocks_for(longest, self.kv.block_size)} blocks) but the cache has {self.kv.num_blocks} blocks"
            )
        if len(request.prompt) >= self.config.max_model_len:
            raise ValueError(
                f"request {request.req_id!r}: prompt of {len(request.prompt)} tokens leaves no room under "
                f"max_model_len={self.config.max_model_len}"
            )
        self.kv.add_request(request.req_id)
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledItem]:
        budget = self.config.max_num_batched_tokens
        items: list[ScheduledItem] = []
        for req in list(self.running):
            if req not in self.running:  # preempted while making room for an earlier one
                continue
            if budget <= 0:
                break
            item = self._query(req, budget)
            if not self._reserve(item, items):
                continue
            items.append(item)
            budget -= len(item.query_tokens)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            item = self._query(req, budget)
            try:
                self.kv.ensure_capacity(req.req_id, req.num_computed + len(item.query_tokens))
            except OutOfBlocksError:
                break  # waiting requests never preempt running ones
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            items.append(item)
            budget -= len(item.query_tokens)
        return items

    def _query(self, req: Request, budget: int) -> ScheduledItem:
        tokens = req.tokens
        if req.in_prefill:
            end = min(len(tokens), req.num_computed + budget)
            return ScheduledItem(req, tuple(tokens[req.num_computed : end]), 0)
        room = min(budget - 1, self.config.max_model_len - req.num_tokens)
        drafts = req.drafts[: max(0, room)]
        if len(drafts) < len(req.drafts):
            req.drafts = drafts
            req.draft_probs = None if req.draft_probs is None else req.draft_probs[: len(drafts)]
            drawn = req.draft_sampled_from
            req.draft_sampled_from = None if drawn is None else drawn[: len(drafts)]
        return ScheduledItem(req, (tokens[-1], *drafts), len(drafts))

    def _reserve(self, item: ScheduledItem, scheduled: list[ScheduledItem]) -> bool:
        """Make KV room for ``item``, preempting the newest other running requests if needed."""
        req = item.request
        need = req.num_computed + len(item.query_tokens)
        while True:
            try:
                self.kv.ensure_capacity(req.req_id, need)
                return True
            except OutOfBlocksError:
                victims = [r for r in self.running if r is not req and all(s.request is not r for s in scheduled)]
                victim = victims[-1] if victims else req
                self.preempt(victim)
                if victim is req:
                    return False

    def preempt(self, req: Request) -> None:
        self.kv.preempt(req.req_id)
        req.num_computed = 0
        req.clear_drafts()
        req.status = RequestStatus.WAITING
        req.metrics.preemptions += 1
        self._preempted.append(req.req_id)
        self.running.remove(req)
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        req.status = RequestStatus.FINISHED
        req.clear_drafts()
        if req in self.running:
            self.running.remove(req)
        self.kv.free(req.req_id)

    def abort(self, req: Request) -> None:
        """Take ``req`` out of whichever queue holds it and free its KV blocks (it may be waiting or running)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        else:
            raise ValueError(f"request {req.req_id!r} is neither waiting nor running, so it cannot be aborted")
        req.status = RequestStatus.FINISHED
        req.clear_drafts()
        self.kv.free(req.req_id)

    def requeue(self, requests: Sequence[Request]) -> None:
        """Put ``requests`` first in the waiting queue, in this order, holding no KV: they are recomputed from their tokens.

        What a preemption does to one request, without counting one: the
        engine requeues every request a failed step had running. A request the
        step already finished and freed is added to the cache again.
        """
        chosen = {id(r) for r in requests}
        ids = {r.req_id for r in requests}
        for req in requests:
            if req.req_id in self.kv:
                self.kv.preempt(req.req_id)
            else:
                self.kv.add_request(req.req_id)
            req.num_computed = 0
            req.clear_drafts()
            req.status = RequestStatus.WAITING
        rest = [r for r in self.waiting if id(r) not in chosen]
        self.running[:] = [r for r in self.running if id(r) not in chosen]
        self.waiting.clear()
        self.waiting.extend([*requests, *rest])
        self._preempted = [rid for rid in self._preempted if rid not in ids]
