"""The DSpark backend: a DFlash block forward in the "anchor first" layout, then a Markov loop and capacities.

Per drafting request the block ``[anchor, MASK x (K-1)]`` sits at ``s .. s+K-1``
(``s = P + 1``, the anchor being the bonus just sampled) and slot i proposes
the token at ``s + i + 1``, so ``q = K`` and every block row is sampled. The
backbone logits ``U_k`` get the Markov bias of the previous token (the anchor
for slot 0) and drafts are drawn left to right from that corrected
distribution, which is the one handed to the verifier. The confidence head's
survival picks how many of the K drafts each request proposes (a prefix),
by threshold or by a global step-cost budget; BLK-8 checks the evidence.
"""

from __future__ import annotations

from typing import Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from backends.dflash.network import DFlashNetwork
from backends.dflash.speculator import DFlashSpeculator, no_block_ran
from backends.draw import argmax_proposal, draw_drafts, draw_on_ids
from backends.dspark.capacity import StepCost, budget_capacity, prefix_mask, threshold_capacity
from backends.dspark.heads import DSparkHeads
from contracts import (
    REJECTED_TOKEN_ID,
    BlockEvidence,
    CapacityEvidence,
    ConfidenceEvidence,
    MarkovChainEvidence,
)
from specdec.sampling import SamplingParams
from specdec.speculator import DraftContext, Proposal, TargetStep

CapacityMode = Literal["full", "threshold", "budget"]
REFIT_EVERY = 16
"""Measured steps between two refits of the budget's step cost."""


class DSparkSpeculator(DFlashSpeculator):
    """Up to K drafts per request: one anchor-first block forward, a Markov loop, a capacity per request."""

    def __init__(
        self,
        network: DFlashNetwork,
        heads: DSparkHeads,
        *,
        num_spec_tokens: int,
        aux_layers: tuple[int, ...],
        name: str = "dspark",
        seed: int = 0,
        capacity: CapacityMode = "full",
        tau: float = 0.5,
        cost: StepCost | None = None,
    ) -> None:
        super().__init__(network, num_spec_tokens=num_spec_tokens, aux_layers=aux_layers, name=name, seed=seed)
        if heads.vocab_size != network.target.config.vocab_size:
            raise ValueError(
                f"DSpark heads cover {heads.vocab_size} tokens, the target {network.target.config.vocab_size}"
            )
        if capacity not in ("full", "threshold", "budget"):
            raise ValueError(f"capacity must be 'full', 'threshold' or 'budget', got {capacity!r}")
        self.heads = heads
        self.capacity = capacity
        self.tau = tau
        self.cost = cost or StepCost()
        self.measure_cost = cost is None
        """Without a given cost the budget fits one to the engine's measured step timings as they arrive."""
        self._fitted_at = 0

    block_layout = "anchor_first"

    @property
    def query_width(self) -> int:
        """Anchor first: the anchor's own row already predicts the next token, so q = K."""
        return self.num_spec_tokens

    def _sampled_rows(self, num_drafting: int) -> list[int]:
        """Every block row proposes a token (anchor first); a DP pad's rows are not scored."""
        return list(range(num_drafting * self.query_width))

    # -- one proposal ----------------------------------------------------------------------------

    @torch.no_grad()
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
        anchors = torch.tensor([step.next_token_ids[r] for r in drafting], dtype=torch.int64, device=device)
        # Explicit sizes: a rank with no drafting request (m = 0) still runs the block forward for its DP peers.
        backbone = out.logits.view(m, k, out.logits.shape[-1])  # the forward scored the sampled rows only
        hidden = out.hidden_states.view(m, k, out.hidden_states.shape[-1])
        # The engine verifies at most each request's budget: slots past the longest one are not drawn at all.
        width = max((step.draft_budget(r, k) for r in drafting), default=0)
        drawn, prev, probs, confidence = self._markov_loop(backbone, hidden, anchors, params, width)
        survival = self._survival(confidence)

        if self.capacity == "budget" and self.measure_cost:
            self._refit_cost(ctx)
        capacity = self._capacity(survival).clamp(max=width)
        mask = prefix_mask(capacity, k)
        tokens[drafting] = torch.where(mask, drawn, REJECTED_TOKEN_ID)
        draft_probs = sampled_from = handed = None
        if probs is not None:
            handed = self._verifier_proposal(probs, backbone, params)
            sampled_from = torch.zeros((step.num_reqs, k, backbone.shape[-1]), device=device)
            sampled_from[drafting] = probs
            draft_probs = sampled_from
            if handed is not probs:
                draft_probs = torch.zeros_like(sampled_from)
                draft_probs[drafting] = handed
        # The scheduler needs host counts: all K without a device read, else one (m,) copy per step.
        host = [width] * m if self.capacity == "full" else capacity.tolist()
        counts = dict(zip(drafting, host, strict=True))
        return Proposal(
            draft_token_ids=tokens,
            num_drafts=tuple(counts.get(r, 0) for r in range(step.num_reqs)),
            draft_probs=draft_probs,
            sampled_from=sampled_from,
            evidence=BlockEvidence(
                desc=desc,
                num_drafting=m,
                sample_indices=sample_rows,
                markov=MarkovChainEvidence(anchor_token_ids=anchors, prev_token_ids=prev),
                confidence=ConfidenceEvidence(survival=survival, confidence=confidence),
                # The drafting rows only, so every per-request part has the same num_drafting (= m) rows.
                capacity=CapacityEvidence(capacity=capacity, prefix_mask=mask, draft_probs=handed),
            ),
        )

    def _markov_loop(
        self,
        backbone: Float[Tensor, "m k vocab"],
        hidden: Float[Tensor, "m k hidden"],
        anchors: Int[Tensor, " m"],
        params: list[SamplingParams],
        width: int,
    ) -> tuple[Int[Tensor, "m k"], Int[Tensor, "m k"], Float[Tensor, "m k vocab"] | None, Float[Tensor, "m k"]]:
        """Drafts left to right from the Markov-corrected distribution; returns drafts, x_{k-1}, proposals, confidences.

        Only the first ``width`` slots are drawn (all K under a fixed K). Past them a slot
        has no draft (``REJECTED_TOKEN_ID``), no proposal (zeros) and confidence 0,
        so survival is 0 there and no capacity reaches them; the chain's previous
        token stays the last draft, as it would be. Greedy drafts are argmaxes: their
        one-hot proposals are never handed over, so none is kept (None).
        """
        m, k, vocab = backbone.shape
        width = min(width, k)
        drawn = torch.full((m, k), REJECTED_TOKEN_ID, dtype=torch.int64, device=backbone.device)
        probs = None
        if not argmax_proposal(params):
            fill = torch.empty if width == k else torch.zeros  # a (m, k, vocab) memset only where slots stay empty
            probs = fill((m, k, vocab), dtype=torch.float32, device=backbone.device)
        conf = torch.zeros((m, k), dtype=torch.float32, device=backbone.device)
        prev = self._markov_start(anchors)
        prevs = prev[:, None].repeat(1, k)  # slot j's previous token; each draw becomes it for every later slot
        for j in range(width):
            conf[:, j] = self.heads.confidence(hidden[:, j], prev).float()
            x, p = self._markov_step(backbone[:, j], prev, params)
            drawn[:, j] = x
            if probs is not None and p is not None:
                probs[:, j] = p
            prevs[:, j + 1 :] = x[:, None]
            prev = x
        return drawn, prevs, probs, conf

    def _survival(self, confidence: Float[Tensor, "m k"]) -> Float[Tensor, "m k"]:
        """a_k = c_1 · ... · c_k: the chance that draft k and every draft before it are accepted (BLK-8)."""
        return torch.cumprod(confidence, dim=1)

    def _verifier_proposal(
        self, corrected: Float[Tensor, "m k vocab"], backbone: Float[Tensor, "m k vocab"], params: list[SamplingParams]
    ) -> Float[Tensor, "m k vocab"]:
        """The proposal the verifier gets: the Markov-corrected distribution the drafts came from (VER-3).

        Handing over the backbone's ``softmax(U_k)`` instead is the bug pattern
        this seam exists for: the output is then no longer the target's
        distribution, and VER-3 compares both in ``full`` mode.
        """
        del backbone, params
        return corrected

    def _markov_start(self, anchors: Int[Tensor, " m"]) -> Int[Tensor, " m"]:
        """x_0: the chain starts at the anchor (BLK-8)."""
        return anchors

    def _markov_step(
        self, backbone: Float[Tensor, "m vocab"], prev: Int[Tensor, " m"], params: list[SamplingParams]
    ) -> tuple[Int[Tensor, " m"], Float[Tensor, "m vocab"] | None]:
        """One slot: ``U_k + W2·W1[x_{k-1}]`` through the verifier's transform; the draft comes from exactly that.

        With a draft vocabulary the backbone is ``-inf`` off its ids, and so is any
        bias added there: those columns can be neither drafted nor proposed, so the
        bias, the transform and the draw run on the draft ids only (a 4,096-wide
        row instead of the target's 49,152), and the proposal is scattered back to
        full width with zeros elsewhere. The ids are sorted, so an argmax breaks a
        tie toward the same token as over the whole row.
        """
        vocab = self.network.draft_vocab
        if vocab is None:
            logits = backbone.float() + self.heads.markov_bias(prev).float()
            return draw_drafts(logits, params, self.generator)
        ids = vocab.ids.to(backbone.device)
        logits = backbone[:, ids].float() + (self.heads.embed_prev(prev) @ vocab.rows(self.heads.w2).T).float()
        return draw_on_ids(logits, ids, backbone.shape[-1], params, self.generator)

    def _refit_cost(self, ctx: DraftContext) -> None:
        """``c0 + c1 · tokens`` from the engine's step record (``ctx.step_cost``), every REFIT_EVERY new samples.

        Where the record has its full fit (the adaptive draft length varies the
        drafts, so proposal and rows are told apart), ``c1`` is its cost per
        verified row and ``c0`` the rest of a step that drafts K. Otherwise
        ``c0 + c1 · tokens`` is fitted to the samples themselves (two row counts needed).
        """
        record = ctx.step_cost
        if self._fitted_at and record.observed - self._fitted_at < REFIT_EVERY:
            return
        full = record.fitted
        if full is not None:
            rest = full.base + full.per_proposal + full.per_draft * self.num_spec_tokens
            self.cost = StepCost(c0=max(rest, 1e-9), c1=full.per_row)
        else:
            samples = list(record.samples)
            if len({s.rows for s in samples}) < 2:
                return
            self.cost = StepCost.fit([s.rows for s in samples], [s.seconds for s in samples])
        self._fitted_at = record.observed

    def _capacity(self, survival: Float[Tensor, "m k"]) -> Int[Tensor, " m"]:
        """Drafts proposed per request: all K, while survival >= tau, or by the global step-cost budget."""
        if self.capacity == "threshold":
            return threshold_capacity(survival, self.tau)
        if self.capacity == "budget":
            return budget_capacity(survival, self.cost)
        return torch.full((survival.shape[0],), survival.shape[1], dtype=torch.long, device=survival.device)
