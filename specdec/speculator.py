"""The interface a drafter implements, and the checked boundary the engine gives it.

The engine never knows which backend it runs: it hands a ``Speculator`` the
finished target step (``TargetStep``) and a ``DraftContext`` through which every
draft DP sync and every draft forward must go. The context checks the
descriptor and the attention metadata against the step kind the backend
claims, and the engine checks the returned ``Proposal``, so a backend cannot
skip the contracts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from jaxtyping import Float, Int
from torch import Tensor

from contracts import (
    AttentionMetadata,
    BatchExecutionDescriptor,
    BatchFacts,
    BlockEvidence,
    ContractViolation,
    DPSyncState,
    ForwardOutputFacts,
    Mode,
    ProposalCountFacts,
    ProposalFacts,
    ProposalSourceEvidence,
    StepKind,
    Subject,
    check,
    current_mode,
)
from contracts.enforcement import host_violation
from specdec.attn_metadata import ScheduledRequest
from specdec.dispatch import CaptureConfig
from specdec.dp_group import DPGroup
from specdec.dp_sync import sync_dp
from specdec.draft_caches import close_cache, open_cache, release
from specdec.draft_heads import DraftHeads, run_heads
from specdec.draft_step_kinds import declared_step_kinds, forward_step_kind
from specdec.kv_cache import KVCacheManager
from specdec.kv_storage import PagedKVStorage
from specdec.nn.transformer import ModelOutput, Transformer
from specdec.sampling import SamplingParams
from specdec.step_cost import StepCostModel


@dataclass(frozen=True, eq=False)
class TargetStep:
    """The target forward a drafter builds on, with what verification decided.

    Model rows follow the target batch (``desc.num_tokens`` rows, requests
    laid out as ``scheduled``). For request ``r``: ``last_valid[r]`` is the row
    of its last committed token, ``base_positions[r]`` that token's position
    (P), ``next_token_ids[r]`` the token after it (the sampled bonus, or the
    next prompt token mid-prefill). ``drafting[r]`` says whether the request
    verifies drafts next step. ``committed_tokens[r]`` is the request's token
    history up to and including that last committed token (``base_positions[r]
    + 1`` tokens, prompt then accepted output): a read-only view, not a copy.
    Per-request values are host integers, as a scheduler knows them; tensors
    are the model's.
    """

    desc: BatchExecutionDescriptor
    dp_state: DPSyncState
    scheduled: tuple[ScheduledRequest, ...]
    input_ids: Int[Tensor, " num_tokens"]
    positions: Int[Tensor, " num_tokens"]
    output: ModelOutput
    last_valid: tuple[int, ...]
    base_positions: tuple[int, ...]
    next_token_ids: tuple[int, ...]
    drafting: tuple[bool, ...]
    params: tuple[SamplingParams, ...]
    committed_lengths: Mapping[str, int]
    committed_tokens: tuple[Sequence[int], ...]
    query_token_ids: tuple[tuple[int, ...], ...] = ()
    """Each request's query tokens on the host, as the scheduler built them (``input_ids`` holds the same on
    the device): a drafter that needs token values (prompt lookup) reads them here without a device sync."""
    max_drafts: tuple[int, ...] = ()
    """Each request's draft budget for the next step (the engine's draft-length policy; 0 where ``drafting`` is
    False). The engine verifies at most this many of a request's drafts, so a drafter may stop early to save
    work; ``()`` means K for every drafting request."""

    def draft_budget(self, r: int, num_spec_tokens: int) -> int:
        """Request ``r``'s draft budget: how many of its drafts (at most K) the engine will verify."""
        if not self.drafting[r]:
            return 0
        return min(self.max_drafts[r], num_spec_tokens) if self.max_drafts else num_spec_tokens

    @property
    def num_reqs(self) -> int:
        return len(self.scheduled)

    @property
    def num_tokens(self) -> int:
        return sum(s.query_len for s in self.scheduled)

    @property
    def req_ids(self) -> tuple[str, ...]:
        return tuple(s.req_id for s in self.scheduled)


@dataclass(frozen=True, eq=False)
class Proposal:
    """Drafts for the next verification: one row per request of the target step.

    Rows of requests that do not draft hold ``num_drafts == 0``. ``draft_probs``
    is the proposal handed to the verifier (None: argmax drafts, one-hot).
    ``sampled_from`` is what the drafter's sampling step actually drew each
    draft from, reported where it was drawn (None: the same as
    ``draft_probs``); the verifier compares the two (VER-3), which is how a
    drafter that hands over a different distribution than it sampled from is
    caught. A block drafter adds ``evidence``: its block step and whatever
    capabilities it has (``contracts.evidence``), which BLK-7/BLK-8 check.
    """

    draft_token_ids: Int[Tensor, "num_reqs num_spec_tokens"]
    num_drafts: tuple[int, ...]
    draft_probs: Float[Tensor, "num_reqs num_spec_tokens vocab"] | None = None
    sampled_from: Float[Tensor, "num_reqs num_spec_tokens vocab"] | None = None
    evidence: BlockEvidence | None = None
    source: ProposalSourceEvidence | None = None
    """The logits ``draft_probs`` was made from and each row's sampling settings (VER-9 recomputes it in ``full``)."""


@dataclass(frozen=True, eq=False)
class DraftOutput:
    """A draft forward's result: per-row hidden states (pre-norm, fed back by EAGLE) and logits.

    Both have a row per model row, or, where the forward was given
    ``scored_rows``, a row per scored row in that order: a network may then
    skip its output at the other rows (EAGLE's one layer runs only its K/V
    projections there, which later queries attend).
    """

    hidden_states: Float[Tensor, "rows hidden"]
    logits: Float[Tensor, "scored vocab"]


def rows_to_score(
    hidden: Float[Tensor, "num_tokens hidden"], scored_rows: Sequence[int] | None
) -> Float[Tensor, "scored hidden"]:
    """The rows a draft network returns and puts through its LM head: all of them, or only those the drafter samples."""
    if scored_rows is None:
        return hidden
    return hidden[torch.tensor(scored_rows, dtype=torch.int64, device=hidden.device)]


@runtime_checkable
class DraftModel(Protocol):
    """A network a drafter runs through ``DraftContext.forward``."""

    def __call__(
        self,
        input_ids: Int[Tensor, " num_tokens"],
        positions: Int[Tensor, " num_tokens"],
        meta: AttentionMetadata,
        kv: PagedKVStorage,
        *,
        features: Float[Tensor, "num_tokens feat"] | None,
        dp_group: DPGroup | None,
        num_tokens_across_dp: Sequence[int] | None,
        scored_rows: Sequence[int] | None = None,
    ) -> DraftOutput:
        """``scored_rows``: compute logits for these model rows only, in this order (None: for every row)."""
        ...


@runtime_checkable
class Speculator(Protocol):
    """What a backend author implements."""

    name: str
    num_spec_tokens: int
    draft_step_kinds: frozenset[StepKind]
    aux_layers: tuple[int, ...]

    def bind(self, target: Transformer, ctx: DraftContext) -> None:
        """Allocate draft state (KV caches through ``ctx.new_cache``) for this target."""
        ...

    def propose(self, step: TargetStep, ctx: DraftContext) -> Proposal:
        """Draft up to ``num_spec_tokens`` tokens per drafting request.

        Draft caches arrive opened for ``step`` (see ``specdec.draft_caches``)
        and are committed by the engine afterwards.
        """
        ...

    def finish(self, req_id: str) -> None:
        """Release the non-cache draft state of a finished or preempted request (the engine frees draft blocks)."""
        ...


@runtime_checkable
class ContextTaker(Protocol):
    """A speculator that can take in a step where no request drafts without making a proposal (optional).

    Most decode steps of an adaptive draft length draft nothing, and a
    proposal of nothing still costs a draft sync, an empty proposal and its
    checks: ~0.3 ms of a 36 ms batch-8 step on the benchmark CPU. Without DP
    there is nobody to sync with, so the engine calls ``take_context``
    instead, between the same opening and commit of the draft caches.
    """

    def take_context(self, step: TargetStep, ctx: DraftContext) -> None:
        """Keep the drafter's state in step with ``step``, whose requests all have a draft budget of 0."""
        ...


class DraftContext:
    """The engine's side of the draft boundary: DP syncs, checked forwards, draft KV caches and their commit."""

    def __init__(
        self,
        *,
        backend: str,
        step_kinds: object,
        capture: CaptureConfig,
        dp_group: DPGroup | None,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        max_num_seqs: int,
    ) -> None:
        self.backend = backend
        self.step_kinds = declared_step_kinds(backend, step_kinds)
        """Validated here, before the drafter is bound: a kind the registry does not know is a ``StepKindError``."""
        self.capture = capture
        self.dp_group = dp_group
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.caches: dict[str, KVCacheManager] = {}
        self.step_cost = StepCostModel()
        """The engine's measured decode steps (rows verified, longest draft, seconds) and the cost fitted to them:
        the one record of step times, read by the adaptive draft length and by a cost-aware drafter (DSpark's
        budget). The engine shares it with its draft-length policy, so both see the same samples."""

    def new_cache(self, name: str, *, lookahead_tokens: int = 0) -> KVCacheManager:
        """A draft KV cache with the target's block size, committed and rolled back by the engine.

        It has the target's blocks plus room for ``lookahead_tokens`` speculative
        positions per running request, so drafting never runs out of blocks
        where the target did not.
        """
        if name in self.caches:
            raise ValueError(f"draft cache {name!r} of backend {self.backend!r} exists already")
        extra = self.max_num_seqs * (-(-lookahead_tokens // self.block_size) + 1) if lookahead_tokens else 0
        cache = KVCacheManager(
            self.num_blocks + extra,
            self.block_size,
            name=f"draft cache {name!r} of backend {self.backend!r}",
            hint=f" (the engine opens each request up to its seq_len for the step; positions past it need "
            f"kv.ensure_capacity, within the lookahead_tokens={lookahead_tokens} given to ctx.new_cache)",
        )
        self.caches[name] = cache
        return cache

    def propose(
        self, speculator: Speculator, step: TargetStep, *, running: Mapping[str, int] | None = None
    ) -> Proposal:
        """``speculator.propose`` between opening every draft cache for ``step`` and committing it.

        ``running`` maps every request still running after the step to its
        committed length: the close checks each draft cache against it (KV-2)
        and that no other request holds a draft block (KV-4).
        """
        self._open(step)
        proposal = speculator.propose(step, self)
        self._close(step, running)
        return proposal

    def take_context(
        self, speculator: ContextTaker, step: TargetStep, *, running: Mapping[str, int] | None = None
    ) -> None:
        """``speculator.take_context`` between the same opening and commit of the draft caches as ``propose``.

        Only for a step where no request drafts and there is no DP group: a
        rank that skipped its draft syncs would leave its peers waiting.
        """
        if self.dp_group is not None or any(step.drafting):
            drafting = [rid for rid, d in zip(step.req_ids, step.drafting, strict=True) if d]
            raise ValueError(
                f"take_context is for a step where no request drafts, without DP; this one has "
                f"{'a DP group' if self.dp_group is not None else f'drafting requests {drafting}'}: call propose"
            )
        self._open(step)
        speculator.take_context(step, self)
        self._close(step, running)

    def _open(self, step: TargetStep) -> None:
        for name, cache in self.caches.items():
            open_cache(name, cache, step)

    def _close(self, step: TargetStep, running: Mapping[str, int] | None) -> None:
        for name, cache in self.caches.items():
            close_cache(name, cache, step, running)

    def release(self, req_ids: Iterable[str]) -> None:
        """Free the draft blocks of requests that stopped running outside a step's close (preempted)."""
        release(self.caches.values(), req_ids)

    def sync(
        self,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        *,
        allow_piecewise: bool,
        purpose: str,
    ) -> tuple[DPSyncState, BatchExecutionDescriptor]:
        """A draft DP sync (checked: DP-*, DESC-*); every rank must call it equally often."""
        return sync_dp(
            self.dp_group,
            num_reqs,
            num_tokens,
            uniform_token_count,
            self.capture,
            allow_piecewise=allow_piecewise,
            purpose=purpose,
            component=f"{self.backend} draft sync",
        )

    def check_batch(self, step_kind: StepKind, facts: BatchFacts) -> None:
        """Check ``facts`` against every invariant of ``step_kind``, a draft kind this drafter declared."""
        kind = forward_step_kind(self.backend, step_kind, self.step_kinds)
        if facts.dp_size is None:
            # The engine knows the DP size, so the checks that read it (AR-4, BLK-2) need not trust the drafter for it.
            facts = dataclasses.replace(facts, dp_size=self.dp_group.size if self.dp_group is not None else 1)
        check(Subject.BATCH, facts, step_kind=kind, component="draft forward", backend=self.backend)

    def forward(
        self,
        model: DraftModel,
        step_kind: StepKind,
        facts: BatchFacts,
        kv: PagedKVStorage,
        *,
        num_tokens_across_dp: Sequence[int] | None = None,
        scored_rows: Sequence[int] | None = None,
    ) -> DraftOutput:
        """Check ``facts`` for ``step_kind``, then run ``model`` on exactly those inputs and metadata.

        ``facts.hidden_states`` is the extra per-row input (fused target
        features or the drafter's own previous hidden state) when there is one.
        ``scored_rows`` asks for logits at those model rows only (the rows the
        drafter samples); a step that samples nothing passes ``()`` and pays
        no LM head. It is passed on only when given, so a network that scores
        every row need not know the keyword.
        """
        self.check_batch(step_kind, facts)
        across = num_tokens_across_dp if self.dp_group is not None else None
        rows = None if scored_rows is None else tuple(scored_rows)
        selection = {} if rows is None else {"scored_rows": rows}
        out = model(
            facts.input_ids,
            facts.positions,
            facts.meta,
            kv,
            features=facts.hidden_states,
            dp_group=self.dp_group,
            num_tokens_across_dp=across,
            **selection,
        )
        # Before the drafter samples: the rows it scored (VER-11) and their values (VER-8) are checked here, not
        # by a failure inside sampling.
        check(
            Subject.FORWARD_OUTPUT,
            ForwardOutputFacts(num_tokens=facts.num_tokens, logits=out.logits, scored_rows=rows),
            step_kind=step_kind,
            component="draft forward output",
            backend=self.backend,
        )
        return out

    def forward_heads(
        self,
        heads: DraftHeads,
        desc: BatchExecutionDescriptor,
        num_reqs: int,
        hidden_states: Float[Tensor, "rows hidden"],
        *,
        num_tokens_across_dp: Sequence[int] | None = None,
    ) -> Float[Tensor, "rows heads vocab"]:
        """The KV-less forward (``StepKind.DRAFT_HEADS``): ``heads`` on the target's hidden states, no KV cache.

        ``desc`` comes from the draft step's DP sync (``sync_draft_step``):
        ``hidden_states`` has its ``desc.num_tokens`` rows, the ``num_reqs``
        drafting requests first. Checked like ``forward``: DESC-*, HEAD-1,
        HEAD-2 before the heads run, VER-8 on the real rows' logits after.
        """
        return run_heads(self, heads, desc, num_reqs, hidden_states, num_tokens_across_dp)


class MalformedProposalError(ValueError):
    """A proposal that breaks a PROP invariant while contracts are ``off``.

    The PROP checks read only host integers, so the engine runs them in every
    mode: with contracts on they raise the registry's ``ContractViolation``;
    with contracts ``off`` this error, with the same invariant ID and message,
    because a malformed proposal would otherwise mis-index the next
    verification whatever the mode.
    """

    def __init__(self, violation: ContractViolation) -> None:
        self.invariant_id = violation.invariant_id
        self.violation = violation
        super().__init__(f"{violation} (raised with contracts off: proposal counts are checked in every mode)")


def check_proposal(proposal: Proposal, step: TargetStep, speculator: Speculator, *, component: str = "engine") -> None:
    """The engine's check of what a backend returned: PROP-* in every mode, then AR-9 / BLK-7 / BLK-8 by step kind."""
    counts = proposal_count_facts(proposal, step, speculator.num_spec_tokens)
    if current_mode() is Mode.OFF:
        _guard_counts(counts, component=component, backend=speculator.name)
    else:
        check(Subject.PROPOSAL, counts, step_kind=StepKind.PROPOSAL, component=component, backend=speculator.name)
    kind = StepKind.DRAFT_BLOCK if StepKind.DRAFT_BLOCK in speculator.draft_step_kinds else StepKind.DRAFT_DECODE
    check(
        Subject.PROPOSAL,
        proposal_facts(proposal, step, speculator.num_spec_tokens),
        step_kind=kind,
        component=component,
        backend=speculator.name,
    )


def proposal_count_facts(proposal: Proposal, step: TargetStep, num_spec_tokens: int) -> ProposalCountFacts:
    """The proposal's rows and counts beside the target step's requests (PROP-*)."""
    ids, raw = proposal.draft_token_ids, proposal.num_drafts
    rows = int(ids.shape[0]) if getattr(ids, "ndim", 0) >= 1 else -1
    sequence = isinstance(raw, tuple | list)
    return ProposalCountFacts(
        num_reqs=step.num_reqs,
        num_reqs_padded=step.desc.num_reqs_padded(step.num_reqs),
        num_spec_tokens=num_spec_tokens,
        rows=rows,
        num_drafts=tuple(raw) if sequence else (),
        drafting=step.drafting,
        req_ids=step.req_ids,
        counts_type="tuple" if sequence else type(raw).__name__,
    )


def _guard_counts(counts: ProposalCountFacts, *, component: str, backend: str) -> None:
    """PROP-* with contracts ``off``: the same registered checks, raised as ``MalformedProposalError``."""
    found = host_violation(
        Subject.PROPOSAL, counts, step_kind=StepKind.PROPOSAL, component=f"{component} (backend {backend})"
    )
    if found is not None:
        raise MalformedProposalError(found)


def proposal_facts(proposal: Proposal, step: TargetStep, num_spec_tokens: int) -> ProposalFacts:
    """The target step's counts, or a block drafter's own block step and evidence where it reports them."""
    ev = proposal.evidence
    if ev is None:
        return ProposalFacts(
            desc=step.desc,
            num_reqs=step.num_reqs,
            num_spec_tokens=num_spec_tokens,
            draft_token_ids=proposal.draft_token_ids,
            draft_probs=proposal.draft_probs,
            source=proposal.source,
        )
    return ProposalFacts(
        desc=ev.desc,
        num_reqs=ev.num_drafting,
        num_spec_tokens=num_spec_tokens,
        draft_token_ids=proposal.draft_token_ids,
        sample_indices=ev.sample_indices,
        markov=ev.markov,
        confidence=ev.confidence,
        capacity=ev.capacity,
        # A drafter with capacities hands over its drafting rows' proposal, matching the other per-request evidence.
        draft_probs=ev.capacity.draft_probs if ev.capacity is not None else proposal.draft_probs,
        source=proposal.source,
    )
