"""The DFlash backend: inject the target step's committed context, then draft K tokens in one block forward.

Per drafting request the block ``[bonus, MASK x K]`` sits at ``P + 1 .. P + 1 + K``
(``P`` = last committed position) and block position ``j >= 1`` proposes the
token at its own position, so ``q = K + 1``. The draft cache holds the injected
context K/V of exactly the committed tokens whenever a block forward reads it:
a step where no rank drafts holds its rows, and the next block forward writes
them first (``backends.context_backlog``). Block K/V are never cached (the
engine commits the draft cache to the committed lengths after each proposal).
Every rank syncs once per proposal, drafting or not; without DP a step where
nobody drafts makes no proposal (``take_context``), so it holds its rows unsynced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from backends.common import DraftCacheOwner
from backends.context_backlog import MAX_HELD_ROWS, ContextBacklog, ContextRows, committed_slots, rows_with_slots
from backends.dflash.metadata import build_block_metadata
from backends.dflash.network import MASK_TOKEN_ID, DFlashNetwork
from backends.draw import argmax_proposal, draw_drafts, proposal_source
from contracts import (
    REJECTED_TOKEN_ID,
    AttentionMetadata,
    BatchExecutionDescriptor,
    BatchFacts,
    BlockEvidence,
    Mode,
    StepKind,
    current_mode,
)
from specdec.dp_group import DPGroup
from specdec.dp_sync import pad_model_rows_for_dp
from specdec.kv_storage import PagedKVStorage
from specdec.nn.transformer import Transformer
from specdec.sampling import SamplingParams
from specdec.speculator import DraftContext, DraftOutput, Proposal, TargetStep


@dataclass(frozen=True, eq=False)
class ContextInjection:
    """The target step's rows to inject: committed rows have a draft slot, the rest ``PAD_SLOT_ID``."""

    aux: tuple[Float[Tensor, "ctx hidden"], ...]
    positions: Int[Tensor, " ctx"]
    slot_mapping: Int[Tensor, " ctx"]
    committed: Bool[Tensor, " ctx"]
    host_slots: tuple[int, ...]
    """``slot_mapping`` on the host, as planned."""

    def committed_rows(self) -> ContextRows:
        """The rows with a slot, to write now or hold (``ContextBacklog``)."""
        return rows_with_slots(self.aux, self.positions, self.host_slots)


@dataclass(frozen=True, eq=False)
class BlockStep:
    """One checked draft forward: the context write, then the block pass (a ``DraftModel``).

    Doing the injection inside the forward means the contracts (BLK-6 on the
    context slots) are checked before anything is written.
    """

    network: DFlashNetwork
    context: ContextInjection
    context_lens: tuple[int, ...]
    """Committed tokens per drafting request (host data: the block attends to them without a device read)."""
    write: ContextRows | None
    """What the forward writes first: the context rows held from earlier steps, then this step's committed rows."""

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
        if self.write is not None:
            w = self.write
            self.network.inject_context(w.features, w.positions, w.slot_mapping(), kv)
        out: DraftOutput = self.network(
            input_ids,
            positions,
            meta,
            kv,
            features=features,
            dp_group=dp_group,
            num_tokens_across_dp=num_tokens_across_dp,
            context_lens=self.context_lens,
            scored_rows=scored_rows,
        )
        return out


def no_block_ran(desc: BatchExecutionDescriptor, tokens: Int[Tensor, "num_reqs k"]) -> BlockEvidence:
    """The evidence of a step where no rank drafted: the block sync's descriptor and no sampled rows."""
    return BlockEvidence(desc=desc, num_drafting=0, sample_indices=tokens.new_zeros(0))


class DFlashSpeculator(DraftCacheOwner):
    """K drafts per request from one bidirectional block forward over injected target context."""

    draft_step_kinds = frozenset({StepKind.DRAFT_BLOCK})

    def __init__(
        self,
        network: DFlashNetwork,
        *,
        num_spec_tokens: int,
        aux_layers: tuple[int, ...],
        name: str = "dflash",
        seed: int = 0,
        argmax_drafts: bool = False,
        max_held_rows: int = MAX_HELD_ROWS,
    ) -> None:
        if not 1 <= num_spec_tokens <= 16:
            raise ValueError(f"num_spec_tokens (K) must be in 1..16, got {num_spec_tokens}")
        if len(aux_layers) != network.num_aux:
            raise ValueError(f"the DFlash network fuses {network.num_aux} target layers; aux_layers={aux_layers}")
        self.network = network
        self.name = name
        self.num_spec_tokens = num_spec_tokens
        self.aux_layers = aux_layers
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.argmax_drafts = argmax_drafts
        """Deterministic drafts even for sampled requests: one-hot proposals (``draft_probs`` None)."""
        self.max_held_rows = max_held_rows
        """Context rows held while no rank drafts (``ContextBacklog``); 1 writes every step's context at once."""
        self.backlog = ContextBacklog(max_held_rows)

    @property
    def query_width(self) -> int:
        return self.num_spec_tokens + 1

    def bind(self, target: Transformer, ctx: DraftContext) -> None:
        del target
        if ctx.max_model_len < self.query_width:
            # A block at the model's end is clamped to max_model_len keys; fewer keys than queries is no valid attention.
            raise ValueError(
                f"{self.name} drafts blocks of {self.query_width} queries, which max_model_len={ctx.max_model_len} "
                f"cannot hold; use max_model_len >= {self.query_width} or fewer num_spec_tokens"
            )
        self._kv = ctx.new_cache("dflash")  # context only: block K/V are never cached, so no lookahead
        self._storage = self.network.make_kv_storage(self._kv.num_blocks, ctx.block_size)
        self.network.prepare_packed()
        self.backlog = ContextBacklog(self.max_held_rows)

    # -- one proposal ----------------------------------------------------------------------------

    block_layout = "bonus_first"

    def propose(self, step: TargetStep, ctx: DraftContext) -> Proposal:
        k = self.num_spec_tokens
        drafting, out, desc, tokens = self._block_forward(step, ctx)
        if out is None:
            return Proposal(
                draft_token_ids=tokens, num_drafts=(0,) * step.num_reqs, evidence=no_block_ran(desc, tokens)
            )
        m, device = len(drafting), tokens.device
        sample_rows = torch.tensor(self._sampled_rows(m), dtype=torch.int64, device=device)
        params = [step.params[r] for r in drafting]
        vocab = out.logits.shape[-1]
        drawn, drawn_probs = self._draw(out.logits, [p for p in params for _ in range(k)])  # the sampled rows only
        tokens[drafting] = drawn.view(m, k)
        probs = source = None
        num_drafts = tuple(step.draft_budget(r, k) for r in range(step.num_reqs))
        if drawn_probs is not None and not argmax_proposal(params, argmax_drafts=self.argmax_drafts):
            probs = torch.zeros((step.num_reqs, k, vocab), device=device)
            probs[drafting] = drawn_probs.view(m, k, vocab)
            if current_mode() is Mode.FULL:  # the logits behind each slot, for VER-9 to recompute the proposal
                logits = torch.zeros_like(probs)
                logits[drafting] = out.logits.float().view(m, k, vocab)
                source = proposal_source(logits, num_drafts, step.params)
        return Proposal(
            draft_token_ids=tokens,
            num_drafts=num_drafts,
            draft_probs=probs,
            sampled_from=probs,
            evidence=BlockEvidence(desc=desc, num_drafting=m, sample_indices=sample_rows),
            source=source,
        )

    def _block_forward(
        self, step: TargetStep, ctx: DraftContext
    ) -> tuple[list[int], DraftOutput | None, BatchExecutionDescriptor, Int[Tensor, "num_reqs k"]]:
        """The block sync and the checked block forward, shared by the DFlash and DSpark layouts.

        Returns the drafting request rows, the block output (None when no rank
        drafts: every rank then skips alike, and the context is held for the
        next block forward; its logits and hidden states are those of
        ``_sampled_rows`` alone, in that order), the block step's descriptor and
        a token buffer of ``REJECTED_TOKEN_ID``.
        """
        k, q = self.num_spec_tokens, self.query_width
        context = self._plan_context(step)
        drafting = [r for r in range(step.num_reqs) if step.drafting[r]]
        m = len(drafting)
        state, desc = ctx.sync(m, m * q, q if m else None, allow_piecewise=False, purpose=f"{self.name}_block")
        device = step.input_ids.device
        tokens = torch.full((step.num_reqs, k), REJECTED_TOKEN_ID, dtype=torch.int64, device=device)
        if desc.num_tokens == 0:
            self._hold(context, ctx, desc)
            return drafting, None, desc, tokens

        desc, across = pad_model_rows_for_dp(desc, state, m, q)
        req_ids = [step.scheduled[r].req_id for r in drafting]
        base = [step.base_positions[r] for r in drafting]
        wrong = [(rid, p) for rid, p in zip(req_ids, base, strict=True) if step.committed_lengths.get(rid) != p + 1]
        if wrong:
            raise RuntimeError(f"drafting requests whose last committed position is not committed length - 1: {wrong}")
        meta = build_block_metadata(desc, req_ids, base, q, self.kv, ctx.max_model_len, device)
        inputs = self._block_inputs(step, drafting, desc.num_tokens, ctx.max_model_len)
        facts = self._block_facts(desc, meta, base, context, ctx.max_model_len, inputs)
        out = ctx.forward(
            BlockStep(self.network, context, tuple(p + 1 for p in base), self.backlog.take(context.committed_rows())),
            StepKind.DRAFT_BLOCK,
            facts,
            self.storage,
            num_tokens_across_dp=across,
            scored_rows=self._sampled_rows(m),
        )
        return drafting, out, desc, tokens

    def _sampled_rows(self, num_drafting: int) -> list[int]:
        """The block rows whose logits become drafts, request-major: all but each block's bonus row.

        Only these go through the LM head (``scored_rows``): not the bonus rows, nor
        a DP pad's, whose vocabulary-wide logits rows nobody reads.
        """
        q = self.query_width
        return [i * q + j for i in range(num_drafting) for j in range(1, q)]

    def take_context(self, step: TargetStep, ctx: DraftContext) -> None:
        """A step where no request drafts, without DP (``ContextTaker``): its context held, no block sync."""
        self._hold(self._plan_context(step), ctx)

    def _hold(self, context: ContextInjection, ctx: DraftContext, desc: BatchExecutionDescriptor | None = None) -> None:
        """No block forward, but the context write is checked (BLK-6) all the same. Nothing reads the cache before
        the next block forward, so the write waits for it (or for a full backlog).

        ``desc``: the block sync's, where it ran; the check alone needs one otherwise (synced only to check).
        """
        if current_mode() is not Mode.OFF:
            if desc is None:
                _, desc = ctx.sync(0, 0, None, allow_piecewise=False, purpose=f"{self.name}_block")
            device = context.slot_mapping.device
            empty = build_block_metadata(desc, [], [], self.query_width, self.kv, ctx.max_model_len, device)
            ctx.check_batch(StepKind.DRAFT_BLOCK, self._block_facts(desc, empty, [], context, ctx.max_model_len))
        self._write(self.backlog.hold(context.committed_rows()))

    def _write(self, rows: ContextRows | None) -> None:
        if rows is not None:
            self.network.inject_context(rows.features, rows.positions, rows.slot_mapping(), self.storage)

    def _block_facts(
        self,
        desc: BatchExecutionDescriptor,
        meta: AttentionMetadata,
        base: list[int],
        context: ContextInjection,
        max_model_len: int,
        inputs: tuple[Int[Tensor, " rows"], Int[Tensor, " rows"]] | None = None,
    ) -> BatchFacts:
        """What the block step's contracts see; without ``inputs`` (no rank drafts) ids and positions are zeros."""
        device = context.slot_mapping.device
        if inputs is None:
            zeros = torch.zeros(desc.num_tokens, dtype=torch.int64, device=device)
            inputs = (zeros, zeros)
        return BatchFacts(
            desc=desc,
            num_reqs=len(base),
            num_tokens=len(base) * self.query_width,
            meta=meta,
            input_ids=inputs[0],
            positions=inputs[1],
            block_size=self.kv.block_size,
            max_model_len=max_model_len,
            base_positions=torch.tensor(base, dtype=torch.int64, device=device),
            num_spec_tokens=self.num_spec_tokens,
            block_layout=self.block_layout,
            context_slot_mapping=context.slot_mapping,
            context_committed=context.committed,
        )

    def _plan_context(self, step: TargetStep) -> ContextInjection:
        """Draft slots for the target rows that were committed; rejected, finished and padded rows get none.

        The engine opened the cache with blocks for every row of the step and
        commits exactly the committed lengths after the proposal.
        """
        # Which target rows were committed follows from the scheduler's committed lengths alone, so BLK-6
        # compares the slots written against an independent account, not against themselves.
        committed = [False] * step.desc.num_tokens
        row = 0
        for s in step.scheduled:
            end = step.committed_lengths.get(s.req_id, 0)
            for i, p in enumerate(range(s.num_computed_tokens, s.seq_len)):
                committed[row + i] = p < end
            row += s.query_len
        device = step.input_ids.device
        slots = self._context_slots(step)
        return ContextInjection(
            aux=step.output.aux_hidden_states,
            positions=step.positions,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            committed=torch.tensor(committed, dtype=torch.bool, device=device),
            host_slots=tuple(slots),
        )

    def _context_slots(self, step: TargetStep) -> list[int]:
        """Draft slots of the committed target rows; rejected drafts, finished and padded rows get PAD_SLOT_ID."""
        return committed_slots(step, self.kv)

    def _block_inputs(
        self, step: TargetStep, drafting: list[int], rows: int, max_model_len: int
    ) -> tuple[Int[Tensor, " rows"], Int[Tensor, " rows"]]:
        """Ids ``[bonus, MASK x K]`` and positions ``min(P + 1 + j, max_model_len - 1)`` per request; 0 past them."""
        q, device = self.query_width, step.input_ids.device
        ids = torch.zeros(rows, dtype=torch.int64, device=device)
        positions = torch.zeros(rows, dtype=torch.int64, device=device)
        if drafting:
            block_ids = [t for r in drafting for t in [step.next_token_ids[r]] + [MASK_TOKEN_ID] * (q - 1)]
            block_pos = [min(step.base_positions[r] + 1 + j, max_model_len - 1) for r in drafting for j in range(q)]
            ids[: len(block_ids)] = torch.tensor(block_ids, dtype=torch.int64)
            positions[: len(block_pos)] = torch.tensor(block_pos, dtype=torch.int64)
        return ids, positions

    def _draw(
        self, logits: Float[Tensor, "n vocab"], params: list[SamplingParams]
    ) -> tuple[Int[Tensor, " n"], Float[Tensor, "n vocab"] | None]:
        """Argmax for greedy requests (and ``argmax_drafts``), else a sample from the verifier's own transform."""
        vocab = self.network.draft_vocab
        ids = None if vocab is None else vocab.ids
        return draw_drafts(logits, params, self.generator, argmax_drafts=self.argmax_drafts, ids=ids)
