"""VER-*: the rejection sampler's inputs are distributions of the right shape, and its output is well-formed.

The [D] checks of the inputs (VER-5 to VER-7) run once, before sampling: the
check after sampling sees the same inputs and skips them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from contracts.metadata import REJECTED_TOKEN_ID
from contracts.registry import Observed, StepKind, Subject, Tag, ValueReader, invariant

if TYPE_CHECKING:
    from contracts.facts import VerifierFacts

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
