"""Forced acceptance patterns: a speculator around any other whose drafts are rewritten to be accepted or rejected.

A random target rarely accepts long runs of a backend's drafts, so the
conformance suite's ``acceptance`` family wraps the backend in
``ForcedAcceptance``: its drafts for greedy requests are replaced by the token
plain decoding emits at that position (accepted) or a different one
(rejected). The engine checks the rewritten proposal like any other, and the
backend keeps drafting from whatever the target committed, so it meets long
accepted runs and immediate rejections on every kind of step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from specdec.nn.transformer import Transformer
from specdec.speculator import DraftContext, Proposal, Speculator, TargetStep

PATTERNS = ("all-accept", "all-reject", "random")


class ForcedAcceptance:
    """Implements ``Speculator`` by delegating to ``inner`` and rewriting its greedy drafts to ``pattern``.

    ``sequences`` maps a request ID to its prompt followed by its plain greedy
    continuation; ``random`` accepts each draft with probability 1/2 from a
    generator seeded with ``seed``. Sampled drafts (a proposal with
    ``draft_probs``) keep their own proposal distribution and are not touched.
    """

    def __init__(
        self, inner: Speculator, pattern: str, sequences: Mapping[str, Sequence[int]], vocab: int, seed: int
    ) -> None:
        if pattern not in PATTERNS:
            raise ValueError(f"unknown acceptance pattern {pattern!r}; expected all-accept, all-reject or random")
        self.inner = inner
        self.name = inner.name
        self.num_spec_tokens = inner.num_spec_tokens
        self.draft_step_kinds = inner.draft_step_kinds
        self.aux_layers = inner.aux_layers
        self.pattern = pattern
        self.sequences = sequences
        self.vocab = vocab
        self.rng = torch.Generator().manual_seed(seed)

    def __getattr__(self, attr: str) -> Any:
        """Anything else a caller reads (a backend's caches, its options) is the inner backend's."""
        if attr == "inner":  # not set yet (a copy or unpickling in progress): no recursion through __getattr__
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def bind(self, target: Transformer, ctx: DraftContext) -> None:
        self.inner.bind(target, ctx)

    def propose(self, step: TargetStep, ctx: DraftContext) -> Proposal:
        return self.rewrite(step, self.inner.propose(step, ctx))

    def finish(self, req_id: str) -> None:
        self.inner.finish(req_id)

    def rewrite(self, step: TargetStep, proposal: Proposal) -> Proposal:
        """The proposal with each greedy request's drafts replaced by accepted or rejected tokens."""
        if proposal.draft_probs is not None:
            return proposal
        ids = proposal.draft_token_ids.clone()
        for r, n in enumerate(proposal.num_drafts):
            seq = self.sequences.get(step.scheduled[r].req_id)
            if not n or seq is None or not step.params[r].greedy:
                continue
            for j in range(n):
                at = step.base_positions[r] + 2 + j  # P + 1 holds the token just sampled
                want = seq[at] if at < len(seq) else int(ids[r, j])
                accept = self.pattern == "all-accept" or (
                    self.pattern == "random" and bool(torch.rand((), generator=self.rng) < 0.5)
                )
                ids[r, j] = want if accept else (want + 1) % self.vocab
        return dataclasses.replace(proposal, draft_token_ids=ids)
