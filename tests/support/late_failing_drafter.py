"""A drafter that breaks only from DP size 4 on: the ``dp`` family's first failure is a later example.

EAGLE, but on a rank of a DP group of 4 or more ranks every proposal claims K
drafts for every request, mid-prefill and finished ones included. A repro
command must find that example again, not the first one of the family.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from step_kind_drafters import _Wrapped

from specdec.backend_registry import factory_for
from specdec.nn.transformer import Transformer
from specdec.speculator import DraftContext, Proposal, Speculator, TargetStep


class DraftsForEveryoneFromDP4(_Wrapped):
    def propose(self, step: TargetStep, ctx: DraftContext) -> Proposal:
        proposal = self.inner.propose(step, ctx)
        if ctx.dp_group is None or ctx.dp_group.size < 4:
            return proposal
        return dataclasses.replace(proposal, num_drafts=(self.num_spec_tokens,) * step.num_reqs)


def make_drafts_for_everyone_from_dp4(target: Transformer, **options: Any) -> Speculator:
    return DraftsForEveryoneFromDP4(factory_for("eagle")(target, **options))
