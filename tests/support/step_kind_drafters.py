"""Drafters that reach the contracts wrongly: step kinds named by strings, and forwards that skip the check.

Both wrap EAGLE and keep its drafts, so a run that checks nothing still decodes
losslessly: only the contracts can tell these apart from a correct backend.
With the DP-padding mutant (``eagle-dp-pad-decode-attention``) planted, a
correct EAGLE fails AR-5 in the ``dp`` family; these must fail too, with an
error that names what they did wrong instead of a silent pass.
"""

from __future__ import annotations

from typing import Any

from contracts import BatchFacts
from specdec.backend_registry import factory_for
from specdec.kv_storage import PagedKVStorage
from specdec.nn.transformer import Transformer
from specdec.speculator import DraftContext, DraftModel, DraftOutput, Proposal, Speculator, TargetStep


class _Wrapped:
    """EAGLE behind a context the subclass adapts (``_context``); every other call is EAGLE's."""

    def __init__(self, inner: Speculator) -> None:
        self.inner = inner
        self.name, self.num_spec_tokens = inner.name, inner.num_spec_tokens
        self.draft_step_kinds: Any = inner.draft_step_kinds
        self.aux_layers = inner.aux_layers

    def _context(self, ctx: DraftContext) -> Any:
        return ctx

    def bind(self, target: Transformer, ctx: DraftContext) -> None:
        self.inner.bind(target, self._context(ctx))

    def propose(self, step: TargetStep, ctx: DraftContext) -> Proposal:
        return self.inner.propose(step, self._context(ctx))

    def finish(self, req_id: str) -> None:
        self.inner.finish(req_id)


class _ContextProxy(DraftContext):
    """A ``DraftContext`` seen through an author's code: its state is the real one's, some calls are the author's."""

    def __init__(self, ctx: DraftContext) -> None:  # no super().__init__: every attribute is the real context's
        self._ctx = ctx

    def __getattr__(self, attr: str) -> Any:
        if attr == "_ctx":
            raise AttributeError(attr)
        return getattr(self._ctx, attr)


class _StringKindsContext(_ContextProxy):
    """Passes each step kind to the real context by its string value, as the docs' old table spelled it."""

    def forward(self, model: DraftModel, step_kind: Any, facts: BatchFacts, kv: PagedKVStorage, **kw: Any) -> Any:
        return self._ctx.forward(model, step_kind.value, facts, kv, **kw)

    def check_batch(self, step_kind: Any, facts: BatchFacts) -> None:
        self._ctx.check_batch(step_kind.value, facts)


class StringStepKinds(_Wrapped):
    """Declares ``frozenset({"draft_prefill", "draft_decode"})`` and forwards with those strings."""

    def __init__(self, inner: Speculator) -> None:
        super().__init__(inner)
        self.draft_step_kinds = frozenset(k.value for k in inner.draft_step_kinds)

    def _context(self, ctx: DraftContext) -> Any:
        return _StringKindsContext(ctx)


class _UncheckedContext(_ContextProxy):
    """Runs the model exactly as ``DraftContext.forward`` does, minus the check: a bypass."""

    def forward(
        self,
        model: DraftModel,
        step_kind: Any,
        facts: BatchFacts,
        kv: PagedKVStorage,
        *,
        num_tokens_across_dp: Any = None,
        scored_rows: Any = None,
    ) -> DraftOutput:
        del step_kind
        group = self._ctx.dp_group
        return model(
            facts.input_ids,
            facts.positions,
            facts.meta,
            kv,
            features=facts.hidden_states,
            dp_group=group,
            num_tokens_across_dp=num_tokens_across_dp if group is not None else None,
            scored_rows=scored_rows,
        )


class UncheckedForwards(_Wrapped):
    """Declares its step kinds correctly, but calls its network without ``ctx.forward``'s check."""

    def _context(self, ctx: DraftContext) -> Any:
        return _UncheckedContext(ctx)


class UndeclaredUncheckedForwards(UncheckedForwards):
    """Declares no step kinds, like a drafter without forwards, yet runs them (unchecked) on its draft KV cache."""

    def __init__(self, inner: Speculator) -> None:
        super().__init__(inner)
        self.draft_step_kinds = frozenset()


def string_step_kinds(target: Transformer, **options: Any) -> Speculator:
    return StringStepKinds(factory_for("eagle")(target, **options))  # type: ignore[return-value]


def unchecked_forwards(target: Transformer, **options: Any) -> Speculator:
    return UncheckedForwards(factory_for("eagle")(target, **options))  # type: ignore[return-value]


def undeclared_unchecked_forwards(target: Transformer, **options: Any) -> Speculator:
    return UndeclaredUncheckedForwards(factory_for("eagle")(target, **options))  # type: ignore[return-value]
