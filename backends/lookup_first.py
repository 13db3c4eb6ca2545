"""Prompt lookup first, the model drafter for the rest: a wrapper any ``Speculator`` can be given.

Where a request's latest tokens occurred before in its own history
(``backends.prompt_lookup``), what followed them then is drafted, at no model
cost; every other drafting request gets the wrapped drafter's drafts. Measured
on the benchmark CPU (four HumanEval prompts, 64 tokens, K = 4, greedy), the
trained DFlash drafter took 132 steps alone and 102 with lookup first, and
every built-in drafter gained 1.2-1.3x in tokens per second.

The wrapped drafter sees the step with the lookup's requests not drafting,
exactly as when the draft-length policy gives them no budget: it takes in
their new context as it does for any idle request, runs its draft syncs and
forwards as always (so DP ranks stay in step), and its proposal carries its
own evidence, which the engine checks as before. The lookup's drafts are
argmax-style: where the wrapped drafter hands the verifier distributions,
their rows are one-hot, which keeps verification lossless at any
temperature.

A match that holds for one token tends to hold for several (on HumanEval,
with lookup first, DFlash's fourth drafts were accepted with all before them
in 0.69 of the steps that drafted one, its second in 0.31), so the lookup may
draft more than the wrapped drafter: with ``lookup_drafts``
above the drafter's K the wrapper's K (the engine's) is ``lookup_drafts``, the
wrapped drafter is still asked for at most its own K, its proposal is checked
against its own K (its block evidence included) and then widened, and
``draft_limits`` tells the adaptive draft length the most each source drafts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from backends.prompt_lookup import SuffixIndex, check_match_lengths
from contracts import StepKind
from specdec.draft_length import DEFAULT_SOURCE
from specdec.nn.transformer import Transformer
from specdec.shadow_drafts import FreeDraft
from specdec.speculator import ContextTaker, DraftContext, Proposal, Speculator, TargetStep, check_proposal

LOOKUP_SOURCE = "lookup"


class LookupFirst:
    """``inner``'s drafts, except for requests whose history holds a match of at least ``min_match`` tokens."""

    def __init__(
        self, inner: Speculator, *, min_match: int = 3, max_match: int | None = None, lookup_drafts: int = 0
    ) -> None:
        """``lookup_drafts``: the most drafts a match gives (0: the wrapped drafter's K; never fewer than that)."""
        self.inner = inner
        self.min_match = min_match
        self.max_match = min_match + 1 if max_match is None else max_match
        check_match_lengths(self.min_match, self.max_match)  # before any step, not at a request's first lookup
        check_lookup_drafts(lookup_drafts, inner.num_spec_tokens)
        self.name: str = inner.name
        self.num_spec_tokens: int = max(inner.num_spec_tokens, lookup_drafts)
        self.draft_limits: dict[str, int] = {LOOKUP_SOURCE: self.num_spec_tokens, DEFAULT_SOURCE: inner.num_spec_tokens}
        """The most drafts each source gives a request in one step (``draft_sources`` names the source)."""
        self.draft_step_kinds: frozenset[StepKind] = inner.draft_step_kinds
        self.aux_layers: tuple[int, ...] = inner.aux_layers
        source = getattr(inner, "weights_source", None)
        if source is not None:
            self.weights_source = source
        self._inner_taker = inner if isinstance(inner, ContextTaker) else None
        self._indexes: dict[str, SuffixIndex] = {}
        self._free: dict[str, FreeDraft] = {}
        self.looked_up = 0
        """Requests' drafts that came from the lookup, over all steps (a drafting request counts once a step)."""

    def bind(self, target: Transformer, ctx: DraftContext) -> None:
        self.inner.bind(target, ctx)

    def propose(self, step: TargetStep, ctx: DraftContext) -> Proposal:
        k, own = self.num_spec_tokens, self.inner.num_spec_tokens
        found: dict[int, list[int]] = {}
        for r, sched in enumerate(step.scheduled):
            budget = step.draft_budget(r, k)
            if not budget:
                continue
            index = self._index(sched.req_id)
            index.extend(step.committed_tokens[r])
            drafts = index.drafts(step.next_token_ids[r], budget)
            if drafts:
                found[r] = drafts
        if not found and k == own:
            return self.inner.propose(step, ctx)
        budgets = [0 if r in found else min(step.draft_budget(r, k), own) for r in range(step.num_reqs)]
        rest = dataclasses.replace(step, drafting=tuple(n > 0 for n in budgets), max_drafts=tuple(budgets))
        proposal = self.inner.propose(rest, ctx)
        if k > own:
            # The wrapped drafter's proposal is judged at its own K, block evidence and all, before it is widened.
            check_proposal(proposal, rest, self.inner, component="lookup-first")
            proposal = widened(proposal, k)
        self.looked_up += len(found)
        return with_drafts(proposal, found) if found else proposal

    def take_context(self, step: TargetStep, ctx: DraftContext) -> None:
        """A step where no request drafts (``ContextTaker``): nothing to look up; the wrapped drafter takes in the
        context, through its own ``take_context`` where it has one, else an empty proposal checked at its K."""
        if self._inner_taker is not None:
            self._inner_taker.take_context(step, ctx)
        else:
            check_proposal(self.inner.propose(step, ctx), step, self.inner, component="lookup-first")

    def draft_sources(self, tokens: Mapping[str, Sequence[int]]) -> dict[str, str]:
        """Whose drafts each request gets next step, from its tokens (committed, then the next one): ``lookup`` or
        the wrapped drafter's (``DEFAULT_SOURCE``). The adaptive draft length keeps separate acceptance rates for
        each, since a match's drafts are accepted far more often than a small model's."""
        sources, self._free = {}, {}
        for req_id, history in tokens.items():
            index = self._index(req_id)
            index.extend(history, len(history) - 1)
            drafts = index.drafts(history[-1], self.num_spec_tokens) if history else []
            if drafts:
                sources[req_id] = LOOKUP_SOURCE
                self._free[req_id] = FreeDraft(len(history), tuple(drafts))
            else:
                sources[req_id] = DEFAULT_SOURCE
        return sources

    def free_drafts(self) -> dict[str, FreeDraft]:
        """The lookup's drafts that the last ``draft_sources`` found: free to make, so the adaptive draft length
        checks them against the output of the requests it leaves at 0 drafts (``specdec.shadow_drafts``)."""
        return self._free

    def _index(self, req_id: str) -> SuffixIndex:
        index = self._indexes.get(req_id)
        if index is None:
            index = self._indexes[req_id] = SuffixIndex(min_match=self.min_match, max_match=self.max_match)
        return index

    def finish(self, req_id: str) -> None:
        self._indexes.pop(req_id, None)
        self.inner.finish(req_id)


def check_lookup_drafts(lookup_drafts: int, num_spec_tokens: int) -> None:
    if isinstance(lookup_drafts, bool) or not isinstance(lookup_drafts, int) or lookup_drafts < 0:
        raise ValueError(
            f"lookup_drafts is the most drafts a prompt-lookup match gives, an integer >= 0 (0: the drafter's K), "
            f"got {lookup_drafts!r}"
        )
    if 0 < lookup_drafts < num_spec_tokens:
        raise ValueError(
            f"lookup_drafts ({lookup_drafts}) must be 0 or at least the drafter's K ({num_spec_tokens}): the lookup "
            "drafts as many as the drafter or more"
        )


def widened(proposal: Proposal, width: int) -> Proposal:
    """``proposal`` with ``width`` draft slots per row: the slots past its own are empty (token 0, probability 0).

    Its block evidence stays behind: it describes a block of the wrapped
    drafter's K, checked at that K before widening.
    """
    ids = proposal.draft_token_ids
    pad = width - ids.shape[1]
    if pad <= 0:
        return proposal
    wide: dict[int, torch.Tensor] = {}

    def grow(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in wide:  # draft_probs and sampled_from are often one tensor: keep them one
            shape = (t.shape[0], pad, *t.shape[2:])
            wide[id(t)] = torch.cat([t, torch.zeros(shape, dtype=t.dtype, device=t.device)], dim=1)
        return wide[id(t)]

    source = proposal.source
    if source is not None:
        source = dataclasses.replace(source, logits=grow(source.logits))
    return dataclasses.replace(
        proposal,
        draft_token_ids=grow(ids),
        draft_probs=None if proposal.draft_probs is None else grow(proposal.draft_probs),
        sampled_from=None if proposal.sampled_from is None else grow(proposal.sampled_from),
        evidence=None,
        source=source,
    )


def with_drafts(proposal: Proposal, drafts: dict[int, list[int]]) -> Proposal:
    """``proposal`` with rows ``r`` of ``drafts`` drafting those tokens, one-hot wherever it hands over distributions.

    The rows are ones the drafter did not draft, so its tensors are written in
    place: nothing else reads those rows.
    """
    ids = proposal.draft_token_ids
    counts = list(proposal.num_drafts)
    rows = sorted(drafts)
    width = ids.shape[1]
    table = torch.tensor([drafts[r] + [0] * (width - len(drafts[r])) for r in rows], dtype=ids.dtype)
    for r in rows:
        counts[r] = len(drafts[r])
    index = torch.tensor(rows, dtype=torch.int64, device=ids.device)
    slots = torch.tensor([[j < len(drafts[r]) for j in range(width)] for r in rows], device=ids.device)
    ids[index] = torch.where(slots, table.to(ids.device), ids[index])
    seen: set[int] = set()
    for probs in (proposal.draft_probs, proposal.sampled_from):
        if probs is None or id(probs) in seen:
            continue
        seen.add(id(probs))
        one_hot = torch.zeros((len(rows), width, probs.shape[-1]), dtype=probs.dtype, device=probs.device)
        one_hot.scatter_(2, table.to(probs.device).unsqueeze(-1), 1.0)
        probs[index] = one_hot * slots.unsqueeze(-1).to(probs.dtype)
    return dataclasses.replace(proposal, draft_token_ids=ids, num_drafts=tuple(counts))
