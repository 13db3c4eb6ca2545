"""Evidence that a backend's draft forwards were checked, so a conformance family cannot pass vacuously.

A family passes when no check fails, which is also what happens when no check
runs: a drafter whose forwards skip ``DraftContext.forward``, or meet no
invariant there, decodes losslessly (the verifier keeps it honest) while its
metadata goes unchecked. Each family therefore counts, per step kind, the
invariant evaluations its examples ran (``contracts.tally``), and fails when a
backend that runs draft forwards drafted tokens yet none of its forwards was
evaluated.

A backend runs draft forwards when it declares a draft step kind or allocates a
draft KV cache (a cache only forwards use).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from contracts import Subject
from contracts.tally import EvaluationTally
from specdec.draft_length import DEFAULT_SOURCE
from specdec.draft_step_kinds import DRAFT_STEP_KINDS
from specdec.nn.transformer import Transformer
from specdec.speculator import ContextTaker, DraftContext, Proposal, Speculator, TargetStep
from specdec.testing.axes import BoundaryWatch

UNCHECKED_FORWARDS = "unchecked-forwards"
"""What a family that checked none of a backend's draft forwards was caught by (in place of an invariant ID)."""


class ObservedSpeculator:
    """Passes every call through to the backend, keeping its rank, its context and, for a replay, its calls."""

    def __init__(self, inner: Speculator, *, record_calls: bool) -> None:
        self.inner = inner
        self.name = inner.name
        self.num_spec_tokens = inner.num_spec_tokens
        self.draft_step_kinds = inner.draft_step_kinds
        self.aux_layers = inner.aux_layers
        self.record_calls = record_calls
        self.events: list[tuple[str, Any]] = []
        """The engine's ``propose``, ``take_context`` and ``finish`` calls, in order (only with ``record_calls``)."""
        self.rank = 0
        self.ctx: DraftContext | None = None
        self.watch = BoundaryWatch()
        """What the engine ran into on this rank (``axes``): drafts into ``max_model_len``, preemptions, ..."""

    def __getattr__(self, attr: str) -> Any:
        """Anything else a caller reads is the backend's own; ``take_context`` (``ContextTaker``) is observed like
        ``propose``, and exists only where the backend has it, so the engine calls what it would call on the backend."""
        if attr == "inner":  # not set yet (a copy in progress): no recursion through __getattr__
            raise AttributeError(attr)
        if attr == "take_context":
            if not isinstance(self.inner, ContextTaker):  # the backend makes an empty proposal instead
                raise AttributeError(attr)
            inner_take = self.inner.take_context

            def take_context(step: TargetStep, ctx: DraftContext) -> None:
                if self.record_calls:
                    self.events.append(("take_context", step))
                self.watch.propose(step, ctx, self.num_spec_tokens)
                inner_take(step, ctx)

            return take_context
        return getattr(self.inner, attr)

    def bind(self, target: Transformer, ctx: DraftContext) -> None:
        self.rank = ctx.dp_group.rank if ctx.dp_group is not None else 0
        self.ctx = ctx
        self.inner.bind(target, ctx)

    def propose(self, step: TargetStep, ctx: DraftContext) -> Proposal:
        if self.record_calls:
            self.events.append(("propose", step))
        self.watch.propose(step, ctx, self.num_spec_tokens)
        proposal = self.inner.propose(step, ctx)
        self.watch.looked_up = int(getattr(self.inner, "looked_up", 0))  # a lookup-first wrapper counts its lookups
        limits = getattr(self.inner, "draft_limits", None)  # a lookup-first wrapper: the most each source drafts
        if limits and max(proposal.num_drafts, default=0) > limits.get(DEFAULT_SOURCE, self.num_spec_tokens):
            self.watch.lookup_drafted_past_k = True
        return proposal

    def finish(self, req_id: str) -> None:
        if self.record_calls:
            self.events.append(("finish", req_id))
        self.watch.finish(req_id)
        self.inner.finish(req_id)


@dataclass
class ForwardCoverage:
    """One family's evidence over all its examples: what the backend declared and drafted, and what was checked."""

    tally: EvaluationTally = field(default_factory=EvaluationTally)
    """Evaluations of the speculative runs and their replays (plain references are not counted)."""
    declared_step_kinds: set[str] = field(default_factory=set)
    draft_caches: set[str] = field(default_factory=set)
    drafted: int = 0
    """Drafts the engine verified, every rank of every example."""

    def observe(self, speculators: Sequence[ObservedSpeculator], drafted: int) -> None:
        """Add one example's bound backends and the drafts its ranks verified."""
        for s in speculators:
            self.declared_step_kinds.update(getattr(k, "value", repr(k)) for k in s.draft_step_kinds)
            if s.ctx is not None:
                self.draft_caches.update(s.ctx.caches)
        self.drafted += drafted

    @property
    def evaluations(self) -> dict[str, int]:
        return self.tally.by_step_kind()

    @property
    def draft_forward_evaluations(self) -> dict[str, int]:
        draft = {k.value for k in DRAFT_STEP_KINDS}
        return {k: n for k, n in self.tally.of(Subject.BATCH).items() if k in draft}

    @property
    def runs_forwards(self) -> bool:
        return bool(self.declared_step_kinds or self.draft_caches)

    def unchecked(self) -> str | None:
        """Why this family checked nothing of the backend's drafting, or None where its forwards were checked."""
        checked = sum(self.draft_forward_evaluations.values())
        if not self.runs_forwards or not self.drafted or checked:
            return None
        declared = sorted(self.declared_step_kinds)
        caches = f" and allocated draft KV caches {sorted(self.draft_caches)}" if self.draft_caches else ""
        return (
            f"no contract checked your draft forwards: the backend declares draft step kinds {declared}{caches} "
            f"and its {self.drafted} drafts were verified, but 0 draft-forward invariants were evaluated "
            f"(evaluated per step kind: {self.evaluations}). Run every draft forward through "
            "ctx.forward(model, StepKind.DRAFT_..., facts, kv), which checks it, and declare that StepKind "
            "in draft_step_kinds"
        )
