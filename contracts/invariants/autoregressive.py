"""AR-*: the autoregressive drafter's prefill and one-query-per-request decode steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from contracts.registry import Observed, StepKind, Subject, Tag, ValueReader, invariant

if TYPE_CHECKING:
    from contracts.descriptor import BatchExecutionDescriptor
    from contracts.facts import BatchFacts, ProposalFacts

PREFILL = {StepKind.DRAFT_PREFILL}
DECODE = {StepKind.DRAFT_DECODE}
DP_PAD_LEAK = (
    "DP padding leaked into draft attention metadata: the attention token count was built from "
    "desc.num_tokens (model rows, which include the DP pad) instead of num_reqs_padded (one query per request)"
)


@invariant(
    "AR-1",
    "Draft prefill runs at least the target's desc.num_tokens rows, and its ids, positions and hidden states have the draft desc.num_tokens rows.",
    tag=Tag.S,
    subject=Subject.BATCH,
    step_kinds=PREFILL,
    likely_cause="the draft prefill was sized from the real token count, so DP collectives would not line up",
    accepts="a draft prefill graph that pads further than the target's (its own capture sizes); every target row is still covered",
)
def ar_1(facts: BatchFacts, _: ValueReader) -> Observed | None:
    target = facts.target_desc
    n = target.num_tokens if target is not None else facts.desc.num_tokens
    rows = facts.desc.num_tokens
    hidden = facts.hidden_states.shape[0] if facts.hidden_states is not None else rows
    if rows < n or facts.input_ids.shape[0] != rows or facts.positions.shape[0] != rows or hidden != rows:
        return {
            "draft desc.num_tokens": rows,
            "target desc.num_tokens": n,
            "len(input_ids)": facts.input_ids.shape[0],
            "len(positions)": facts.positions.shape[0],
            "hidden rows": hidden,
        }
    return None


@invariant(
    "AR-2",
    "The last-token index of request r lies in [query_start_loc[r], query_start_loc[r+1]); padded rows hold 0.",
    tag=Tag.D,
    subject=Subject.BATCH,
    step_kinds=PREFILL,
    likely_cause="the sampled position was taken from the padded layout or from the neighbouring request",
)
def ar_2(facts: BatchFacts, reader: ValueReader) -> Observed | None:
    idx = reader.device(facts.last_token_indices)
    qsl = reader.device(facts.meta.query_start_loc)
    if idx is None or qsl is None:
        return None
    n = facts.num_reqs
    bad = [r for r in range(n) if not qsl[r] <= idx[r] < qsl[r + 1]]
    if bad or any(i != 0 for i in idx[n:]):
        return {"last_token_indices": idx, "query_start_loc": qsl, "bad requests": bad}
    return None


@invariant(
    "AR-3",
    "Draft decode runs FULL or NONE, never PIECEWISE.",
    tag=Tag.S,
    subject=Subject.BATCH,
    step_kinds=DECODE,
    likely_cause="the target's piecewise descriptor was reused for one-query-per-request draft decode",
)
def ar_3(facts: BatchFacts, _: ValueReader) -> Observed | None:
    d = facts.desc
    if d.cg_mode.name == "PIECEWISE":
        return {"cg_mode": d.cg_mode.name}
    return None


VERIFY_SHAPED = "a verify-shaped (K+1 tokens per request) descriptor was reused for one-query draft decode"


@invariant(
    "AR-4",
    "Draft decode runs one query per real request: uniform_token_count is 1 when set; under FULL desc.num_tokens == desc.num_reqs; "
    "under eager the model rows exceed num_reqs only by a DP pad, so without DP (dp_size 1) desc.num_tokens == num_reqs.",
    tag=Tag.S,
    subject=Subject.BATCH,
    step_kinds=DECODE,
    likely_cause=VERIFY_SHAPED,
    accepts="an eager (or graph-fallback) descriptor with uniform_token_count None; eager model rows past num_reqs "
    "when DP is on or dp_size is not given (a pad to the largest rank's count)",
)
def ar_4(facts: BatchFacts, _: ValueReader) -> Observed | None:
    return one_row_per_request(facts.desc, facts.num_reqs, facts.dp_size, "draft decode")


def one_row_per_request(d: BatchExecutionDescriptor, num_reqs: int, dp_size: int | None, step: str) -> Observed | None:
    """AR-4's rule, shared by every one-row-per-request draft step (the heads' forward too, HEAD-1)."""
    cause = None
    if d.uniform_token_count not in (None, 1) or (d.cg_mode.name == "FULL" and d.num_reqs != d.num_tokens):
        cause = VERIFY_SHAPED
    elif d.cg_mode.name == "NONE" and d.num_tokens < num_reqs:
        cause = f"{step} model rows cut below one per request"
    elif d.cg_mode.name == "NONE" and dp_size == 1 and d.num_tokens != num_reqs:
        cause = (
            "eager model rows past the requests with no DP pad to explain them: "
            "the descriptor of another batch (e.g. the verify step's K+1 tokens per request) was reused"
        )
    if cause is None:
        return None
    return {
        "cg_mode": d.cg_mode.name,
        "uniform_token_count": d.uniform_token_count,
        "desc.num_reqs": d.num_reqs,
        "desc.num_tokens": d.num_tokens,
        "num_reqs": num_reqs,
        "dp_size": dp_size,
        "likely_cause": cause,
    }


@invariant(
    "AR-5",
    "Draft decode attention has num_reqs_padded requests and desc.num_tokens query rows under FULL, num_reqs otherwise; never the DP-padded model rows.",
    tag=Tag.S,
    subject=Subject.BATCH,
    step_kinds=DECODE,
    likely_cause=DP_PAD_LEAK,
)
def ar_5(facts: BatchFacts, _: ValueReader) -> Observed | None:
    d, meta = facts.desc, facts.meta
    rows = d.num_reqs_padded(facts.num_reqs)
    want = d.num_tokens if d.cg_mode.name == "FULL" else facts.num_reqs
    if meta.num_reqs_padded != rows or meta.num_tokens_padded != want or meta.query_start_loc.shape[0] != rows + 1:
        observed: Observed = {
            "meta.num_reqs_padded": meta.num_reqs_padded,
            "meta.num_tokens_padded": meta.num_tokens_padded,
            "expected num_reqs_padded": rows,
            "expected attention tokens": want,
            "desc.num_tokens": d.num_tokens,
            "num_reqs": facts.num_reqs,
        }
        if meta.num_tokens_padded == d.num_tokens != want:
            observed["likely_cause"] = DP_PAD_LEAK
        else:
            observed["likely_cause"] = "draft decode metadata was built for another batch shape"
        return observed
    return None


@invariant(
    "AR-6",
    "Draft decode model inputs (ids, positions, hidden states) and the slot mapping have length desc.num_tokens; the DP pad is allowed there.",
    tag=Tag.S,
    subject=Subject.BATCH,
    step_kinds=DECODE,
    likely_cause="model inputs were cut to the request count, so DP collectives would not line up",
)
def ar_6(facts: BatchFacts, _: ValueReader) -> Observed | None:
    n = facts.desc.num_tokens
    hidden = facts.hidden_states.shape[0] if facts.hidden_states is not None else n
    slots = facts.meta.slot_mapping.shape[0]
    if facts.input_ids.shape[0] != n or facts.positions.shape[0] != n or hidden != n or slots != n:
        return {
            "len(input_ids)": facts.input_ids.shape[0],
            "len(positions)": facts.positions.shape[0],
            "hidden rows": hidden,
            "len(slot_mapping)": slots,
            "desc.num_tokens": n,
        }
    return None


@invariant(
    "AR-7",
    "Draft decode query_start_loc[i] == min(i, num_reqs) and max_query_len == 1.",
    tag=Tag.H,
    subject=Subject.BATCH,
    step_kinds=DECODE,
    likely_cause="padded requests were given a query, or query_start_loc was copied from the target step",
)
def ar_7(facts: BatchFacts, reader: ValueReader) -> Observed | None:
    meta = facts.meta
    qsl = reader.host(meta.query_start_loc_cpu)
    if qsl is None:
        qsl = reader.device(meta.query_start_loc)
    want = [min(i, facts.num_reqs) for i in range(meta.query_start_loc.shape[0])]
    if meta.max_query_len != 1 or (qsl is not None and qsl != want):
        return {"query_start_loc": qsl, "expected": want, "max_query_len": meta.max_query_len}
    return None


@invariant(
    "AR-8",
    "Draft decode step k has positions == min(P + k, max_model_len - 1) and seq_lens == positions + 1 for real requests.",
    tag=Tag.D,
    subject=Subject.BATCH,
    step_kinds=DECODE,
    likely_cause="positions were not advanced (or advanced twice) between draft steps",
)
def ar_8(facts: BatchFacts, reader: ValueReader) -> Observed | None:
    if facts.base_positions is None or facts.draft_step is None or facts.max_model_len is None:
        return None
    base = reader.device(facts.base_positions)
    pos = reader.device(facts.positions)
    seq = reader.device(facts.meta.seq_lens)
    if base is None or pos is None or seq is None:
        return None
    n = facts.num_reqs
    want = [min(p + facts.draft_step, facts.max_model_len - 1) for p in base[:n]]
    if pos[:n] != want or seq[:n] != [p + 1 for p in want]:
        return {"step": facts.draft_step, "positions": pos[:n], "expected positions": want, "seq_lens": seq[:n]}
    return None


@invariant(
    "AR-9",
    "The autoregressive draft ids are a 2-D integer tensor with K columns (their row count is PROP-1's).",
    tag=Tag.S,
    subject=Subject.PROPOSAL,
    step_kinds=DECODE,
    likely_cause="K was taken from another config, or the drafts were stacked per step (K, rows) or kept as "
    "probabilities instead of token ids",
)
def ar_9(facts: ProposalFacts, _: ValueReader) -> Observed | None:
    ids = facts.draft_token_ids
    shape = tuple(ids.shape)
    integer = not ids.dtype.is_floating_point and not ids.dtype.is_complex and ids.dtype != torch.bool
    if len(shape) != 2 or shape[1] != facts.num_spec_tokens or not integer:
        return {"draft_token_ids.shape": shape, "dtype": str(ids.dtype), "K": facts.num_spec_tokens}
    return None
