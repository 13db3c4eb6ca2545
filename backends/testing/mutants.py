"""The built-in drafters' mutation corpus: realistic bugs in ``backends``' code, each injected at run time.

Published as the ``specdec.mutants`` entry point ``built-in``, so ``specdec
mutate`` finds it the way it finds a third-party backend's corpus and
``specdec`` never imports ``backends``. Each mutant wraps a real function or
method of a drafter (``specdec.testing.mutant``) and perturbs its result the way
the bug would; ``expected`` is the invariant meant to catch it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

import backends.autoregressive.speculator
import backends.dflash.speculator
import backends.dspark.speculator
import backends.lookup_first
import specdec.draft_builders
from backends.autoregressive.speculator import AutoregressiveSpeculator
from backends.dflash.speculator import DFlashSpeculator
from backends.dspark.speculator import DSparkSpeculator
from contracts import BatchExecutionDescriptor
from specdec.sampling import SamplingParams, probabilities, sample
from specdec.testing.mutant import Mutant, together, wrapped

# -- the DP pad in draft attention metadata -------------------------------------------------------------------------


def _attention_rows_from_desc(real: Any) -> Any:
    """Draft attention rows from ``desc.num_tokens`` in every mode: the DP pad counted as queries.

    The pre-fix vLLM behaviour, in the AR decode (the motivating DeepSeek-V3.2
    DP crash) and in the block drafters (FlashInfer's ``q.shape[0] != qo_indptr[-1]``).
    """

    def rows(desc: BatchExecutionDescriptor, *args: int) -> int:
        return desc.num_tokens

    return rows


# -- autoregressive drafters ----------------------------------------------------------------------------------------


def _decode_metadata_one_behind(real: Any) -> Any:
    """Step k's metadata built before its position was advanced: seq_lens and the KV slot one behind the query."""

    def build(desc: Any, req_ids: Any, positions: list[int], kv: Any, max_model_len: int, device: torch.device) -> Any:
        return real(desc, req_ids, [p - 1 for p in positions], kv, max_model_len, device)

    return build


def _decode_sync_verify_shaped(real: Any) -> Any:
    """The AR decode's DP sync sized like the verify step: K + 1 tokens per drafting request instead of one.

    The draft decode then runs on a verify-shaped descriptor (the real bug class
    AR-4 names); its inputs and metadata follow that descriptor consistently.
    """

    def decode(self: Any, step: Any, ctx: Any, *args: Any) -> None:
        q, sync = self.num_spec_tokens + 1, ctx.sync

        def verify_shaped(num_reqs: int, num_tokens: int, uniform_token_count: int | None, **kw: Any) -> Any:
            if kw.get("purpose") == "draft_decode" and num_reqs:
                return sync(num_reqs, num_reqs * q, q, **kw)
            return sync(num_reqs, num_tokens, uniform_token_count, **kw)

        ctx.sync = verify_shaped  # an instance attribute shadows the method for this call
        try:
            real(self, step, ctx, *args)
        finally:
            del ctx.sync

    return decode


def _prefill_on_real_rows(real: Any) -> Any:
    """The draft prefill runs on the target step cut to its real tokens: ids, positions and hidden states."""

    def prefill(self: Any, step: Any, ctx: Any, *args: Any) -> Any:
        n, out = step.num_tokens, step.output
        cut = dataclasses.replace(
            out, hidden_states=out.hidden_states[:n], aux_hidden_states=tuple(a[:n] for a in out.aux_hidden_states)
        )
        short = dataclasses.replace(step, input_ids=step.input_ids[:n], positions=step.positions[:n], output=cut)
        return real(self, short, ctx, *args)

    return prefill


def _rows_own_length(real: Any) -> Any:
    """Padding helpers that pad to their own length: decode inputs stay at the request count, not the DP rows."""

    def pad(values: Any, rows: int, *args: Any) -> Tensor:
        out: Tensor = real(values, len(values), *args)
        return out

    return pad


def _first_draft_row_in_padded_layout(real: Any) -> Any:
    """EAGLE locates the last request's last row from the padded token count: its first draft is read off padding.

    The "12 requests padded to 13 tokens" confusion at the sampling side: the
    row is ``desc.num_tokens - 1`` (the DP or CUDA-graph pad included) instead
    of the request's own last real row.
    """

    def rows(self: Any, step: Any, drafting: list[int]) -> tuple[int, ...]:
        out = list(real(self, step, drafting))
        if out and drafting[-1] == step.num_reqs - 1:
            out[-1] = step.desc.num_tokens - 1
        return tuple(out)

    return rows


def _drawn_before_transform(real: Any) -> Any:
    """Drafts sampled from the raw softmax while the temperature/top-k/top-p proposal is reported."""

    def draw(self: Any, logits: Tensor, params: list[SamplingParams]) -> tuple[Tensor, Tensor | None]:
        drawn, q = real(self, logits, params)
        if not params or q is None:  # argmax drafts: no proposal is handed over
            return drawn, q
        return sample(logits.float().softmax(-1), self.generator), q

    return draw


def _top_k_not_renormalised(real: Any) -> Any:
    """The reported proposal is the temperature softmax with top-k/top-p's cut tokens zeroed, never renormalised.

    The drafts still come from the right (normalised) distribution, and the same
    tensor is reported as both ``draft_probs`` and ``sampled_from``, so VER-3 sees
    nothing; the verifier divides by a q that is too small and accepts too often.
    """

    def draw(self: Any, logits: Tensor, params: list[SamplingParams]) -> tuple[Tensor, Tensor | None]:
        drawn, q = real(self, logits, params)
        if not params or q is None:  # argmax drafts: no proposal is handed over
            return drawn, q
        untruncated = [p if p.greedy else SamplingParams(temperature=p.temperature) for p in params]
        return drawn, torch.where(q > 0, probabilities(logits, untruncated), 0.0)

    return draw


# -- block drafters (DFlash, DSpark) --------------------------------------------------------------------------------


def _context_every_row(real: Any) -> Any:
    """Context slots for every target row, rejected drafts and finished requests included (no ``p < end``)."""

    def slots(self: Any, step: Any) -> list[int]:
        out: list[int] = real(self, step)
        self.kv.ensure_capacities({s.req_id: s.seq_len for s in step.scheduled})
        row = 0
        for s in step.scheduled:
            out[row : row + s.query_len] = self.kv.slot_mapping(s.req_id, range(s.num_computed_tokens, s.seq_len))
            row += s.query_len
        return out

    return slots


def _block_qsl_padded_requests(real: Any) -> Any:
    """``query_start_loc = r * q`` for every row: padded requests get q queries instead of none."""

    def build(
        desc: Any,
        req_ids: Any,
        base_positions: Any,
        q: int,
        kv: Any,
        max_model_len: int,
        device: torch.device,
    ) -> Any:
        meta = real(desc, req_ids, base_positions, q, kv, max_model_len, device)
        qsl = [r * q for r in range(meta.num_reqs_padded + 1)]
        return dataclasses.replace(
            meta,
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=meta.query_start_loc.device),
            query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
        )

    return build


def _block_at_last_verified(real: Any) -> Any:
    """Block positions ``P + j`` instead of ``P + 1 + j``: the block starts on the last verified token."""

    def inputs(self: Any, step: Any, drafting: list[int], rows: int, max_model_len: int) -> tuple[Tensor, Tensor]:
        ids, positions = real(self, step, drafting, rows, max_model_len)
        n = len(drafting) * self.query_width
        positions = positions.clone()
        positions[:n] -= 1
        return ids, positions

    return inputs


def _markov_from_zero(real: Any) -> Any:
    """The chain state is initialised to token 0 instead of the anchor."""

    def start(self: Any, anchors: Tensor) -> Tensor:
        return torch.zeros_like(real(self, anchors))

    return start


def _backbone_proposal(real: Any) -> Any:
    """The verifier gets ``softmax(U_k)`` (through the sampling transform), not the Markov-corrected q."""

    def proposal(self: Any, corrected: Tensor, backbone: Tensor, params: list[SamplingParams]) -> Tensor:
        real(self, corrected, backbone, params)
        m, k, vocab = backbone.shape
        per_row = [p for p in params for _ in range(k)]
        return probabilities(backbone.float().reshape(m * k, vocab), per_row).view(m, k, vocab)

    return proposal


def _right_aligned_mask(real: Any) -> Any:
    """The capacity mask right-aligned (a left-padding convention): the last ``c`` slots instead of the first."""

    def mask(capacity: Tensor, k: int) -> Tensor:
        out: Tensor = real(capacity, k).flip(-1)
        return out

    return mask


# -- padded draft rows writing live KV -------------------------------------------------------------------------------


def _padded_decode_rows_write_live_slot(real: Any) -> Any:
    """Padded model rows of a draft decode step get the first request's slot instead of ``PAD_SLOT_ID``.

    The KV write of a DP-pad or graph-pad row then overwrites a live position of
    a real request's draft cache: drafts go wrong silently, no kernel complains.
    """

    def build(*args: Any, **kwargs: Any) -> Any:
        meta = real(*args, **kwargs)
        slots, n = meta.slot_mapping.clone(), meta.num_tokens
        if 0 < n < slots.shape[0]:
            slots[n:] = slots[0]
        return dataclasses.replace(meta, slot_mapping=slots)

    return build


# -- the corpus -----------------------------------------------------------------------------------------------------

# -- the proposal handed back to the engine (PROP-*) -----------------------------------------------------------------


def _proposal_mutant(perturb: Any) -> Any:
    """A ``wrap`` for a drafter's ``propose``: the real proposal, then ``perturb(proposal, step, ctx)``."""

    def wrap(real: Any) -> Any:
        def propose(self: Any, step: Any, ctx: Any) -> Any:
            return perturb(real(self, step, ctx), step, ctx)

        return propose

    return wrap


def _forged(proposal: Any, **changes: Any) -> Any:
    """``dataclasses.replace`` past the dataclass's runtime type check: what a drafter's bug hands the engine."""
    out = dataclasses.replace(proposal)
    for name, value in changes.items():
        object.__setattr__(out, name, value)
    return out


def _rows_of_the_whole_buffer(proposal: Any, step: Any, ctx: Any) -> Any:
    """Draft ids handed back as the drafter's persistent (max_num_seqs, K) buffer, not its first num_reqs rows."""
    ids = proposal.draft_token_ids
    if ctx.max_num_seqs > ids.shape[0]:
        ids = torch.cat([ids, ids.new_zeros((ctx.max_num_seqs - ids.shape[0], ids.shape[1]))])
    return _forged(proposal, draft_token_ids=ids)


def _counts_for_drafting_only(proposal: Any, step: Any, ctx: Any) -> Any:
    """One count per drafting request, as if the counts were built while looping over the drafting ones only."""
    counts = tuple(n for n, drafting in zip(proposal.num_drafts, step.drafting, strict=True) if drafting)
    return _forged(proposal, num_drafts=counts)


def _counts_include_bonus(proposal: Any, step: Any, ctx: Any) -> Any:
    """Each drafting request's count includes the bonus token: K + 1 for a full draft."""
    return _forged(proposal, num_drafts=tuple(n + 1 if n else 0 for n in proposal.num_drafts))


def _drafts_for_every_request(proposal: Any, step: Any, ctx: Any) -> Any:
    """``step.drafting`` ignored: a request still in chunked prefill (or just finished) gets K drafts too."""
    k = proposal.draft_token_ids.shape[1]
    return _forged(proposal, num_drafts=(k,) * len(proposal.num_drafts))


def _widened_ids_only(real: Any) -> Any:
    """A lookup drafting past the drafter's K widens the draft ids to the engine's K but not the distributions.

    The engine keeps each request's first drafts only, so the verifier never sees the short tensors; the proposal's
    reported logits (widened) and its distributions disagree, and a lookup match of a sampled request cannot write
    its one-hot row into them.
    """

    def widened(proposal: Any, width: int) -> Any:
        wide = real(proposal, width)
        return dataclasses.replace(wide, draft_probs=proposal.draft_probs, sampled_from=proposal.sampled_from)

    return widened


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "eagle-padded-decode-row-writes-live-slot",
        "padded rows of an AR draft decode step write the first request's slot instead of PAD_SLOT_ID",
        "eagle",
        "dp",
        "KV-3",
        lambda: wrapped(
            backends.autoregressive.speculator, "build_decode_metadata", _padded_decode_rows_write_live_slot
        ),
    ),
    Mutant(
        "eagle-dp-pad-decode-attention",
        "AR draft decode attention rows from desc.num_tokens, which includes the DP pad (the motivating vLLM bug)",
        "eagle",
        "dp",
        "AR-5",
        lambda: wrapped(specdec.draft_builders, "decode_attention_rows", _attention_rows_from_desc),
    ),
    Mutant(
        "eagle-first-draft-from-padded-row",
        "EAGLE samples the last request's first draft at row desc.num_tokens - 1, the CUDA-graph pad's last row",
        "eagle",
        "graph",
        "VER-11",
        lambda: wrapped(AutoregressiveSpeculator, "sampled_rows", _first_draft_row_in_padded_layout),
    ),
    Mutant(
        "dflash-dp-pad-block-attention",
        "DFlash block attention rows from desc.num_tokens outside FULL, DP pad included (the follow-up vLLM bug)",
        "dflash",
        "dp",
        "BLK-3",
        lambda: wrapped(specdec.draft_builders, "block_attention_rows", _attention_rows_from_desc),
    ),
    Mutant(
        "dspark-dp-pad-block-attention",
        "the same DP-padding leak through DSpark's anchor-first block metadata",
        "dspark",
        "dp",
        "BLK-3",
        lambda: wrapped(specdec.draft_builders, "block_attention_rows", _attention_rows_from_desc),
    ),
    Mutant(
        "dflash-rejected-context-rows",
        "DFlash writes the context K/V of rejected draft rows (and finished requests) into the draft cache",
        "dflash",
        "dp",
        "BLK-6",
        lambda: wrapped(DFlashSpeculator, "_context_slots", _context_every_row),
    ),
    Mutant(
        "dspark-markov-start-wrong-token",
        "DSpark's Markov chain starts from token 0 instead of the anchor (the bonus just sampled)",
        "dspark",
        "dp",
        "BLK-8",
        lambda: wrapped(DSparkSpeculator, "_markov_start", _markov_from_zero),
    ),
    Mutant(
        "dspark-backbone-proposal",
        "DSpark hands the verifier the backbone softmax(U_k) instead of the Markov-corrected q it drew from",
        "dspark",
        "sampling",
        "VER-3",
        lambda: wrapped(DSparkSpeculator, "_verifier_proposal", _backbone_proposal),
    ),
    Mutant(
        "dspark-capacity-not-prefix",
        "DSpark's capacity mask right-aligned: the last c slots are proposed, not a prefix",
        "dspark",
        "draft-length",
        "BLK-8",
        lambda: wrapped(backends.dspark.speculator, "prefix_mask", _right_aligned_mask),
        # Truncating capacities on every example; the capacity family draws "full" (no truncation) a third of the time.
        options={"capacity": "threshold", "tau": 0.5},
    ),
    Mutant(
        "draft-model-decode-positions-off-by-one",
        "AR draft decode step k builds its metadata (seq_lens, KV slot) for position P+k-1, one behind its query",
        "draft-model",
        "acceptance",
        "AR-8",
        lambda: wrapped(backends.autoregressive.speculator, "build_decode_metadata", _decode_metadata_one_behind),
    ),
    Mutant(
        "draft-model-decode-verify-shaped",
        "the AR draft decode sync is sized like the verify step (K + 1 tokens per request), not one query per request",
        "draft-model",
        "acceptance",
        "AR-4",
        lambda: wrapped(AutoregressiveSpeculator, "_decode", _decode_sync_verify_shaped),
    ),
    Mutant(
        "eagle-prefill-unpadded",
        "the EAGLE draft prefill runs on the target's real tokens only, not its padded rows (ids, positions, hidden)",
        "eagle",
        "dp",
        "AR-1",
        lambda: wrapped(AutoregressiveSpeculator, "_prefill", _prefill_on_real_rows),
    ),
    Mutant(
        "eagle-decode-inputs-unpadded",
        "EAGLE decode ids, positions and features padded to the request count, not the DP-padded model rows",
        "eagle",
        "dp",
        "AR-6",
        lambda: together(
            lambda: wrapped(backends.autoregressive.speculator, "_pad_ids", _rows_own_length),
            lambda: wrapped(backends.autoregressive.speculator, "padded_rows", _rows_own_length),
            lambda: wrapped(backends.autoregressive.speculator, "_pad_features", _rows_own_length),
        ),
    ),
    Mutant(
        "eagle-draft-sampled-before-transform",
        "EAGLE drafts drawn from the raw softmax while the temperature/top-k/top-p proposal is reported",
        "eagle",
        "sampling",
        "VER-7",
        lambda: wrapped(AutoregressiveSpeculator, "_draw", _drawn_before_transform),
    ),
    Mutant(
        "eagle-top-k-not-renormalised",
        "EAGLE reports its top-k/top-p proposal without renormalising it after the cut",
        "eagle",
        "sampling",
        "VER-6",
        lambda: wrapped(AutoregressiveSpeculator, "_draw", _top_k_not_renormalised),
    ),
    Mutant(
        "dspark-block-qsl-padded-requests",
        "block query_start_loc gives padded requests q queries instead of zero-length ranges (shared DFlash code)",
        "dspark",
        "graph",
        "BLK-4",
        lambda: wrapped(backends.dflash.speculator, "build_block_metadata", _block_qsl_padded_requests),
        # q = K = 1: every capture size can hold a FULL block step, the only kind with padded requests.
        options={"num_spec_tokens": 1},
    ),
    Mutant(
        "dflash-block-positions-off-by-one",
        "the DFlash block placed at the last verified position P instead of P + 1",
        "dflash",
        "dp",
        "BLK-5",
        lambda: wrapped(DFlashSpeculator, "_block_inputs", _block_at_last_verified),
    ),
    Mutant(
        "dflash-proposal-whole-buffer",
        "DFlash hands back its persistent (max_num_seqs, K) draft-id buffer instead of its first num_reqs rows",
        "dflash",
        "dp",
        "PROP-1",
        lambda: wrapped(DFlashSpeculator, "propose", _proposal_mutant(_rows_of_the_whole_buffer)),
    ),
    Mutant(
        "eagle-counts-for-drafting-only",
        "EAGLE returns one draft count per drafting request instead of one per request of the step",
        "eagle",
        "dp",
        "PROP-2",
        lambda: wrapped(AutoregressiveSpeculator, "propose", _proposal_mutant(_counts_for_drafting_only)),
    ),
    Mutant(
        "dflash-counts-include-bonus",
        "DFlash counts the bonus token in each request's number of drafts (K + 1 for a full draft)",
        "dflash",
        "dp",
        "PROP-3",
        lambda: wrapped(DFlashSpeculator, "propose", _proposal_mutant(_counts_include_bonus)),
    ),
    Mutant(
        "eagle-drafts-for-non-drafting",
        "EAGLE ignores step.drafting and proposes K drafts for requests that finished in the step or are still in prefill",
        "eagle",
        "dp",
        "PROP-4",
        lambda: wrapped(AutoregressiveSpeculator, "propose", _proposal_mutant(_drafts_for_every_request)),
    ),
    Mutant(
        "lookup-widens-ids-not-distributions",
        "prompt lookup drafting past the drafter's K widens the draft ids and the reported logits to the engine's K; "
        "the distributions stay at the drafter's K (a lookup match of a sampled request then fails to write its row)",
        "dflash",
        "sampling",
        "VER-9",
        lambda: wrapped(backends.lookup_first, "widened", _widened_ids_only),
    ),
)


# -- one metadata standard, definitions, the drafter's own sampling (IN-1, PAD-2, VER-8, VER-9, BLK-8) ----------------


def _positions_as_float(real: Any) -> Any:
    """Padded per-row helpers that build float tensors (``torch.zeros`` without a dtype): decode positions are floats."""

    def pad(values: Any, rows: int, *args: Any) -> Tensor:
        out: Tensor = real(values, rows, *args)
        return out.float()

    return pad


def _decode_padded_seq_lens_one(real: Any) -> Any:
    """AR draft decode metadata gives padded requests ``seq_len`` 1, as if each held a dummy token of context."""

    def build(*args: Any, **kwargs: Any) -> Any:
        meta = real(*args, **kwargs)
        if meta.num_reqs_padded <= meta.num_reqs:
            return meta
        changed = {}
        for name in ("seq_lens", "seq_lens_cpu"):
            seq = getattr(meta, name)
            if seq is not None:
                seq = seq.clone()
                seq[meta.num_reqs :] = 1
                changed[name] = seq
        return dataclasses.replace(meta, **changed)

    return build


def _draw_ignores_temperature(real: Any) -> Any:
    """Drafts drawn at temperature 1 whatever the request asked (top-k / top-p kept), and that proposal reported.

    The drafter reports the distribution it really drew from as both
    ``draft_probs`` and ``sampled_from``, so VER-3, VER-6 and VER-7 all hold and
    the output stays lossless; only the definition of the proposal (VER-9) shows it.
    """

    def draw(self: Any, logits: Tensor, params: list[SamplingParams]) -> tuple[Tensor, Tensor | None]:
        at_one = [p if p.greedy else p.model_copy(update={"temperature": 1.0}) for p in params]
        return real(self, logits, at_one)

    return draw


def _nan_in_head_norm(real: Any) -> Any:
    """One entry of the EAGLE head's final norm weight is NaN (a corrupt checkpoint, an uninitialised parameter)."""

    def bind(self: Any, target: Any, ctx: Any) -> None:
        real(self, target, ctx)
        norm = self.network.norm
        weight = norm.weight.detach().clone()  # a new tensor: no other model shares the NaN
        weight[0] = float("nan")
        norm.weight = torch.nn.Parameter(weight, requires_grad=False)

    return bind


def _survival_shifted(real: Any) -> Any:
    """Survival a_k computed as the product of the confidences strictly before draft k (a_1 = 1): one slot late.

    Still in [0, 1] and never increasing, so only the definition catches it; the
    capacities it picks are one draft too long.
    """

    def survival(self: Any, confidence: Tensor) -> Tensor:
        full: Tensor = real(self, confidence)
        return torch.cat([torch.ones_like(full[:, :1]), full[:, :-1]], dim=1)

    return survival


DEFINITION_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "eagle-decode-positions-float",
        "EAGLE's padded per-row helper builds float tensors: draft decode positions reach the model as floats",
        "eagle",
        "dp",
        "IN-1",
        lambda: wrapped(backends.autoregressive.speculator, "padded_rows", _positions_as_float),
    ),
    Mutant(
        "eagle-decode-padded-seq-lens",
        "AR draft decode metadata gives padded requests seq_len 1 instead of 0 (the target's rule, broken by a drafter)",
        "eagle",
        "graph",
        "PAD-2",
        lambda: wrapped(backends.autoregressive.speculator, "build_decode_metadata", _decode_padded_seq_lens_one),
    ),
    Mutant(
        "eagle-draft-ignores-temperature",
        "EAGLE draws its drafts at temperature 1 whatever the request asked, and reports that proposal",
        "eagle",
        "sampling",
        "VER-9",
        lambda: wrapped(AutoregressiveSpeculator, "_draw", _draw_ignores_temperature),
    ),
    Mutant(
        "eagle-draft-weight-nan",
        "a NaN in one weight of the EAGLE head (its final norm): every draft logit row is NaN",
        "eagle",
        "sampling",
        "VER-8",
        lambda: wrapped(AutoregressiveSpeculator, "bind", _nan_in_head_norm),
    ),
    Mutant(
        "dspark-survival-shifted",
        "DSpark's survival of draft k is the product of the confidences before it, missing its own (one slot late)",
        "dspark",
        "dp",
        "BLK-8",
        lambda: wrapped(DSparkSpeculator, "_survival", _survival_shifted),
    ),
)
"""This block's mutants, kept apart from the others so that corpora added alongside merge cleanly."""

MUTANTS = MUTANTS + DEFINITION_MUTANTS
