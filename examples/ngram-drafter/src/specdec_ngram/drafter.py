"""The n-gram speculator and its lookup.

The speculator keeps each request's committed tokens itself, rebuilt from what
every ``TargetStep`` shows: request ``r`` had ``num_computed_tokens`` tokens
cached before the step, and its query rows up to ``last_valid[r]`` are now
committed. Cutting the history back to ``num_computed_tokens`` before appending
makes prefill chunks, rejected drafts and recompute after preemption one case.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from contracts import REJECTED_TOKEN_ID, StepKind
from specdec import DraftContext, Proposal, ScheduledRequest, TargetStep, Transformer


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
        self._history: dict[str, list[int]] = {}

    def bind(self, target: Transformer, ctx: DraftContext) -> None:
        """No draft state to allocate: the drafts come from the request's own tokens."""
        del target, ctx

    def propose(self, step: TargetStep, ctx: DraftContext) -> Proposal:
        del ctx  # no draft forward, no draft DP sync
        k = self.num_spec_tokens
        rows: list[list[int]] = []
        counts: list[int] = []
        start = 0
        for r, sched in enumerate(step.scheduled):
            query = list(step.query_token_ids[r])  # host tokens: no device read, so no sync on a GPU
            history = self._commit(sched, query, step.last_valid[r] - start, step.base_positions[r])
            start += sched.query_len
            drafts = (
                lookup([*history, step.next_token_ids[r]], k, min_ngram=self.min_ngram, max_ngram=self.max_ngram)
                if step.drafting[r]
                else []
            )
            counts.append(len(drafts))
            rows.append(drafts + [REJECTED_TOKEN_ID] * (k - len(drafts)))
        ids = torch.tensor(rows, dtype=torch.int64).reshape(step.num_reqs, k).to(step.input_ids.device)
        return Proposal(draft_token_ids=ids, num_drafts=tuple(counts))

    def _commit(self, sched: ScheduledRequest, query: list[int], last_row: int, base_position: int) -> list[int]:
        """Append this step's committed query tokens to the request's history, dropping anything past the cache."""
        history = self._history.setdefault(sched.req_id, [])
        if len(history) < sched.num_computed_tokens:
            raise RuntimeError(
                f"n-gram drafter {self.name!r}: request {sched.req_id!r} has {sched.num_computed_tokens} cached "
                f"tokens but the drafter saw only {len(history)}; it must see every target step of a request"
            )
        del history[sched.num_computed_tokens :]
        history.extend(query[: last_row + 1])
        if len(history) != base_position + 1:
            raise RuntimeError(
                f"n-gram drafter {self.name!r}: request {sched.req_id!r} history has {len(history)} tokens "
                f"but its last committed position is {base_position}"
            )
        return history

    def finish(self, req_id: str) -> None:
        self._history.pop(req_id, None)

    def history(self, req_id: str) -> tuple[int, ...]:
        """The committed tokens the drafter holds for ``req_id`` (empty once finished or preempted)."""
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
