"""VER-*: the rejection sampler's inputs are distributions of the right shape, and its output is well-formed.

The [D] checks of the inputs (VER-5 to VER-7) run once, before sampling: the
check after sampling sees the same inputs and skips them.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import torch

from contracts.metadata import REJECTED_TOKEN_ID
from contracts.registry import Observed, StepKind, Subject, Tag, ValueReader, invariant

if TYPE_CHECKING:
    from contracts.evidence import ProposalSourceEvidence
    from contracts.facts import ForwardOutputFacts, ProposalFacts, VerifierFacts

VERIFY = {StepKind.VERIFY}
PROPOSAL_ATOL = 1e-5
"""Largest per-entry gap between two probability vectors still taken as the same distribution (fp32)."""
PROPOSAL_SUM_ATOL = 1e-2
"""Largest |sum - 1| of a proposal slot still taken as normalised (VER-6).

A float32 softmax sums to 1 within about 1e-6; a proposal rounded to bfloat16 on
its way (8 significant bits, relative rounding error at most 2^-8 per entry)
within 4e-3. An unnormalised proposal (top-k or top-p masked without
renormalising, a scaled copy) is off by the mass it lost, typically far more.
"""
MAX_LISTED = 8
"""Longest list of requests or slots a message shows; the rest is counted."""


def _output_values(facts: VerifierFacts, reader: ValueReader) -> tuple[list[Any], list[Any]] | None:
    """(output rows, num_accepted): the caller's host copy in every mode, else the device tensors in ``full``."""
    if facts.host_output is not None:
        rows, acc = facts.host_output
        return [list(r) for r in rows], list(acc)
    out = facts.verifier_output
    if out is None:
        return None
    rows_d, acc_d = reader.device(out.output_token_ids), reader.device(out.num_accepted)
    if rows_d is None or acc_d is None:
        return None
    return rows_d, acc_d


@invariant(
    "VER-1",
    "Output rows are (num_reqs, K + 1), num_accepted_r >= 0, the token after the accepted drafts is a token id in "
    "[0, vocab), and entries past it hold the sentinel.",
    tag=Tag.SD,
    subject=Subject.VERIFIER,
    step_kinds=VERIFY,
    likely_cause="the bonus token was dropped, or unused slots were left uninitialised",
    accepts="a row all sentinel with num_accepted 0: no token could be drawn (non-finite target logits, VER-5), "
    "which the engine reports as NonFiniteLogitsError; an accepted count past num_draft_r is VER-2's",
)
def ver_1(facts: VerifierFacts, reader: ValueReader) -> Observed | None:
    out = facts.verifier_output
    if out is None:
        return None
    shape = tuple(out.output_token_ids.shape)
    if shape != (facts.num_reqs, facts.num_spec_tokens + 1) or out.num_accepted.shape[0] != facts.num_reqs:
        return {"output shape": shape, "expected": (facts.num_reqs, facts.num_spec_tokens + 1)}
    values = _output_values(facts, reader)
    if values is None:
        return None
    vocab = facts.verifier_input.target_logits.shape[-1]
    for r, (row, a) in enumerate(zip(*values, strict=True)):
        if a > facts.num_draft_tokens[r]:
            continue  # more accepted than drafted: VER-2 names it (a sentinel accepted), not a dropped bonus
        if a == 0 and all(t == REJECTED_TOKEN_ID for t in row):
            continue  # no token could be drawn: VER-5 / NonFiniteLogitsError
        if a < 0 or not 0 <= row[a] < vocab or any(t != REJECTED_TOKEN_ID for t in row[a + 1 :]):
            return {
                "request": r,
                "num_accepted": a,
                "num_draft": facts.num_draft_tokens[r],
                "output row": _cut(row),
                "vocab": vocab,
            }
    return None


@invariant(
    "VER-2",
    "No request accepts more drafts than it has (num_accepted_r <= num_draft_r), and no accepted draft is a padded, "
    "sentinel or out-of-vocabulary id.",
    tag=Tag.SD,
    subject=Subject.VERIFIER,
    step_kinds=VERIFY,
    likely_cause="draft slots past num_draft_r were compared with the target instead of being masked",
)
def ver_2(facts: VerifierFacts, reader: ValueReader) -> Observed | None:
    """Read from the engine's host copy in every mode; from the device tensors in ``full`` otherwise."""
    values = _output_values(facts, reader)
    if values is None:
        return None
    vocab = facts.verifier_input.target_logits.shape[-1]
    drafts = reader.device(facts.verifier_input.draft_token_ids)  # what was drafted: a pad inside num_draft_r too
    for r, (row, a) in enumerate(zip(*values, strict=True)):
        accepted = row[: max(a, 0)] + (drafts[r][: max(a, 0)] if drafts is not None else [])
        if a > facts.num_draft_tokens[r] or any(not 0 <= t < vocab for t in accepted):
            return {
                "request": r,
                "num_accepted": a,
                "num_draft": facts.num_draft_tokens[r],
                "accepted ids": _cut(row[: max(a, 0)]),
                "draft row": None if drafts is None else _cut(drafts[r]),
                "vocab": vocab,
            }
    return None


@invariant(
    "VER-3",
    "The proposal distribution handed to the sampler is the one each draft token was drawn from.",
    tag=Tag.SD,
    subject=Subject.VERIFIER,
    step_kinds=VERIFY,
    likely_cause="the backbone distribution was passed instead of the corrected (e.g. Markov) one the drafts came from",
)
def ver_3(facts: VerifierFacts, reader: ValueReader) -> Observed | None:
    """[S] both present or both absent, with one shape; [D] equal values on every drafted slot (shapes: VER-4)."""
    given, drawn = facts.verifier_input.draft_probs, facts.sampled_from
    if given is None and drawn is None:
        return None
    if given is None or drawn is None or given.shape != drawn.shape:
        return {
            "given proposal": None if given is None else tuple(given.shape),
            "drawn from": None if drawn is None else tuple(drawn.shape),
            "problem": "the proposal handed over and the one drawn from differ in presence or shape",
        }
    if given is drawn or not reader.allow_device or facts.verifier_output is not None:
        return None  # the values are compared once, before sampling
    if _proposal_shape_error(facts) is not None:
        return None
    # One reduction on the device, then a (num_reqs, K) read: the distributions are vocab-wide.
    differs = reader.device((given.float() - drawn.float()).abs().amax(dim=-1) > PROPOSAL_ATOL)
    if differs is None:
        return None
    for r, row in enumerate(differs):
        slots = [j for j, flag in enumerate(row[: facts.num_draft_tokens[r]]) if flag]
        if slots:
            gap = float((given[r, slots[0]].float() - drawn[r, slots[0]].float()).abs().max())
            return {
                "request": r,
                "draft slots": slots,
                "max |given - drawn|": round(gap, 6),
                "problem": "the proposal handed over is not the distribution the draft was drawn from",
            }
    return None


# -- shapes and dtypes ----------------------------------------------------------------------------------------------


def _is_tensor(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "dim")


def _is_float(x: Any) -> bool:
    return bool(x.dtype.is_floating_point)


def _is_integer(x: Any) -> bool:
    return not x.dtype.is_floating_point and not x.dtype.is_complex and str(x.dtype) != "torch.bool"


def _input_shape_error(facts: VerifierFacts) -> Observed | None:
    """What is wrong with the ids' and logits' shape or dtype, or None."""
    inp = facts.verifier_input
    ids, logits = inp.draft_token_ids, inp.target_logits
    expected_ids = (facts.num_reqs, facts.num_spec_tokens)
    if not _is_tensor(ids) or tuple(ids.shape) != expected_ids or not _is_integer(ids):
        return {
            "draft_token_ids": _describe(ids),
            "expected": f"an integer tensor of shape {expected_ids} (num_reqs, K)",
            "likely_cause": "draft ids were sized for another K or batch, or carried as floats (probabilities, "
            "logits) instead of token ids",
        }
    if not _is_tensor(logits) or logits.dim() != 2 or logits.shape[-1] < 1 or not _is_float(logits):
        return {
            "target_logits": _describe(logits),
            "expected": "a floating-point tensor of shape (rows, vocab >= 1)",
            "likely_cause": "sampled token ids or per-request logits (num_reqs, K + 1, vocab) were handed over "
            "instead of one logits row per verified position",
        }
    return None


def _proposal_shape_error(facts: VerifierFacts) -> Observed | None:
    """What is wrong with draft_probs' or sampled_from's shape or dtype, or None (absent ones are VER-3's)."""
    if _input_shape_error(facts) is not None:
        return None
    expected = (facts.num_reqs, facts.num_spec_tokens, facts.verifier_input.target_logits.shape[-1])
    for name, t in (("draft_probs", facts.verifier_input.draft_probs), ("sampled_from", facts.sampled_from)):
        if t is not None and (not _is_tensor(t) or tuple(t.shape) != expected or not _is_float(t)):
            return {name: _describe(t), "expected": f"a floating-point tensor of shape {expected} (num_reqs, K, vocab)"}
    return None


def _describe(x: Any) -> str:
    if not _is_tensor(x):
        return type(x).__name__
    return f"{x.dtype} tensor of shape {tuple(x.shape)}"


@invariant(
    "VER-4",
    "Draft ids are an integer (num_reqs, K) tensor, target logits a floating-point (rows, vocab) tensor, and "
    "draft_probs and sampled_from, when given, floating-point (num_reqs, K, vocab) tensors over the target's vocabulary.",
    tag=Tag.S,
    subject=Subject.VERIFIER,
    step_kinds=VERIFY,
    likely_cause="a proposal buffer was allocated like the draft ids (new_zeros on an integer tensor truncates every "
    "probability to 0), or sized for another K or another (draft) vocabulary",
)
def ver_4(facts: VerifierFacts, _: ValueReader) -> Observed | None:
    return _input_shape_error(facts) or _proposal_shape_error(facts)


# -- values: the distributions ----------------------------------------------------------------------------------------


def _checked_before_sampling(facts: VerifierFacts, reader: ValueReader) -> bool:
    """The [D] input checks run once (before sampling), on inputs VER-4 accepts."""
    return (
        reader.allow_device
        and facts.verifier_output is None
        and _input_shape_error(facts) is None
        and _proposal_shape_error(facts) is None
        and len(list(facts.num_draft_tokens)) == facts.num_reqs
        and all(0 <= int(d) <= facts.num_spec_tokens for d in facts.num_draft_tokens)
    )


def _cut(items: list[Any]) -> list[Any] | str:
    """A list short enough for a message, with a count of what was left out."""
    if len(items) <= MAX_LISTED:
        return items
    return f"{items[:MAX_LISTED]} and {len(items) - MAX_LISTED} more"


@invariant(
    "VER-5",
    "The target logits hold no NaN or +inf, and every row has a finite entry.",
    tag=Tag.D,
    subject=Subject.VERIFIER,
    step_kinds=VERIFY,
    likely_cause="the target model produced non-finite values (a NaN or uninitialised weight, an overflow in "
    "half precision, an attention row with no key), or a mask removed every token",
    accepts="-inf entries: a masked token (a padded vocabulary, a grammar mask), as long as its row keeps a finite one",
)
def ver_5(facts: VerifierFacts, reader: ValueReader) -> Observed | None:
    if not _checked_before_sampling(facts, reader):
        return None
    logits = facts.verifier_input.target_logits
    # amax propagates NaN, is +inf with any +inf and -inf only when every entry is -inf.
    finite = reader.device(logits.amax(dim=-1).isfinite())
    if finite is None or all(finite):
        return None
    owner = [(r, j) for r, d in enumerate(facts.num_draft_tokens) for j in range(int(d) + 1)]
    bad = [i for i, ok in enumerate(finite) if not ok]
    first = logits[bad[0]]
    found = {
        "NaN entries": int(first.isnan().sum()),
        "+inf entries": int((first == float("inf")).sum()),
        "finite entries": int(first.isfinite().sum()),
    }
    where = [owner[i] if i < len(owner) else ("?", i) for i in bad]
    return {
        "logits rows": _cut(bad),
        "(request, position)": _cut(where),
        f"row {bad[0]}": found,
        "problem": "no token can be drawn from these rows: greedy would emit an arbitrary id, sampling would fail",
    }


def _distribution_error(name: str, probs: Any, facts: VerifierFacts, reader: ValueReader) -> Observed | None:
    """The first drafted slot of ``probs`` that is not a distribution over the vocabulary, or None."""
    proper = ((probs >= 0) & (probs < float("inf"))).all(dim=-1)  # NaN fails both comparisons
    total = probs.float().sum(dim=-1)
    ok = reader.device(proper & ((total - 1.0).abs() <= PROPOSAL_SUM_ATOL))
    if ok is None:
        return None
    slots = [(r, j) for r, d in enumerate(facts.num_draft_tokens) for j in range(int(d)) if not ok[r][j]]
    if not slots:
        return None
    r, j = slots[0]
    row = probs[r, j].float()
    return {
        "tensor": name,
        "(request, draft slot)": _cut(slots),
        f"{name}[{r}, {j}]": {
            "sum": round(float(row.nansum()), 6),
            "min": float(row.nan_to_num(nan=0.0).min()),
            "NaN entries": int(row.isnan().sum()),
            "inf entries": int(row.isinf().sum()),
        },
        "tolerance on the sum": PROPOSAL_SUM_ATOL,
    }


@invariant(
    "VER-6",
    f"On every drafted slot, draft_probs and sampled_from are distributions: finite, non-negative, and summing to 1 "
    f"within {PROPOSAL_SUM_ATOL}.",
    tag=Tag.D,
    subject=Subject.VERIFIER,
    step_kinds=VERIFY,
    likely_cause="the proposal was masked (top-k, top-p) without renormalising or scaled, or came from non-finite "
    "drafter logits (a NaN in a drafter weight); the acceptance test min(1, p/q) is then biased",
)
def ver_6(facts: VerifierFacts, reader: ValueReader) -> Observed | None:
    if not _checked_before_sampling(facts, reader):
        return None
    given, drawn = facts.verifier_input.draft_probs, facts.sampled_from
    for name, probs in (("draft_probs", given), ("sampled_from", drawn)):
        if probs is not None and (name == "draft_probs" or probs is not given):
            found = _distribution_error(name, probs, facts, reader)
            if found is not None:
                return found
    return None


@invariant(
    "VER-7",
    "Every drafted token id in the vocabulary has positive probability under draft_probs.",
    tag=Tag.D,
    subject=Subject.VERIFIER,
    step_kinds=VERIFY,
    likely_cause="draft_probs is not the distribution the drafts were sampled from (e.g. top-k/top-p applied to "
    "one but not the other)",
)
def ver_7(facts: VerifierFacts, reader: ValueReader) -> Observed | None:
    given = facts.verifier_input.draft_probs
    if given is None or not _checked_before_sampling(facts, reader):
        return None
    ids = facts.verifier_input.draft_token_ids.long()
    vocab = given.shape[-1]
    q_x = reader.device(given.gather(-1, ids.clamp(0, vocab - 1)[..., None]).squeeze(-1).float())
    id_rows = reader.device(ids)
    if q_x is None or id_rows is None:
        return None
    slots = [
        (r, j)
        for r, d in enumerate(facts.num_draft_tokens)
        for j in range(int(d))
        if 0 <= id_rows[r][j] < vocab and not q_x[r][j] > 0
    ]
    if not slots:
        return None
    r, j = slots[0]
    return {
        "(request, draft slot)": _cut(slots),
        "draft token": id_rows[r][j],
        "draft_probs at it": q_x[r][j],
        "problem": "a draft token has probability 0 under the proposal it was supposedly drawn from",
    }


# -- the drafter's side: what its forwards hand to its sampler -------------------------------------------------------

DRAFT_FORWARDS = {StepKind.DRAFT_PREFILL, StepKind.DRAFT_DECODE, StepKind.DRAFT_BLOCK, StepKind.DRAFT_HEADS}
"""Every draft forward kind: what a forward returns is checked the same way whichever produced it."""


@invariant(
    "VER-8",
    "A draft forward's logits hold no NaN or +inf on its real rows (or on the rows it scored), and every such row "
    "has a finite entry.",
    tag=Tag.D,
    subject=Subject.FORWARD_OUTPUT,
    step_kinds=DRAFT_FORWARDS,
    likely_cause="the drafter produced non-finite values (a NaN or uninitialised drafter weight, an overflow in half "
    "precision); every draft and proposal built from these rows is garbage, and sampling from them fails",
    accepts="non-finite padded rows (a padded request attends to no key) and -inf entries of a masked token",
)
def ver_8(facts: ForwardOutputFacts, reader: ValueReader) -> Observed | None:
    if not reader.allow_device:
        return None
    logits = facts.logits
    scored = facts.scored_rows
    rows = list(range(facts.num_tokens)) if scored is None else list(scored)
    if logits.dim() != 2 or logits.shape[0] < len(rows):
        return None  # the rows themselves are VER-11's, checked in every mode but off
    real = logits[: len(rows)]
    finite = reader.device(real.amax(dim=-1).isfinite())  # NaN and +inf propagate; -inf only for an all -inf row
    if finite is None or all(finite):
        return None
    bad = [i for i, ok in enumerate(finite) if not ok]
    first = real[bad[0]]
    return {
        "real rows": facts.num_tokens,
        "non-finite rows": _cut([rows[i] for i in bad]),
        f"row {rows[bad[0]]}": {
            "NaN entries": int(first.isnan().sum()),
            "+inf entries": int((first == float("inf")).sum()),
            "finite entries": int(first.isfinite().sum()),
        },
    }


@invariant(
    "VER-11",
    "A draft forward's logits hold exactly the rows it was asked to score: every model row when it named none, else "
    "one row per named row, and the named rows are real rows (below the real token count), in increasing order.",
    tag=Tag.S,
    subject=Subject.FORWARD_OUTPUT,
    step_kinds=DRAFT_FORWARDS,
    likely_cause="the drafter located the rows it samples in the padded layout (the DP pad or the CUDA-graph pad "
    "counted as tokens, so the last request's row points at padding), or its network ignored the rows it was asked "
    "for; a draft drawn from such a row is drawn from garbage",
    accepts="no scored rows at all (a step where no request samples from this forward pays no LM head)",
)
def ver_11(facts: ForwardOutputFacts, reader: ValueReader) -> Observed | None:
    del reader
    logits = facts.logits
    scored = facts.scored_rows
    if scored is None:
        if logits.dim() == 2 and logits.shape[0] >= facts.num_tokens:
            return None
        return {"logits shape": tuple(logits.shape), "real rows": facts.num_tokens, "problem": "fewer rows than tokens"}
    outside = [r for r in scored if not 0 <= r < facts.num_tokens]
    unordered = [b for a, b in itertools.pairwise(scored) if b <= a]
    if outside or unordered:
        return {
            "scored rows": _cut(list(scored)),
            "real rows": facts.num_tokens,
            "problem": "rows past the real tokens (padding)" if outside else "rows not in increasing order",
            "offending": _cut(outside or unordered),
        }
    if logits.dim() != 2 or logits.shape[0] != len(scored):
        return {
            "logits shape": tuple(logits.shape),
            "scored rows": len(scored),
            "problem": "the network did not return one logits row per scored row",
        }
    return None


def _temperature_softmax(logits: Any, temperature: float) -> Any:
    """softmax(logits / T) in float64, shifted by the row maximum (greedy rows are one-hot, handled apart)."""
    x = logits.double()
    return ((x - x.amax(dim=-1, keepdim=True)) / temperature).softmax(dim=-1)


def _slot_against_definition(q: Any, logits: Any, temperature: float, truncated: bool) -> str | None:
    """Why ``q`` (one slot's reported proposal) is not what ``logits`` give under these settings, or None.

    Untruncated rows must equal softmax(logits / T). A top-k / top-p row must be
    that softmax restricted to the tokens it keeps and renormalised, and the tokens
    kept must be the most likely ones: no dropped token has a larger logit than a
    kept one. (Which cut top-k / top-p makes is not restated here: a boundary tie
    would make an exact restatement brittle.) A slot that is not a distribution
    at all is left to VER-6, which names that cause.
    """
    q = q.double()
    if not bool(((q >= 0) & (q < float("inf"))).all()) or abs(float(q.sum()) - 1.0) > PROPOSAL_SUM_ATOL:
        return None  # not a distribution at all: VER-6 names that, the more specific cause, at verification
    if temperature == 0.0:
        best = logits.max()
        top = int(q.argmax())
        if abs(float(q[top]) - 1.0) > PROPOSAL_ATOL or float(logits[top]) < float(best):
            return "a greedy request's proposal is not one-hot at the argmax of the drafter's logits"
        return None
    want = _temperature_softmax(logits, temperature)
    if truncated:
        kept = q > 0
        if not bool(kept.any()):
            return "a truncated proposal keeps no token"
        if bool((~kept).any()) and float(logits[~kept].max()) > float(logits[kept].min()):
            return "top-k / top-p kept a token while dropping a more likely one"
        want = torch.where(kept, want, 0.0)
        want = want / want.sum()
    gap = float((q - want).abs().max())
    if gap > PROPOSAL_ATOL:
        return f"max |reported - definition| = {gap:.3g}"
    return None


@invariant(
    "VER-9",
    "Where a drafter reports the logits its proposal came from, every drafted slot's draft_probs that is a "
    "distribution (VER-6) is their distribution under the request's sampling settings: softmax(logits / T) (one-hot argmax when greedy), restricted "
    "to the most likely tokens and renormalised under top-k / top-p.",
    tag=Tag.D,
    subject=Subject.PROPOSAL,
    step_kinds={StepKind.DRAFT_DECODE, StepKind.DRAFT_BLOCK},
    likely_cause="the drafter's sampling transform ignored a setting (the temperature, top-k or top-p) and reported "
    "the distribution it wrongly drew from; verification stays lossless, but drafts follow the wrong distribution "
    "and are rejected more often",
)
def ver_9(facts: ProposalFacts, reader: ValueReader) -> Observed | None:
    src, probs = facts.source, facts.draft_probs
    if src is None or not reader.allow_device:
        return None
    rows = len(src.num_drafts)
    if probs is None:  # argmax drafts: a one-hot proposal is lossless whatever the settings
        return None
    if (
        tuple(src.logits.shape) != tuple(probs.shape)
        or rows != probs.shape[0]
        or not (len(src.temperature) == len(src.top_k) == len(src.top_p) == rows)
    ):
        return {
            "source logits shape": tuple(src.logits.shape),
            "draft_probs shape": tuple(probs.shape),
            "per-row settings": (len(src.num_drafts), len(src.temperature), len(src.top_k), len(src.top_p)),
        }
    return _first_slot_off_definition(src, probs)


def _first_slot_off_definition(src: ProposalSourceEvidence, probs: Any) -> Observed | None:
    vocab = probs.shape[-1]
    for r, drafted in enumerate(src.num_drafts):
        t, k, p = src.temperature[r], src.top_k[r], src.top_p[r]
        truncated = (k is not None and k < vocab) or (p is not None and p < 1.0)
        for j in range(int(drafted)):
            problem = _slot_against_definition(probs[r, j], src.logits[r, j], t, truncated)
            if problem is not None:
                return {
                    "(row, draft slot)": (r, j),
                    "sampling settings": {"temperature": t, "top_k": k, "top_p": p},
                    "problem": problem,
                }
    return None


# -- the recovered token: drawn from the residual, by definition ------------------------------------------------------


@invariant(
    "VER-10",
    "Each sampled request's recovered token is drawn from max(0, p - q) normalised at the slot where it stopped (p "
    "itself where that residual has no mass), with q the proposal of the rejected draft as handed to the verifier "
    "(zero at the bonus or an unusable slot).",
    tag=Tag.D,
    subject=Subject.VERIFIER,
    step_kinds=VERIFY,
    likely_cause="the residual was built with the wrong sign (q - p), not clamped or not normalised, or took q from "
    "another slot than the rejected draft's; the output then no longer follows the target's distribution",
)
def ver_10(facts: VerifierFacts, reader: ValueReader) -> Observed | None:
    out = facts.verifier_output
    rec = None if out is None else out.recovery
    if rec is None or not reader.allow_device:
        return None
    p, q, dist = rec.target, rec.proposal, rec.distribution
    n = rec.rows.shape[0]
    if p.dim() != 2 or p.shape != q.shape or p.shape != dist.shape or p.shape[0] != n or rec.position.shape[0] != n:
        return {
            "shapes (rows, position, target, proposal, distribution)": [
                tuple(t.shape) for t in (rec.rows, rec.position, p, q, dist)
            ]
        }
    # The definition, with the verifier's own operations and dtype, so a correct one matches it exactly.
    residual = (p - q).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    want = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p)
    off = reader.device((dist - want).abs().amax(dim=-1) > PROPOSAL_ATOL)
    rows, pos = reader.device(rec.rows), reader.device(rec.position)
    if off is None or rows is None or pos is None:
        return None
    wrong = [(rows[i], pos[i]) for i, bad in enumerate(off) if bad]
    if wrong:
        i = off.index(True)
        return {
            "(request, slot)": _cut(wrong),
            "max |distribution - normalised max(0, p - q)|": round(float((dist[i] - want[i]).abs().max()), 6),
            "problem": "the recovered token was not drawn from the residual of the target and the proposal",
        }
    return _proposal_not_the_rejected_drafts(facts, rows, pos, q, reader)


def _proposal_not_the_rejected_drafts(
    facts: VerifierFacts, rows: list[int], pos: list[int], q: Any, reader: ValueReader
) -> Observed | None:
    """The first row whose q is neither zero nor the handed-over proposal of its rejected draft, or None."""
    given, ids = facts.verifier_input.draft_probs, facts.verifier_input.draft_token_ids
    vocab = q.shape[-1]
    for i, (r, j) in enumerate(zip(rows, pos, strict=True)):
        if not 0 <= r < facts.num_reqs or not 0 <= j <= facts.num_spec_tokens:
            return {"recovery row": i, "(request, slot)": (r, j), "problem": "no such request or slot"}
        if j >= int(facts.num_draft_tokens[r]) or not bool(q[i].any()):
            if bool(q[i].any()):
                return {"(request, slot)": (r, j), "problem": "a proposal at the bonus position, which has no draft"}
            continue
        expected = (
            given[r, j].to(q.dtype)
            if given is not None
            else torch.nn.functional.one_hot(ids[r, j].long().clamp(0, vocab - 1), vocab).to(q.dtype)
        )
        gap = float((q[i] - expected).abs().max())
        if gap > PROPOSAL_ATOL:
            return {
                "(request, slot)": (r, j),
                "max |q used - draft_probs at the slot|": round(gap, 6),
                "problem": "the residual subtracted another q than the rejected draft's proposal",
            }
    return None
