"""The lossless verifier: greedy matching and rejection sampling over a batch of drafts.

Sampled requests use the speculative-sampling rule (Leviathan et al. 2023,
Chen et al. 2023): draft ``x_k`` drawn from ``q_k`` is accepted with probability
``min(1, p_k(x_k) / q_k(x_k))``; at the first rejection one token is drawn from
``normalize(max(0, p_k − q_k))``; after every draft is accepted the bonus token
is drawn from the bonus row's ``p``. The emitted tokens are then distributed
exactly as if they had been sampled from the target one by one. Greedy requests
(temperature 0) accept while the draft equals the target argmax and emit the
argmax at the first mismatch, which is plain greedy decoding token for token.

Contracts are checked at the boundary (TGT-6 and VER-3 before sampling, VER-1
and VER-2 on the result), so a caller cannot skip them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

import contracts
from contracts import REJECTED_TOKEN_ID, StepKind, Subject, VerifierFacts, VerifierInput, VerifierOutput
from contracts.registry import ValueReader, violation
from specdec.sampling import SamplingParams, probabilities, sample

__all__ = ["verify"]


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
    the drafter actually drew from, compared with it by VER-3.
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
    greedy = [p.greedy for p in params]
    if any(greedy):
        g = torch.tensor([r for r, is_greedy in enumerate(greedy) if is_greedy], device=device)
        num_accepted[g], recovered[g] = _verify_greedy(logits, row_index[g], drafts[g], valid[g])
    if not all(greedy):
        s = torch.tensor([r for r, is_greedy in enumerate(greedy) if not is_greedy], device=device)
        row_params = [p for p, d in zip(params, num_draft_tokens, strict=True) for _ in range(d + 1)]
        target_probs = probabilities(logits, row_params)
        draft_probs = None if inp.draft_probs is None else inp.draft_probs[s]
        num_accepted[s], recovered[s] = _verify_sampled(
            target_probs[row_index[s]], safe_drafts[s], valid[s], draft_probs, generator, s, component
        )

    padded_drafts = torch.cat([drafts, drafts.new_full((num_reqs, 1), REJECTED_TOKEN_ID)], dim=1)
    accepted = num_accepted[:, None]
    output_token_ids = torch.where(
        positions[None, :] < accepted,
        padded_drafts,
        torch.where(positions[None, :] == accepted, recovered[:, None], REJECTED_TOKEN_ID),
    )
    out = VerifierOutput(output_token_ids=output_token_ids, num_accepted=num_accepted)
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
    requests: Int[Tensor, " n"],
    component: str,
) -> tuple[Int[Tensor, " n"], Int[Tensor, " n"]]:
    """Rejection sampling; ``drafts`` are in-vocabulary everywhere (invalid slots hold 0, masked by ``valid``)."""
    n, k = drafts.shape
    vocab = p.shape[-1]
    if draft_probs is None:
        q = torch.nn.functional.one_hot(drafts, vocab).to(p.dtype)
    else:
        q = draft_probs.to(p.dtype)
    p_x = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    q_x = q.gather(-1, drafts[..., None]).squeeze(-1)
    impossible = valid & (q_x <= 0)
    _check_drawn_tokens_possible(impossible, requests, component)

    # u < p/q without dividing: u·q < p. p >= q accepts surely (u < 1); p == 0 never does.
    u = torch.rand((n, k), generator=generator, device=p.device, dtype=p.dtype)
    num_accepted = _leading_true(valid & ~impossible & (u * q_x < p_x))

    rows = torch.arange(n, device=p.device)
    p_at = p[rows, num_accepted]
    # The proposal at the stopping position: the rejected draft's q, or nothing when
    # there was no draft there (bonus, or a pad/invalid id), which makes the
    # residual p itself.
    has_draft = torch.cat([valid, valid.new_zeros((n, 1))], dim=1)[rows, num_accepted]
    q_padded = torch.cat([q, q.new_zeros((n, 1, vocab))], dim=1)
    q_at = torch.where(has_draft[:, None], q_padded[rows, num_accepted], 0.0)
    residual = (p_at - q_at).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    # An all-zero residual means p <= q everywhere, i.e. p == q up to rounding, where a
    # rejection has probability ~0; fall back to p rather than divide by zero.
    dist = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p_at)
    return num_accepted, sample(dist, generator)


def _check_drawn_tokens_possible(impossible: Bool[Tensor, "n k"], requests: Int[Tensor, " n"], component: str) -> None:
    """A draft with q(x) == 0 cannot have been drawn from q: VER-3, never a silent accept.

    Reading the mask needs the values, so it follows the enforcement modes: host
    tensors in ``shapes`` and ``full``, device tensors in ``full`` only (not while
    capturing a CUDA graph). Unchecked, such a draft is rejected, not accepted.
    """
    mode = contracts.current_mode()
    if mode is contracts.Mode.OFF:
        return
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    reader = ValueReader(allow_device=mode is contracts.Mode.FULL and not capturing)
    flags = reader.device(impossible.any(dim=1))
    if not flags or not any(flags):
        return
    ids = reader.device(requests) or []
    bad = [ids[i] for i, flag in enumerate(flags) if flag]
    raise violation(
        "VER-3",
        {"requests": bad, "problem": "a draft token has probability 0 under the proposal it was supposedly drawn from"},
        step_kind=StepKind.VERIFY,
        component=component,
        likely_cause="draft_probs is not the distribution the drafts were sampled from (e.g. top-k/top-p applied to one but not the other)",
    )
