"""A drafter whose attention metadata holds a host tensor where a device one belongs.

EAGLE, but every draft forward's ``slot_mapping`` is copied to the host with
``.cpu()`` before the forward, as an author's metadata builder might leave it.
On CPU tensors that is a no-op, and the drafts stay correct: only the device
check of the metadata (IN-2) in the fake-cuda replay, or a real GPU, can tell.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from step_kind_drafters import _ContextProxy, _Wrapped

from contracts import BatchFacts
from specdec.backend_registry import factory_for
from specdec.kv_storage import PagedKVStorage
from specdec.nn.transformer import Transformer
from specdec.speculator import DraftContext, DraftModel, Speculator


class _HostSlotMappingContext(_ContextProxy):
    """Hands the real context each forward's metadata with ``slot_mapping`` moved to the host."""

    def forward(self, model: DraftModel, step_kind: Any, facts: BatchFacts, kv: PagedKVStorage, **kw: Any) -> Any:
        meta = dataclasses.replace(facts.meta, slot_mapping=facts.meta.slot_mapping.cpu())
        return self._ctx.forward(model, step_kind, dataclasses.replace(facts, meta=meta), kv, **kw)


class HostSlotMappingEagle(_Wrapped):
    def _context(self, ctx: DraftContext) -> Any:
        return _HostSlotMappingContext(ctx)


def make_host_slot_mapping(target: Transformer, **options: Any) -> Speculator:
    """The ``module:factory`` a conformance run takes: EAGLE with a host ``slot_mapping`` in its draft forwards."""
    return HostSlotMappingEagle(factory_for("eagle")(target, **options))
