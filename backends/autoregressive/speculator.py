"""The autoregressive backend: draft prefill on the target's batch, then one query per request per step.

EAGLE-style heads sample the first draft from the prefill and run K-1 decode
steps; a separate draft model sees the target's own tokens in the prefill and
runs K decode steps starting from the bonus token. The multi-step decode
rebuilds the attention metadata each step; the fused decode builds it once and
advances it in place. Every forward goes through ``DraftContext.forward``.

An EAGLE head's prefill scores only the rows it samples, and its one layer
computes only K/V at the others. A step where no request drafts therefore needs
nothing but those K/V, and without DP it runs no forward at all: it holds its
committed rows and the next prefill writes them first (``backends.context_backlog``).
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from backends.autoregressive.metadata import advance_decode_metadata, build_decode_metadata, padded_rows
from backends.autoregressive.networks import EagleHead, ModelDrafter
from backends.common import DraftCacheOwner
from backends.context_backlog import MAX_HELD_ROWS, ContextBacklog, ContextRows, committed_slots, rows_with_slots
from backends.draft_vocab import DraftVocab
from backends.draw import argmax_proposal, draw_drafts, proposal_source
from contracts import (
    REJECTED_TOKEN_ID,
    BatchFacts,
    Mode,
    StepKind,
    current_mode,
)
from specdec.attn_metadata import ScheduledRequest, build_target_metadata
from specdec.dp_sync import pad_model_rows_for_dp
from specdec.nn.transformer import Transformer
from specdec.sampling import SamplingParams
from specdec.speculator import DraftContext, DraftOutput, Proposal, TargetStep


class AutoregressiveSpeculator(DraftCacheOwner):
    """K drafts per request, one token at a time (EAGLE/MTP heads or a small draft model)."""

    draft_step_kinds = frozenset({StepKind.DRAFT_PREFILL, StepKind.DRAFT_DECODE})

    def __init__(
        self,
        network: EagleHead | ModelDrafter,
        *,
        num_spec_tokens: int,
        fused: bool = False,
        aux_layers: tuple[int, ...] = (),
        name: str = "autoregressive",
        seed: int = 0,
        argmax_drafts: bool = False,
        max_held_rows: int = MAX_HELD_ROWS,
    ) -> None:
        if not 1 <= num_spec_tokens <= 8:
            raise ValueError(f"num_spec_tokens (K) must be in 1..8, got {num_spec_tokens}")
        if isinstance(network, EagleHead) and len(aux_layers) != network.num_aux:
            raise ValueError(f"the EAGLE head fuses {network.num_aux} target layers; aux_layers={aux_layers}")
        self.network = network
        self.name = name
        self.num_spec_tokens = num_spec_tokens
        self.fused = fused
        self.aux_layers = aux_layers if isinstance(network, EagleHead) else ()
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.argmax_drafts = argmax_drafts
        """Deterministic drafts even for sampled requests: the proposal is one-hot (``draft_probs`` None)."""
        self.max_held_rows = max_held_rows
        """EAGLE: context rows held while no request drafts (``ContextBacklog``); 1 writes every step at once."""
        self.backlog = ContextBacklog(max_held_rows)

    @property
    def samples_in_prefill(self) -> bool:
        """An EAGLE head predicts the first draft from the prefill; a draft model needs the bonus first."""
        return isinstance(self.network, EagleHead)

    def bind(self, target: Transformer, ctx: DraftContext) -> None:
        self._kv = ctx.new_cache("autoregressive", lookahead_tokens=self.num_spec_tokens + 1)
        self._storage = self.network.make_kv_storage(self._kv.num_blocks, ctx.block_size)
        if isinstance(self.network, EagleHead):  # a separate draft model packs on first use, as a target does
            self.network.prepare_packed()
        self.backlog = ContextBacklog(self.max_held_rows)

    # -- one proposal ----------------------------------------------------------------------------

    def propose(self, step: TargetStep, ctx: DraftContext) -> Proposal:
        k = self.num_spec_tokens
        # A request whose budget is 0 (the draft-length policy decided drafting does not pay) only has its
        # prefill rows written: no first draft, no decode rows.
        drafting = [r for r in range(step.num_reqs) if step.draft_budget(r, k) > 0]
        if not drafting and self._holds_context(ctx):
            self._hold_context(step)
            tokens = torch.full((step.num_reqs, k), REJECTED_TOKEN_ID, dtype=torch.int64, device=step.input_ids.device)
            return Proposal(draft_token_ids=tokens, num_drafts=(0,) * step.num_reqs)
        prefill = self._prefill(step, ctx, self.sampled_rows(step, drafting))
        vocab = prefill.logits.shape[-1]
        device = prefill.logits.device
        tokens = torch.full((step.num_reqs, k), REJECTED_TOKEN_ID, dtype=torch.int64, device=device)
        params = [step.params[r] for r in drafting]
        # A one-hot proposal is never handed over: no (num_reqs, K, vocab) buffer for it.
        one_hot = argmax_proposal(params, argmax_drafts=self.argmax_drafts)
        probs = None if one_hot else torch.zeros((step.num_reqs, k, vocab), device=device)
        # The logits each slot was drawn from, kept only where VER-9 will read them (full mode).
        source = torch.zeros_like(probs) if probs is not None and current_mode() is Mode.FULL else None

        if self.samples_in_prefill:
            first, first_probs = self._draw(prefill.logits, params)  # scored at exactly these rows
            tokens[drafting, 0] = first
            if probs is not None and first_probs is not None:
                probs[drafting, 0] = first_probs
            if source is not None:
                source[drafting, 0] = prefill.logits.float()
            features: Tensor | None = prefill.hidden_states  # scored at exactly these rows
            decode_steps, column_offset = k - 1, 1
        else:
            first = torch.tensor([step.next_token_ids[r] for r in drafting], dtype=torch.int64, device=device)
            features, decode_steps, column_offset = None, k, 0

        if ctx.dp_group is None:  # under DP every rank runs the same decode steps, whatever its own budgets
            longest = max((step.draft_budget(r, k) for r in drafting), default=0)
            decode_steps = max(0, min(decode_steps, longest - column_offset))
        if decode_steps:
            self._decode(
                step, ctx, drafting, first, features, decode_steps, column_offset, params, tokens, probs, source
            )
        num_drafts = tuple(step.draft_budget(r, k) for r in range(step.num_reqs))
        return Proposal(
            draft_token_ids=tokens,
            num_drafts=num_drafts,
            draft_probs=probs,
            sampled_from=probs,
            source=None if source is None else proposal_source(source, num_drafts, step.params),
        )

    def sampled_rows(self, step: TargetStep, drafting: list[int]) -> tuple[int, ...]:
        """The prefill rows the first draft is drawn from: each drafting request's last real row (EAGLE only).

        Only these rows pay the LM head: a draft model samples nothing from its
        prefill, and a step where no request has a draft budget scores no row.
        """
        if not self.samples_in_prefill:
            return ()
        return tuple(step.last_valid[r] for r in drafting)

    def _holds_context(self, ctx: DraftContext) -> bool:
        """An EAGLE head's rows nobody samples need only their K/V, which can wait; not under DP, where every
        rank runs the prefill and the decode syncs whether it drafts or not."""
        return isinstance(self.network, EagleHead) and ctx.dp_group is None

    def _hold_context(self, step: TargetStep) -> None:
        """No request drafts: no forward runs, and the committed rows' K/V wait for the next prefill to write them.

        With no forward there is no prefill for AR-1/AR-2 to check; the rows' slots
        come from the scheduler's committed lengths (``committed_slots``).
        """
        input_ids = self._prefill_inputs(step)
        slots = committed_slots(step, self.kv)
        due = self.backlog.hold(rows_with_slots((input_ids, *step.output.aux_hidden_states), step.positions, slots))
        self._write(due)

    def take_context(self, step: TargetStep, ctx: DraftContext) -> None:
        """A step where no request drafts, without DP (``ContextTaker``): an EAGLE head holds the rows, a draft
        model runs its prefill (its K/V at every row are its own forward's), and no proposal is made."""
        if self._holds_context(ctx):
            self._hold_context(step)
        else:
            self._prefill(step, ctx, ())

    def _write(self, rows: ContextRows | None) -> None:
        """Context rows' K/V (the held ones before anything reads the cache, or when the backlog is full)."""
        if rows is not None and isinstance(self.network, EagleHead):
            ids, *aux = rows.features
            self.network.write_context(ids, rows.positions, aux, rows.slot_mapping(), self.storage)

    def _prefill(self, step: TargetStep, ctx: DraftContext, scored_rows: tuple[int, ...]) -> DraftOutput:
        """Draft prefill over the target's padded batch (AR-1, AR-2), written where the engine opened the cache."""
        self._write(self.backlog.take())
        kv, device = self.kv, step.input_ids.device
        meta = build_target_metadata(list(step.scheduled), step.desc, kv, device=device)
        input_ids = self._prefill_inputs(step)
        features = None
        if isinstance(self.network, EagleHead):
            features = self.network.fuse_aux(step.output.aux_hidden_states)
        rows_padded = step.desc.num_reqs_padded(step.num_reqs)
        facts = BatchFacts(
            desc=step.desc,
            num_reqs=step.num_reqs,
            num_tokens=step.num_tokens,
            meta=meta,
            input_ids=input_ids,
            positions=step.positions,
            block_size=kv.block_size,
            hidden_states=features,
            target_desc=step.desc,
            last_token_indices=padded_rows(step.last_valid, rows_padded, device),
        )
        out = ctx.forward(
            self.network,
            StepKind.DRAFT_PREFILL,
            facts,
            self.storage,
            num_tokens_across_dp=step.dp_state.num_tokens_across_dp,
            scored_rows=scored_rows,
        )
        return out

    def _prefill_inputs(self, step: TargetStep) -> Int[Tensor, " num_tokens"]:
        """EAGLE: the target's ids shifted left by one within each request, the next token at the last valid row."""
        if not isinstance(self.network, EagleHead):
            return step.input_ids
        shifted = torch.roll(step.input_ids, -1)
        if step.num_reqs:
            rows = torch.tensor(step.last_valid, dtype=torch.int64, device=shifted.device)
            shifted[rows] = torch.tensor(step.next_token_ids, dtype=torch.int64, device=shifted.device)
        return shifted

    def _decode(
        self,
        step: TargetStep,
        ctx: DraftContext,
        drafting: list[int],
        first: Int[Tensor, " n"],
        features: Float[Tensor, "n hidden"] | None,
        num_steps: int,
        column_offset: int,
        params: list[SamplingParams],
        tokens: Tensor,
        probs: Tensor | None,
        source: Tensor | None = None,
    ) -> None:
        """Draft decode steps 1..num_steps: exactly one query per drafting request (AR-3..AR-8)."""
        m = len(drafting)
        state, desc = ctx.sync(m, m, 1 if m else None, allow_piecewise=False, purpose="draft_decode")
        if desc.num_tokens == 0:  # no rank drafts: every rank skips alike
            return
        desc, across = pad_model_rows_for_dp(desc, state, m, 1)
        kv, device, max_len = self.kv, step.input_ids.device, ctx.max_model_len
        req_ids = [step.scheduled[r].req_id for r in drafting]
        base = [step.base_positions[r] for r in drafting]
        ids, feats = first, features
        meta = None
        # Blocks for every step up front (the fused decode's block table is built once); these positions lie past
        # the committed length, so the engine's close after the proposal rolls them back.
        for rid, p in zip(req_ids, base, strict=True):
            kv.ensure_capacity(rid, min(p + num_steps, max_len - 1) + 1)
        for k in range(1, num_steps + 1):
            pos = [min(p + k, max_len - 1) for p in base]
            if meta is None or not self.fused:
                meta = build_decode_metadata(desc, req_ids, pos, kv, max_len, device)
            else:
                meta = advance_decode_metadata(meta, req_ids, pos, kv, max_len)
            facts = BatchFacts(
                desc=desc,
                num_reqs=m,
                num_tokens=m,
                meta=meta,
                input_ids=_pad_ids(ids, desc.num_tokens),
                positions=padded_rows(pos, desc.num_tokens, device),
                block_size=kv.block_size,
                max_model_len=max_len,
                hidden_states=None if feats is None else _pad_features(feats, desc.num_tokens),
                base_positions=torch.tensor(base, dtype=torch.int64, device=device),
                draft_step=k,
            )
            out = ctx.forward(self.network, StepKind.DRAFT_DECODE, facts, self.storage, num_tokens_across_dp=across)
            for rid, p in zip(req_ids, pos, strict=True):
                kv.set_length(rid, max(kv.length(rid), p + 1))
            if m:
                drawn, drawn_probs = self._draw(out.logits[:m], params)
                column = k - 1 + column_offset
                tokens[drafting, column] = drawn
                if probs is not None and drawn_probs is not None:
                    probs[drafting, column] = drawn_probs
                if source is not None:
                    source[drafting, column] = out.logits[:m].float()
                ids = drawn
                feats = out.hidden_states[:m] if feats is not None else None

    def _draw(
        self, logits: Float[Tensor, "n vocab"], params: list[SamplingParams]
    ) -> tuple[Int[Tensor, " n"], Float[Tensor, "n vocab"] | None]:
        """Sample (or argmax for greedy requests) with the same transform the verifier applies to the target."""
        vocab = getattr(self.network, "draft_vocab", None)  # an EAGLE head's; a draft model scores its own head
        ids = vocab.ids if isinstance(vocab, DraftVocab) else None
        return draw_drafts(logits, params, self.generator, argmax_drafts=self.argmax_drafts, ids=ids)


def _pad_ids(ids: Int[Tensor, " n"], rows: int) -> Int[Tensor, " rows"]:
    """Drafted ids padded to the model rows on the device: no host copy of the drafts inside the loop."""
    out = ids.new_zeros(rows)
    out[: ids.shape[0]] = ids
    return out


def _pad_features(x: Float[Tensor, "n hidden"], rows: int) -> Float[Tensor, "rows hidden"]:
    out = x.new_zeros((rows, x.shape[1]))
    out[: x.shape[0]] = x
    return out


__all__ = ["AutoregressiveSpeculator", "ScheduledRequest"]
