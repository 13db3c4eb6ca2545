"""The n-gram speculator and its lookup.

Each ``TargetStep`` hands the drafter every request's committed tokens
(``committed_tokens[r]``, a read-only view) and the token after them
(``next_token_ids[r]``), so prefill chunks, rejected drafts and recompute after
preemption need no bookkeeping here: the drafter only looks the suffix up.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from contracts import REJECTED_TOKEN_ID, StepKind
from specdec import DraftContext, Proposal, TargetStep, Transformer


def lookup(tokens: Sequence[int], k: int, *, min_ngram: int = 1, max_ngram: int = 3) -> list[int]:
    """Up to ``k`` drafts following the most recent earlier occurrence of the longest matching suffix.

    Longer suffixes are tried first (they predict better). When the match's
    continuation runs into the end of ``tokens``, it continues as a copy would,
    from the drafts themselves, so a period shorter than ``k`` still yields ``k``
    drafts (``1 2 1 2 1`` proposes ``2 1 2 ...``).
    """
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = list(tokens[length - n :])
        for start in range(length - n - 1, -1, -1):
            if list(tokens[start : start + n]) == suffix:
                drafts: list[int] = []
                for j in range(k):
                    i = start + n + j
                    drafts.append(int(tokens[i]) if i < length else drafts[i - length])
                return drafts
    return []


class NgramSpeculator:
    """Prompt-lookup drafts, argmax-style (``draft_probs=None``: the verifier treats them as one-hot)."""

    draft_step_kinds: frozenset[StepKind] = frozenset()
    """None: it never runs a draft forward, so ``DraftContext.forward`` would refuse one."""
    aux_layers: tuple[int, ...] = ()

    def __init__(
        self, *, num_spec_tokens: int = 4, min_ngram: int = 1, max_ngram: int = 3, name: str = "ngram"
    ) -> None:
        if num_spec_tokens < 1:
            raise ValueError(f"num_spec_tokens (K) must be >= 1, got {num_spec_tokens}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.name = name
        self.num_spec_tokens = num_spec_tokens
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self._history: dict[str, Sequence[int]] = {}

    def bind(self, target: Transformer, ctx: DraftContext) -> None:
        """No draft state to allocate: the drafts come from the request's own tokens."""
        del target, ctx

    def propose(self, step: TargetStep, ctx: DraftContext) -> Proposal:
        del ctx  # no draft forward, no draft DP sync
        k = self.num_spec_tokens
        rows: list[list[int]] = []
        counts: list[int] = []
        for r, sched in enumerate(step.scheduled):
            history = step.committed_tokens[r]  # host tokens: no device read, so no sync on a GPU
            self._history[sched.req_id] = history
            drafts = (
                lookup([*history, step.next_token_ids[r]], k, min_ngram=self.min_ngram, max_ngram=self.max_ngram)
                if step.drafting[r]
                else []
            )
            counts.append(len(drafts))
            rows.append(drafts + [REJECTED_TOKEN_ID] * (k - len(drafts)))
        ids = torch.tensor(rows, dtype=torch.int64).reshape(step.num_reqs, k).to(step.input_ids.device)
        return Proposal(draft_token_ids=ids, num_drafts=tuple(counts))

    def finish(self, req_id: str) -> None:
        self._history.pop(req_id, None)

    def history(self, req_id: str) -> tuple[int, ...]:
        """The committed tokens the drafter last saw for ``req_id`` (empty once finished or preempted)."""
        return tuple(self._history.get(req_id, ()))

    @property
    def tracked_requests(self) -> frozenset[str]:
        return frozenset(self._history)


def make_speculator(
    target: Transformer, *, num_spec_tokens: int = 4, min_ngram: int = 1, max_ngram: int = 3
) -> NgramSpeculator:
    """The ``ngram`` entry point: ``specdec.backend_registry.create("ngram", target, num_spec_tokens=K)``."""
    del target  # drafts need no model; a target of any vocabulary works
    return NgramSpeculator(num_spec_tokens=num_spec_tokens, min_ngram=min_ngram, max_ngram=max_ngram)
