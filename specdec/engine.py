"""The engine: requests in, tokens out, one checked step at a time.

A step schedules requests, syncs its shape with the DP group, runs the target
over the paged cache, verifies the previous step's drafts (plain decoding is
verification with no drafts), commits accepted tokens and rolls back the KV of
rejected ones, then asks the speculator for the next drafts. The engine owns
the length of every cache, target and draft alike: it opens each draft cache
for the step before the speculator runs and commits it after. Every object
that crosses a boundary is checked in the current contract mode.

A step that raises is undone before the exception reaches the caller
(``specdec.step_undo``). A finished request is released once a step reported
it: the caller holds it from then on (``StepResult.finished``), the engine
does not.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from jaxtyping import Int
from torch import Tensor

from contracts import REJECTED_TOKEN_ID, BatchExecutionDescriptor, DPSyncState, VerifierInput
from specdec.attn_metadata import ScheduledRequest, build_positions, build_target_metadata
from specdec.dispatch import CaptureConfig
from specdec.dp_group import DPGroup
from specdec.dp_sync import sync_dp
from specdec.draft_length import DraftLengthPolicy
from specdec.kv_cache import KVCacheManager
from specdec.metrics import RunMetrics
from specdec.nn.transformer import ModelOutput, Transformer
from specdec.request import FinishReason, Request, RequestStatus
from specdec.sampling import SamplingParams
from specdec.scheduler import ScheduledItem, Scheduler, SchedulerConfig
from specdec.speculator import ContextTaker, DraftContext, Proposal, Speculator, TargetStep, check_proposal
from specdec.step_cost import longest_proposed
from specdec.step_undo import (
    Refusal,
    StepJournal,
    dp_step_failed,
    failure_note,
    undo_failed,
    undo_step,
)
from specdec.verifier import NonFiniteLogitsError, check_verified, verify

DRAFT_LENGTHS = ("fixed", "adaptive")
"""How a speculative engine sets each step's draft length (``EngineConfig.draft_length``)."""


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 512
    block_size: int = 16
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
    draft_length: Literal["fixed", "adaptive"] = "fixed"
    """``fixed``: every drafting request drafts K tokens each step (the drafter may propose fewer).
    ``adaptive``: each step's draft length per request is chosen from measured step costs and acceptance rates,
    down to 0 (``specdec.draft_length``): speculation only where it pays. Lossless either way; only ``fixed``
    keeps seeded sampling reproducible token for token, since ``adaptive`` reads wall-clock timings."""

    def __post_init__(self) -> None:
        if self.draft_length not in DRAFT_LENGTHS:
            raise ValueError(f"draft_length must be 'fixed' or 'adaptive', got {self.draft_length!r}")


@dataclass(frozen=True)
class StepResult:
    """What a step did: the tokens each request gained, and the requests it finished.

    ``finished`` maps each request that finished in this step to its
    ``Request`` (tokens, finish reason, metrics); the engine no longer holds
    them, so this is the last place they are reported.
    """

    all_idle: bool
    emitted: dict[str, list[int]]
    finished: Mapping[str, Request]


@dataclass(frozen=True, eq=False)
class _Batch:
    """A step after the DP sync: the scheduler's items, their layout and the agreed (padded) shape."""

    items: list[ScheduledItem]
    scheduled: tuple[ScheduledRequest, ...]
    state: DPSyncState
    desc: BatchExecutionDescriptor
    query_start: list[int]
    """Row where each request's query starts, then the real token count (``num_reqs + 1`` entries)."""
    num_tokens: int


@dataclass(frozen=True, eq=False)
class _TargetForward:
    input_ids: Int[Tensor, " num_tokens"]
    positions: Int[Tensor, " num_tokens"]
    output: ModelOutput


@dataclass
class _Committed:
    """What verification committed, per request of the batch (``committed``: running requests only)."""

    last_valid: list[int] = field(default_factory=list)
    next_tokens: list[int] = field(default_factory=list)
    drafting: list[bool] = field(default_factory=list)
    max_drafts: list[int] = field(default_factory=list)
    """Each request's draft budget for the next step (0 where it does not draft)."""
    free_requests: frozenset[str] = frozenset()
    """Requests whose next drafts cost the drafter nothing (a prompt lookup's): no proposal is run for them."""
    finished: list[str] = field(default_factory=list)
    committed: dict[str, int] = field(default_factory=dict)


class Engine:
    """One DP rank's engine; with ``speculator=None`` it is plain decoding, the baseline."""

    def __init__(
        self,
        model: Transformer,
        config: EngineConfig | None = None,
        *,
        speculator: Speculator | None = None,
        dp_group: DPGroup | None = None,
        draft_policy: DraftLengthPolicy | None = None,
    ) -> None:
        """``draft_policy``: continue an adaptive policy that earlier engines taught (a server's, kept across
        engine rebuilds); it needs ``draft_length="adaptive"`` and the speculator's K."""
        self.model = model
        self.config = config or EngineConfig()
        self.dp_group = dp_group
        self.kv = KVCacheManager(self.config.num_blocks, self.config.block_size)
        self.kv_storage = model.make_kv_storage(self.config.num_blocks, self.config.block_size)
        headroom = speculator.num_spec_tokens + 1 if speculator is not None else 1
        self.scheduler = Scheduler(self.config.scheduler, self.kv, spec_headroom=headroom)
        self.speculator = speculator
        self.generator = torch.Generator(device="cpu").manual_seed(self.config.seed)
        self.requests: dict[str, Request] = {}
        """The requests not yet finished (waiting or running); a step releases those it reports finished."""
        self.metrics = RunMetrics()
        self._refusal: Refusal | None = None
        """Set when the engine refuses further steps (a failed step it could not undo, or any under DP)."""
        self.draft_ctx: DraftContext | None = None
        self._context_taker = speculator if dp_group is None and isinstance(speculator, ContextTaker) else None
        """Where set, a step where nobody drafts goes to its ``take_context`` instead of an empty proposal."""
        self.draft_policy: DraftLengthPolicy | None = None
        if draft_policy is not None:
            k = speculator.num_spec_tokens if speculator is not None else None
            if self.config.draft_length != "adaptive" or k != draft_policy.num_spec_tokens:
                raise ValueError(
                    f"a draft_policy (K = {draft_policy.num_spec_tokens}) needs draft_length='adaptive' and a "
                    f"speculator of the same K; got draft_length={self.config.draft_length!r}, K = {k}"
                )
            self.draft_policy = draft_policy
        elif speculator is not None and self.config.draft_length == "adaptive":
            self.draft_policy = DraftLengthPolicy(speculator.num_spec_tokens)
        if speculator is not None:
            self.draft_ctx = DraftContext(
                backend=speculator.name,
                step_kinds=speculator.draft_step_kinds,
                capture=self.config.capture,
                dp_group=dp_group,
                block_size=self.config.block_size,
                num_blocks=self.config.num_blocks,
                max_model_len=self.config.scheduler.max_model_len,
                max_num_seqs=self.config.scheduler.max_num_seqs,
            )
            if self.draft_policy is not None:
                self.draft_ctx.step_cost = self.draft_policy.cost  # one record, kept by the policy across engines
            speculator.bind(model, self.draft_ctx)

    # -- requests --------------------------------------------------------------------------------

    def add_request(
        self,
        req_id: str,
        prompt: Sequence[int],
        *,
        params: SamplingParams | None = None,
        max_tokens: int | None = None,
        stop_token_ids: Sequence[int] = (),
        seed: int | None = None,
    ) -> Request:
        """Queue a request; ``max_tokens`` and ``seed`` default to the params', ``stop_token_ids`` adds to theirs."""
        self._refuse_if_failed()
        if req_id in self.requests:
            raise ValueError(f"request id {req_id!r} is already in use by an unfinished request")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {req_id!r}: prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        params = params or SamplingParams(temperature=0.0)
        seed = params.seed if seed is None else seed
        generator = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
        req = Request(
            req_id,
            list(prompt),
            params,
            params.max_tokens if max_tokens is None else max_tokens,
            frozenset(stop_token_ids) | frozenset(params.stop_token_ids),
            generator=generator,
        )
        self.scheduler.add(req)
        self.requests[req_id] = req
        return req

    def abort(self, req_id: str) -> Request:
        """Stop a waiting or running request now and return it with the tokens it has so far.

        Its target KV blocks, draft-cache entries and drafter state are freed
        and its speculation counts join the run's; the engine holds it no more.
        """
        req = self.requests.get(req_id)
        if req is None:
            raise ValueError(
                f"no unfinished request {req_id!r} to abort: it finished (and was reported and released) or was "
                f"never added; the engine holds {_ids(self.requests)}"
            )
        if self._refusal is not None and not self._refusal.consistent:
            raise self._refusal.error()
        self.scheduler.abort(req)
        if self.speculator is not None:
            self.speculator.finish(req_id)
        if self.draft_policy is not None:
            self.draft_policy.forget(req_id)
        if self.draft_ctx is not None:
            self.draft_ctx.release([req_id])
        req.finish_reason = FinishReason.ABORTED
        self.metrics.add_request(req)
        del self.requests[req_id]
        return req

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # -- one step --------------------------------------------------------------------------------

    def step(self) -> StepResult:
        """One step; if it raises, it is undone first (``specdec.step_undo``) and the exception says so in a note."""
        self._refuse_if_failed()
        journal = StepJournal(self.metrics.steps + 1, self.scheduler.running, self.metrics)
        try:
            return self._step(journal)
        except BaseException as exc:
            self._undo(journal, exc)
            raise

    def _step(self, journal: StepJournal) -> StepResult:
        """Schedule, sync, forward, verify, commit, propose, finish: each phase below, in this order."""
        start = time.perf_counter()
        items = self._schedule()
        journal.enter("DP sync")
        batch = self._sync(items)
        if batch is None:
            return StepResult(all_idle=True, emitted={}, finished={})
        journal.enter("target forward")
        target = self._forward(batch)
        journal.enter("verify")
        emitted, accepted = self._verify(items, batch.query_start, target.output.hidden_states, journal)
        journal.enter("commit")
        commit = self._commit(batch, emitted, accepted, journal)
        if self.speculator is not None and self.draft_ctx is not None:
            journal.enter("propose")
            self._propose(batch, target, commit)
        journal.enter("finish")
        return self._finish(batch, commit, emitted, start)

    def _undo(self, journal: StepJournal, exc: BaseException) -> None:
        """Undo the failed step, or refuse further steps where that cannot make the engine consistent."""
        try:
            recomputed = undo_step(
                journal,
                scheduler=self.scheduler,
                requests=self.requests,
                metrics=self.metrics,
                speculator=self.speculator,
                draft_ctx=self.draft_ctx,
            )
        except BaseException as undo_exc:
            self._refusal = undo_failed(journal, exc, undo_exc)
        else:
            if self.dp_group is None:
                exc.add_note(failure_note(journal, len(recomputed)))
                return
            self._refusal = dp_step_failed(journal, exc, self.dp_group.rank)
        exc.add_note(f"specdec: {self._refusal.message}")

    def _refuse_if_failed(self) -> None:
        if self._refusal is not None:
            raise self._refusal.error()

    def _schedule(self) -> list[ScheduledItem]:
        """This step's requests; the ones preempted to make room lose their draft state and draft blocks now."""
        items = self.scheduler.schedule()
        preempted = self.scheduler.drain_preempted()
        for req_id in preempted:
            if self.speculator is not None:
                self.speculator.finish(req_id)
            if self.draft_policy is not None:
                self.draft_policy.forget(req_id)
        if self.draft_ctx is not None:
            self.draft_ctx.release(preempted)
        return items

    def _sync(self, items: list[ScheduledItem]) -> _Batch | None:
        """The step's shape agreed with the DP group; None when every rank is idle."""
        num_tokens = sum(len(it.query_tokens) for it in items)
        lens = {len(it.query_tokens) for it in items}
        uniform = lens.pop() if len(lens) == 1 else None
        state, desc = sync_dp(
            self.dp_group, len(items), num_tokens, uniform, self.config.capture, purpose="target", component="engine"
        )
        if desc.num_tokens == 0:
            return None
        query_start = [0]
        for it in items:
            query_start.append(query_start[-1] + len(it.query_tokens))
        scheduled = tuple(it.as_scheduled() for it in items)
        return _Batch(items, scheduled, state, desc, query_start, num_tokens)

    def _forward(self, batch: _Batch) -> _TargetForward:
        """The target over the paged cache; its cache now holds every scheduled row, drafts included."""
        device, desc = self.model.device, batch.desc
        ids = [t for it in batch.items for t in it.query_tokens]
        input_ids = torch.zeros(desc.num_tokens, dtype=torch.int64, device=device)
        input_ids[: len(ids)] = torch.tensor(ids, dtype=torch.int64)
        positions = build_positions(batch.scheduled, desc, device=device)
        meta = build_target_metadata(
            list(batch.scheduled), desc, self.kv, device=device, input_ids=input_ids, positions=positions
        )
        across = batch.state.num_tokens_across_dp if self.dp_group is not None else None
        aux = self.speculator.aux_layers if self.speculator is not None else ()
        output = self.model(
            input_ids,
            positions,
            meta,
            self.kv_storage,
            aux_layers=aux,
            dp_group=self.dp_group,
            num_tokens_across_dp=across,
        )
        for it in batch.items:
            self.kv.set_length(it.request.req_id, it.request.num_computed + len(it.query_tokens))
        return _TargetForward(input_ids, positions, output)

    def _commit(
        self, batch: _Batch, emitted: dict[int, list[int]], accepted: dict[int, int], journal: StepJournal
    ) -> _Committed:
        """Advance every request by what verification accepted and roll the target cache back to it (KV-2).

        ``emitted[r]`` is cut to what reached the output (a stop token or
        ``max_tokens`` may end it early).
        """
        qsl = batch.query_start
        out = _Committed()
        for r, it in enumerate(batch.items):
            req = it.request
            journal.touch(req)
            samples = it.samples  # read before the request advances: the property depends on its state
            if samples:
                a = accepted[r]
                verified = self.speculator is not None and not req.in_prefill  # before the request advances
                req.num_computed += 1 + a if it.num_drafts or not req.in_prefill else len(it.query_tokens)
                out.last_valid.append(qsl[r] + (a if it.num_drafts else len(it.query_tokens) - 1))
                before = len(req.output)
                self._append(req, emitted[r])
                emitted[r] = req.output[before:]  # what reaches the output: cut at a stop token or max_tokens
                if verified:  # tau counts only tokens that reached the output, not those cut after a stop
                    req.metrics.record(it.num_drafts, a, len(emitted[r]))
                    if self.draft_policy is not None:
                        self.draft_policy.record_verification(req.req_id, it.num_drafts, a)
                        self.draft_policy.record_output(req.req_id, req.history(req.num_tokens))
                out.next_tokens.append(req.tokens[-1])
            else:
                req.num_computed += len(it.query_tokens)
                out.last_valid.append(qsl[r + 1] - 1)
                out.next_tokens.append(req.tokens[req.num_computed])
            req.clear_drafts()
            if req.finish_reason is not None:
                out.finished.append(req.req_id)
                out.drafting.append(False)
            else:
                self.kv.truncate(req.req_id, req.num_computed)
                out.drafting.append(samples)
                out.committed[req.req_id] = req.num_computed
        self.kv.check(committed_lengths=out.committed)
        self._budget_drafts(batch, out)
        return out

    def _budget_drafts(self, batch: _Batch, out: _Committed) -> None:
        """Each drafting request's draft length for the next step: K, or the adaptive policy's choice (0 = none)."""
        k = self.speculator.num_spec_tokens if self.speculator is not None else 0
        if self.draft_policy is None:
            out.max_drafts = [k if d else 0 for d in out.drafting]
            return
        drafters = [it.request for it, d in zip(batch.items, out.drafting, strict=True) if d]
        limit = self.config.scheduler.max_model_len
        remaining = {r.req_id: min(r.max_tokens - len(r.output), limit - r.num_tokens) for r in drafters}
        ids = list(remaining)
        # With nobody waiting for a slot the batch only drains: its last request sets the step count.
        draining = not self.scheduler.waiting
        # A speculator that drafts from more than one source (prompt lookup, then a model) says which each
        # request's next drafts come from, so the policy weighs them by that source's acceptance.
        named = getattr(self.speculator, "draft_sources", None)
        sources = named({r.req_id: r.tokens for r in drafters}) if named is not None and ids else None
        limits = getattr(self.speculator, "draft_limits", None)  # a lookup may draft past the model behind it
        # Drafts that cost nothing (a lookup's): checked against the output of requests left at 0 drafts.
        free = getattr(self.speculator, "free_drafts", None) if sources is not None else None
        free_drafts = free() if free is not None else None
        lengths = (
            self.draft_policy.choose(
                ids,
                base_rows=len(ids),
                remaining=remaining,
                draining=draining,
                sources=sources,
                limits=limits,
                free_drafts=free_drafts,
            )
            if ids
            else {}
        )
        if ids:  # one decision per step that had one to make: the run's trace, undone with the step if it fails
            self.metrics.decisions += self.draft_policy.last_decision
        out.free_requests = frozenset(free_drafts or ())
        out.max_drafts = [
            lengths.get(it.request.req_id, 0) if d else 0 for it, d in zip(batch.items, out.drafting, strict=True)
        ]
        out.drafting = [n > 0 for n in out.max_drafts]

    def _propose(self, batch: _Batch, target: _TargetForward, commit: _Committed) -> None:
        """Next step's drafts: draft caches opened for this step, the speculator's proposal, the caches committed."""
        assert self.speculator is not None and self.draft_ctx is not None
        step = self._target_step(batch, target, commit)
        running = {r.req_id: r.num_computed for r in self.scheduler.running if r.finish_reason is None}
        if self._context_taker is not None and not any(commit.drafting):
            # Nobody drafts and nobody waits for this rank's draft syncs: the drafter only takes in the context.
            self.draft_ctx.take_context(self._context_taker, step, running=running)
            return
        proposal = self.draft_ctx.propose(self.speculator, step, running=running)
        check_proposal(proposal, step, self.speculator)
        self._store_drafts(batch.items, proposal, commit.max_drafts)

    def _target_step(self, batch: _Batch, target: _TargetForward, commit: _Committed) -> TargetStep:
        qsl = batch.query_start
        host_positions = [
            s.num_computed_tokens + (lv - q) for s, lv, q in zip(batch.scheduled, commit.last_valid, qsl, strict=False)
        ]
        requests = [it.request for it in batch.items]
        return TargetStep(
            desc=batch.desc,
            dp_state=batch.state,
            scheduled=batch.scheduled,
            input_ids=target.input_ids,
            positions=target.positions,
            output=target.output,
            last_valid=tuple(commit.last_valid),
            base_positions=tuple(host_positions),
            next_token_ids=tuple(commit.next_tokens),
            drafting=tuple(commit.drafting),
            max_drafts=tuple(commit.max_drafts),
            params=tuple(req.params for req in requests),
            committed_lengths=commit.committed,
            # A finished request's count may run past a stop token it was cut at: its history is all its tokens.
            committed_tokens=tuple(req.history(min(req.num_computed, req.num_tokens)) for req in requests),
            query_token_ids=tuple(tuple(it.query_tokens) for it in batch.items),
        )

    def _finish(self, batch: _Batch, commit: _Committed, emitted: dict[int, list[int]], start: float) -> StepResult:
        """Retire finished requests, count the step, and release the finished requests to the caller."""
        finished = {req_id: self.requests[req_id] for req_id in commit.finished}
        for req_id, req in finished.items():
            self.scheduler.finish(req)
            if self.speculator is not None:
                self.speculator.finish(req_id)
            if self.draft_policy is not None:
                self.draft_policy.forget(req_id)
        # Nothing below calls out of the engine: only an interrupt can land here, and it is undone like any failure.
        for req in finished.values():
            self.metrics.add_request(req)
        self.metrics.steps += 1
        self.metrics.tokens_scheduled += batch.num_tokens
        self.metrics.tokens_emitted += sum(len(e) for e in emitted.values())
        elapsed = time.perf_counter() - start
        self.metrics.wall_s += elapsed
        for req_id in finished:
            del self.requests[req_id]
        if self.draft_ctx is not None:
            # Prefill steps and an idle DP rank's dummy step (no rows of its own) say nothing of a decode step's cost.
            prefill = any(len(it.query_tokens) != 1 + it.num_drafts for it in batch.items)
            if not prefill and batch.num_tokens:
                # The proposal's cost follows the drafts the drafter made; a lookup's drafts add only verify rows.
                budgets = {it.request.req_id: n for it, n in zip(batch.items, commit.max_drafts, strict=True)}
                longest = longest_proposed(budgets, commit.free_requests)
                self.draft_ctx.step_cost.observe(batch.num_tokens, longest, elapsed)
        by_id = {batch.items[r].request.req_id: e for r, e in emitted.items()}
        return StepResult(all_idle=False, emitted=by_id, finished=finished)

    def _verify(
        self, items: list[ScheduledItem], qsl: list[int], hidden: torch.Tensor, journal: StepJournal
    ) -> tuple[dict[int, list[int]], dict[int, int]]:
        """Verify drafts (or sample plainly) for every request whose query ends in a sample."""
        sampling = [r for r, it in enumerate(items) if it.samples]
        if not sampling:
            return {}, {}
        k = self.speculator.num_spec_tokens if self.speculator is not None else 0
        rows: list[int] = []
        counts: list[int] = []
        for r in sampling:
            d = items[r].num_drafts
            end = qsl[r + 1]
            rows.extend(range(end - d - 1, end))
            counts.append(d)
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
        draft_ids = torch.full((len(sampling), k), REJECTED_TOKEN_ID, dtype=torch.int64, device=hidden.device)
        use_probs = any(items[r].request.draft_probs is not None for r in sampling)
        probs = torch.zeros((len(sampling), k, logits.shape[-1]), device=hidden.device) if use_probs and k else None
        # What each draft was drawn from, as its drafter reported it; VER-3 compares it with ``probs``.
        drawn = None if probs is None else torch.zeros_like(probs)
        for i, r in enumerate(sampling):
            req = items[r].request
            d = items[r].num_drafts
            if d:
                draft_ids[i, :d] = torch.tensor(req.drafts[:d], dtype=torch.int64)
                if probs is not None and drawn is not None:
                    if req.draft_probs is not None:
                        probs[i, :d] = req.draft_probs[:d].to(probs.dtype)
                        source = req.draft_probs if req.draft_sampled_from is None else req.draft_sampled_from
                        drawn[i, :d] = source[:d].to(drawn.dtype)
                    else:  # an argmax draft in a batch of sampled ones: its proposal is one-hot
                        probs[i, torch.arange(d), draft_ids[i, :d]] = 1.0
                        drawn[i, torch.arange(d), draft_ids[i, :d]] = 1.0
        params = [items[r].request.params for r in sampling]
        generator = self._generator_for(items, sampling)
        journal.save_generator(generator)
        inp = VerifierInput(draft_ids, torch.tensor(counts, dtype=torch.int64), logits, probs)
        out = verify(
            inp,
            params,
            num_spec_tokens=k,
            num_draft_tokens=counts,
            generator=generator,
            sampled_from=drawn,
            component="engine verifier",
        )
        tokens = out.output_token_ids.tolist()
        num_accepted = out.num_accepted.tolist()
        # On the host copy, in every mode, before an id reaches the output, the drafter or the next step's embedding.
        check_verified(inp, out, tokens, num_accepted, num_spec_tokens=k, num_draft_tokens=counts, component="engine")
        emitted: dict[int, list[int]] = {}
        accepted: dict[int, int] = {}
        for i, r in enumerate(sampling):
            a = num_accepted[i]
            if tokens[i][a] == REJECTED_TOKEN_ID:  # the verifier could draw no token: non-finite target logits
                raise NonFiniteLogitsError(items[r].request.req_id)
            accepted[r] = a
            emitted[r] = tokens[i][: a + 1]
        return emitted, accepted

    def _generator_for(self, items: list[ScheduledItem], sampling: list[int]) -> torch.Generator:
        """A single-request batch with its own seed uses it; otherwise the engine's stream."""
        if len(sampling) == 1 and items[sampling[0]].request.generator is not None:
            gen = items[sampling[0]].request.generator
            assert gen is not None
            return gen
        return self.generator

    def _append(self, req: Request, tokens: list[int]) -> None:
        """Append emitted tokens, stopping at a stop token, max_tokens or the model length."""
        limit = self.config.scheduler.max_model_len
        for t in tokens:
            req.output.append(t)
            if t in req.stop_token_ids:
                req.finish_reason = FinishReason.STOP_TOKEN
            elif len(req.output) >= req.max_tokens:
                req.finish_reason = FinishReason.MAX_TOKENS
            elif req.num_tokens >= limit:
                req.finish_reason = FinishReason.MAX_MODEL_LEN
            if req.finish_reason is not None:
                req.status = RequestStatus.FINISHED
                return

    def _store_drafts(self, items: list[ScheduledItem], proposal: Proposal, budget: list[int]) -> None:
        """Keep each request's drafts, cut to its budget: verifying a prefix of a draft sequence is still lossless."""
        ids = proposal.draft_token_ids.tolist()
        for r, it in enumerate(items):
            n = min(proposal.num_drafts[r], budget[r])
            if n and it.request.finish_reason is None:
                it.request.drafts = ids[r][:n]
                it.request.draft_probs = None if proposal.draft_probs is None else proposal.draft_probs[r, :n]
                drawn = proposal.sampled_from
                it.request.draft_sampled_from = None if drawn is None else drawn[r, :n]

    # -- driving ---------------------------------------------------------------------------------

    def run(self, max_steps: int = 100_000) -> dict[str, list[int]]:
        """Step until every request (on every DP rank) is done; returns their outputs by id, in the order added."""
        order = list(self.requests)
        outputs: dict[str, list[int]] = {}
        for _ in range(max_steps):
            result = self.step()
            outputs.update((rid, list(req.output)) for rid, req in result.finished.items())
            if result.all_idle and not self.has_work:
                break
        else:
            raise RuntimeError(f"engine did not finish within {max_steps} steps")
        return {rid: outputs[rid] for rid in order if rid in outputs}


def _ids(requests: Mapping[str, Request], limit: int = 10) -> str:
    """Request ids for a message, cut after ``limit`` with a count."""
    ids = sorted(requests)
    shown = ", ".join(repr(r) for r in ids[:limit])
    return f"[{shown}, ... ({len(ids)} in all)]" if len(ids) > limit else f"[{shown}]"
