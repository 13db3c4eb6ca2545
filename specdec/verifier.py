"""The lossless verifier: greedy matching and rejection sampling over a batch of drafts.

Sampled requests use the speculative-sampling rule (Leviathan et al. 2023,
Chen et al. 2023): draft ``x_k`` drawn from ``q_k`` is accepted with probability
``min(1, p_k(x_k) / q_k(x_k))``; at the first rejection one token is drawn from
``normalize(max(0, p_k − q_k))``; after every draft is accepted the bonus token
is drawn from the bonus row's ``p``. The emitted tokens are then distributed
exactly as if they had been sampled from the target one by one. Greedy requests
(temperature 0) accept while the draft equals the target argmax and emit the
argmax at the first mismatch, which is plain greedy decoding token for token.

Contracts are checked at the boundary (TGT-6 and VER-3 to VER-7 before
sampling, VER-1 and VER-2 on the result), so a caller cannot skip them.

Without the checks (mode ``off``, or ``shapes`` for the [D] ones) two faults are
still handled without a device sync. A proposal slot that is not a distribution
(a NaN, an infinite or a negative entry) or gives its draft no mass is not used:
its draft is rejected and the token drawn from ``p``, which keeps the output
distributed as the target's. A request whose target logits hold NaN or +inf, or
no finite entry, emits nothing: its output row is all ``REJECTED_TOKEN_ID``
(``num_accepted`` 0), where a greedy argmax would have emitted an arbitrary id
and sampling would have failed; the engine raises :class:`NonFiniteLogitsError`
naming the request. A proposal that does not sum to 1 is only seen by VER-6.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

import contracts
from contracts import (
    REJECTED_TOKEN_ID,
    RecoveryEvidence,
    StepKind,
    Subject,
    VerifierFacts,
    VerifierInput,
    VerifierOutput,
)
from contracts.enforcement import host_violation
from specdec.sampling import SamplingParams, probabilities, sample

__all__ = ["MalformedVerifierOutputError", "NonFiniteLogitsError", "check_verified", "verify"]


class NonFiniteLogitsError(RuntimeError):
    """No token can be drawn for a request: its target logits hold NaN or +inf, or mask every token."""

    def __init__(self, req_id: str) -> None:
        self.req_id = req_id
        super().__init__(
            f"request {req_id!r}: the target's logits at its verified positions hold NaN or +inf, or no finite "
            "entry, so no token can be drawn (the verifier emitted none). Run with SPECDEC_CONTRACTS=full to have "
            "VER-5 name the rows; the usual cause is a non-finite target model (a NaN weight, a half-precision overflow)"
        )


class MalformedVerifierOutputError(RuntimeError):
    """A verification result that breaks VER-1 or VER-2 while contracts are ``off``: an id the next step would embed."""

    def __init__(self, violation: contracts.ContractViolation) -> None:
        self.invariant_id = violation.invariant_id
        self.violation = violation
        super().__init__(
            f"{violation} (raised with contracts off: the host copy of the result is checked in every mode)"
        )


HOST_CHECKED = frozenset({"VER-1", "VER-2"})
"""What ``check_verified`` reads from the caller's host copy."""


def check_verified(
    inp: VerifierInput,
    out: VerifierOutput,
    host_tokens: Sequence[Sequence[int]],
    host_accepted: Sequence[int],
    *,
    num_spec_tokens: int,
    num_draft_tokens: Sequence[int],
    component: str = "verifier",
) -> None:
    """VER-1 and VER-2 on a host copy of ``verify``'s result, before the caller uses it: in every mode.

    A caller that copies the result to the host anyway (the engine) gets these
    for free, before a bad id reaches an embedding (a device-side crash) or the
    output. With contracts on a broken one is the registry's ``ContractViolation``
    (VER-1 before VER-2, which do not overlap: more accepted than drafted, or a
    sentinel or out-of-vocabulary draft accepted, is VER-2's); with contracts
    ``off`` the same checks raise :class:`MalformedVerifierOutputError`.
    """
    num_reqs = len(host_accepted)
    facts = VerifierFacts(
        num_reqs, num_spec_tokens, num_draft_tokens, inp, out, host_output=(host_tokens, host_accepted)
    )
    # Only VER-1 and VER-2: ``verify`` checked everything else already, on the same inputs.
    found = host_violation(Subject.VERIFIER, facts, step_kind=StepKind.VERIFY, component=component, only=HOST_CHECKED)
    if found is None:
        return
    if contracts.current_mode() is contracts.Mode.OFF:
        raise MalformedVerifierOutputError(found)
    raise found


def verify(
    inp: VerifierInput,
    params: Sequence[SamplingParams],
    *,
    num_spec_tokens: int,
    num_draft_tokens: Sequence[int],
    generator: torch.Generator | None = None,
    sampled_from: Float[Tensor, "num_reqs num_spec_tokens vocab"] | None = None,
    component: str = "verifier",
) -> VerifierOutput:
    """Verify every request's drafts against the target logits; one call per step.

    ``inp.target_logits`` holds ``num_draft_tokens[r] + 1`` rows per request,
    request-major (drafts, then the bonus row). ``inp.draft_token_ids`` is
    ``(num_reqs, num_spec_tokens)`` with entries past ``num_draft_tokens[r]``
    set to ``REJECTED_TOKEN_ID``; a negative or out-of-vocabulary draft id is
    never accepted. ``inp.draft_probs`` is the proposal each draft was drawn
    from, ``None`` for deterministic (one-hot) drafts; ``sampled_from`` is what
    the drafter actually drew from, compared with it by VER-3. A request whose
    target logits are not finite gets an all-sentinel row (module docstring).
    """
    num_reqs = inp.draft_token_ids.shape[0]
    facts = VerifierFacts(num_reqs, num_spec_tokens, num_draft_tokens, inp, None, sampled_from)
    contracts.check(Subject.VERIFIER, facts, step_kind=StepKind.VERIFY, component=component)
    _validate(inp, params, num_reqs, num_spec_tokens, num_draft_tokens)

    logits, drafts = inp.target_logits, inp.draft_token_ids.long()
    device, vocab, k = logits.device, logits.shape[-1], num_spec_tokens
    counts = torch.tensor(list(num_draft_tokens), dtype=torch.long, device=device)
    first_rows = torch.cumsum(counts + 1, dim=0) - (counts + 1)
    positions = torch.arange(k + 1, device=device)
    # Row of position j of request r; positions past the request's drafts map to its
    # bonus row, which keeps every gather in range (those positions are masked anyway).
    row_index = first_rows[:, None] + torch.minimum(positions[None, :], counts[:, None])
    valid = (positions[None, :k] < counts[:, None]) & (drafts >= 0) & (drafts < vocab)
    safe_drafts = torch.where(valid, drafts, 0)

    num_accepted = torch.zeros(num_reqs, dtype=torch.long, device=device)
    recovered = torch.zeros(num_reqs, dtype=torch.long, device=device)
    recovery = None
    # amax is NaN with any NaN, +inf with any +inf, -inf only when every entry is: finite iff a token can be drawn.
    finite_rows = logits.amax(dim=-1).isfinite()
    drawable = finite_rows[row_index].all(dim=1)
    greedy = [p.greedy for p in params]
    if any(greedy):
        g = torch.tensor([r for r, is_greedy in enumerate(greedy) if is_greedy], device=device)
        num_accepted[g], recovered[g] = _verify_greedy(logits, row_index[g], drafts[g], valid[g])
    if not all(greedy):
        s = torch.tensor([r for r, is_greedy in enumerate(greedy) if not is_greedy], device=device)
        row_params = [p for p, d in zip(params, num_draft_tokens, strict=True) for _ in range(d + 1)]
        target_probs = probabilities(logits, row_params)
        # Rows no token can be drawn from become uniform, so sampling runs; their requests emit nothing below.
        # In place: the probabilities are this call's own, and a vocabulary-wide copy costs ~0.2 ms at 8 rows.
        target_probs.masked_fill_(~finite_rows[:, None], 1.0 / vocab)
        # Only the slots some request drafted: a step that drafts little (the adaptive length, probes) or
        # nothing must not pay K vocabulary-wide slots per request. Slots past every count are invalid anyway.
        width = max(num_draft_tokens, default=0)
        draft_probs = None if inp.draft_probs is None else inp.draft_probs[s, :width]
        slots = row_index[s, : width + 1]
        # index_select, not advanced indexing: the same rows at about half the cost on a CPU.
        p = target_probs.index_select(0, slots.reshape(-1)).view(*slots.shape, vocab)
        num_accepted[s], recovered[s], recovery = _verify_sampled(
            p, safe_drafts[s, :width], valid[s, :width], draft_probs, generator
        )
        recovery = dataclasses.replace(recovery, rows=s)
    num_accepted = torch.where(drawable, num_accepted, 0)
    recovered = torch.where(drawable, recovered, REJECTED_TOKEN_ID)

    padded_drafts = torch.cat([drafts, drafts.new_full((num_reqs, 1), REJECTED_TOKEN_ID)], dim=1)
    accepted = num_accepted[:, None]
    output_token_ids = torch.where(
        positions[None, :] < accepted,
        padded_drafts,
        torch.where(positions[None, :] == accepted, recovered[:, None], REJECTED_TOKEN_ID),
    )
    out = VerifierOutput(output_token_ids=output_token_ids, num_accepted=num_accepted, recovery=recovery)
    facts = VerifierFacts(num_reqs, num_spec_tokens, num_draft_tokens, inp, out, sampled_from)
    contracts.check(Subject.VERIFIER, facts, step_kind=StepKind.VERIFY, component=component)
    return out


def _validate(
    inp: VerifierInput,
    params: Sequence[SamplingParams],
    num_reqs: int,
    num_spec_tokens: int,
    num_draft_tokens: Sequence[int],
) -> None:
    """Host-only shape checks that hold in every mode, so mode ``off`` fails loudly instead of mis-indexing."""
    if len(params) != num_reqs:
        raise ValueError(f"got {len(params)} SamplingParams for {num_reqs} requests; pass one per request")
    if num_spec_tokens < 0 or tuple(inp.draft_token_ids.shape) != (num_reqs, num_spec_tokens):
        raise ValueError(
            f"draft_token_ids has shape {tuple(inp.draft_token_ids.shape)}, expected ({num_reqs}, {num_spec_tokens})"
        )
    drafts = list(num_draft_tokens)
    rows = inp.target_logits.shape[0]
    if (
        len(drafts) != num_reqs
        or any(not 0 <= d <= num_spec_tokens for d in drafts)
        or rows != sum(drafts) + len(drafts)
    ):
        raise ValueError(
            f"target_logits has {rows} rows for num_draft_tokens={drafts} with K={num_spec_tokens} (TGT-6)"
        )
    if inp.draft_probs is not None:
        expected = (num_reqs, num_spec_tokens, inp.target_logits.shape[-1])
        if tuple(inp.draft_probs.shape) != expected:
            raise ValueError(f"draft_probs has shape {tuple(inp.draft_probs.shape)}, expected {expected}")


def _leading_true(mask: Bool[Tensor, "n k"]) -> Int[Tensor, " n"]:
    """Length of each row's all-True prefix: the number of accepted drafts."""
    return mask.long().cumprod(dim=1).sum(dim=1)


def _verify_greedy(
    logits: Float[Tensor, "rows vocab"],
    row_index: Int[Tensor, "n k_plus_one"],
    drafts: Int[Tensor, "n k"],
    valid: Bool[Tensor, "n k"],
) -> tuple[Int[Tensor, " n"], Int[Tensor, " n"]]:
    """Accept while the draft is the target argmax; emit the argmax where that stops."""
    target = logits.argmax(dim=-1)[row_index]
    num_accepted = _leading_true(valid & (drafts == target[:, :-1]))
    return num_accepted, target.gather(1, num_accepted[:, None]).squeeze(1)


def _verify_sampled(
    p: Float[Tensor, "n k_plus_one vocab"],
    drafts: Int[Tensor, "n k"],
    valid: Bool[Tensor, "n k"],
    draft_probs: Float[Tensor, "n k vocab"] | None,
    generator: torch.Generator | None,
) -> tuple[Int[Tensor, " n"], Int[Tensor, " n"], RecoveryEvidence]:
    """Rejection sampling; ``drafts`` are in-vocabulary everywhere (invalid slots hold 0, masked by ``valid``).

    Returns the accepted counts, the recovered tokens and what they were drawn
    from (``rows`` is local here; ``verify`` maps it to the batch's requests).
    """
    n, k = drafts.shape
    vocab = p.shape[-1]
    q: Tensor | None = None
    if draft_probs is None:
        # One-hot proposals are never built vocabulary-wide: q is 1 at each draft, and only the rejected
        # draft's row is needed below.
        q_x = torch.ones((n, k), dtype=p.dtype, device=p.device)
        usable = valid
    else:
        q = draft_probs.to(p.dtype)
        # A slot whose q is not a distribution (NaN fails both comparisons), or gives its own draft
        # no mass, cannot have produced the draft: it is not used, like a slot without a draft.
        # Two reductions rather than two vocabulary-wide masks and their conjunction; NaN propagates through both.
        low, high = torch.aminmax(q, dim=-1)
        proper = (low >= 0) & (high < float("inf"))
        q_x = q.gather(-1, drafts[..., None]).squeeze(-1)
        usable = valid & proper & (q_x > 0)
    p_x = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)

    # u < p/q without dividing: u·q < p. p >= q accepts surely (u < 1); p == 0 never does.
    u = torch.rand((n, k), generator=generator, device=p.device, dtype=p.dtype)
    num_accepted = _leading_true(usable & (u * q_x < p_x))

    rows = torch.arange(n, device=p.device)
    # p at each stopping slot; with no slots to stop at that is the bonus row, a view of no copy.
    p_at = p[:, 0] if k == 0 else p.reshape(n * (k + 1), vocab).index_select(0, rows * (k + 1) + num_accepted)
    # The proposal at the stopping position: the rejected draft's q, or nothing when
    # there was no usable draft there (bonus, a pad/invalid id, a broken proposal
    # slot), which makes the residual p itself: the token then follows p exactly.
    if k:
        has_draft = torch.cat([usable, usable.new_zeros((n, 1))], dim=1)[rows, num_accepted]
        slot = rows * k + num_accepted.clamp_max(k - 1)  # past the last draft has_draft is False: any slot will do
        if q is None:
            q_rows = torch.nn.functional.one_hot(drafts.reshape(-1).index_select(0, slot), vocab).to(p.dtype)
        else:
            q_rows = q.reshape(n * k, vocab).index_select(0, slot)
        q_at = torch.where(has_draft[:, None], q_rows, 0.0)
        residual = (p_at - q_at).clamp_min(0.0)
    else:
        # No slot has a draft (plain decoding, or a step in which nobody drafts): q is zero everywhere, so the
        # residual is p, bit for bit, without building, indexing and subtracting vocabulary-wide zeros (about
        # 1.5 ms a step at 8 rows of 49k on a CPU). The evidence's proposal is a zero view of no memory.
        q_at = p_at.new_zeros(()).expand(n, vocab)
        residual = p_at.clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    # An all-zero residual means p <= q everywhere, i.e. p == q up to rounding, where a
    # rejection has probability ~0; fall back to p rather than divide by zero.
    dist = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p_at)
    return num_accepted, sample(dist, generator), RecoveryEvidence(rows, num_accepted, p_at, q_at, dist)
