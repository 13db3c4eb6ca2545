"""The Medusa speculator: one draft DP sync and one checked heads forward per step.

Each ``TargetStep`` carries the target's hidden states (``step.output``) and
the row of each request's last committed token (``step.last_valid``), so the
drafter needs no state of its own: no draft KV cache, nothing to roll back.
"""

from __future__ import annotations

import torch

from contracts import REJECTED_TOKEN_ID, StepKind
from specdec import DraftContext, Proposal, TargetStep, Transformer, pad_model_rows, sync_draft_step
from specdec_medusa.heads import MedusaHeads


class MedusaSpeculator:
    """Argmax drafts of every head (``draft_probs=None``: the verifier treats them as one-hot)."""

    draft_step_kinds: frozenset[StepKind] = frozenset({StepKind.DRAFT_HEADS})
    aux_layers: tuple[int, ...] = ()

    def __init__(self, heads: MedusaHeads, *, name: str = "medusa") -> None:
        self.name = name
        self.heads = heads
        self.num_spec_tokens = heads.num_heads

    def bind(self, target: Transformer, ctx: DraftContext) -> None:
        """No draft state to allocate: the heads read the target's hidden states and keep no KV cache."""
        del target, ctx

    def propose(self, step: TargetStep, ctx: DraftContext) -> Proposal:
        k, device = self.num_spec_tokens, step.input_ids.device
        drafting = [r for r in range(step.num_reqs) if step.drafting[r]]
        # Every rank syncs every step, drafting or not: an idle rank runs the dummy rows its peers agreed on.
        draft = sync_draft_step(ctx, len(drafting), 1, purpose="medusa_heads")
        tokens = torch.full((step.num_reqs, k), REJECTED_TOKEN_ID, dtype=torch.int64, device=device)
        if not draft.skipped:
            rows = torch.tensor([step.last_valid[r] for r in drafting], dtype=torch.int64, device=device)
            hidden = pad_model_rows(step.output.hidden_states[rows], draft.desc.num_tokens)
            logits = ctx.forward_heads(
                self.heads, draft.desc, len(drafting), hidden, num_tokens_across_dp=draft.num_tokens_across_dp
            )
            if drafting:
                tokens[drafting] = logits[: len(drafting)].argmax(dim=-1)
        num_drafts = tuple(k if step.drafting[r] else 0 for r in range(step.num_reqs))
        return Proposal(draft_token_ids=tokens, num_drafts=num_drafts)

    def finish(self, req_id: str) -> None:
        """Nothing per request to release."""
        del req_id


def make_speculator(target: Transformer, *, num_spec_tokens: int = 3, seed: int = 0) -> MedusaSpeculator:
    """The ``medusa`` entry point: ``specdec.backend_registry.create("medusa", target, num_spec_tokens=K)``."""
    return MedusaSpeculator(MedusaHeads(target, num_spec_tokens, seed=seed))
