"""The KV-less draft forward: heads on the target's hidden states, checked like any other draft forward.

A Medusa-style drafter has no draft KV cache and no attention: each head maps
the target's last hidden state of a request to logits of one future token. It
still runs after a draft DP sync (``specdec.draft_builders.sync_draft_step``),
on rows padded to what every rank agreed, so ``DraftContext.forward_heads``
checks the descriptor (DESC-*), the rows (HEAD-1, HEAD-2) and the logits (VER-8).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from jaxtyping import Float
from torch import Tensor

from contracts import BatchExecutionDescriptor, DescriptorFacts, ForwardOutputFacts, HeadFacts, StepKind, Subject, check
from specdec.dp_group import DPGroup
from specdec.draft_step_kinds import forward_step_kind

if TYPE_CHECKING:
    from specdec.speculator import DraftContext


@runtime_checkable
class DraftHeads(Protocol):
    """A network of ``num_heads`` heads a drafter runs through ``DraftContext.forward_heads``.

    Returns logits of shape ``(rows, num_heads, vocab)``, one row per input
    row. ``dp_group`` and ``num_tokens_across_dp`` are there for heads whose
    layers run collectives (every rank passes the same rows then).
    """

    def __call__(
        self,
        hidden_states: Float[Tensor, "rows hidden"],
        *,
        dp_group: DPGroup | None,
        num_tokens_across_dp: Sequence[int] | None,
    ) -> Float[Tensor, "rows heads vocab"]: ...


def run_heads(
    ctx: DraftContext,
    heads: DraftHeads,
    desc: BatchExecutionDescriptor,
    num_reqs: int,
    hidden_states: Float[Tensor, "rows hidden"],
    num_tokens_across_dp: Sequence[int] | None,
) -> Float[Tensor, "rows heads vocab"]:
    """Check the step, run ``heads`` on exactly these rows, check the real rows' logits (the body of ``forward_heads``)."""
    kind = forward_step_kind(ctx.backend, StepKind.DRAFT_HEADS, ctx.step_kinds)
    component = "draft heads forward"
    dp_size = ctx.dp_group.size if ctx.dp_group is not None else 1
    check(
        Subject.DESCRIPTOR,
        DescriptorFacts(desc=desc, num_reqs=num_reqs, num_tokens=num_reqs),
        step_kind=kind,
        component=component,
        backend=ctx.backend,
    )
    facts = HeadFacts(desc=desc, num_reqs=num_reqs, hidden_states=hidden_states, dp_size=dp_size)
    check(Subject.BATCH, facts, step_kind=kind, component=component, backend=ctx.backend)
    across = num_tokens_across_dp if ctx.dp_group is not None else None
    logits = heads(hidden_states, dp_group=ctx.dp_group, num_tokens_across_dp=across)
    rows = hidden_states.shape[0]
    if logits.dim() != 3 or logits.shape[0] != rows:
        raise ValueError(
            f"draft heads of backend {ctx.backend!r} returned logits of shape {tuple(logits.shape)}; "
            f"expected (rows={rows}, num_heads, vocab): one row per input row"
        )
    # Each (request, head) pair is one distribution the drafter samples from: VER-8 on the real requests' rows only.
    real = logits[:num_reqs].reshape(num_reqs * logits.shape[1], logits.shape[2])
    check(
        Subject.FORWARD_OUTPUT,
        ForwardOutputFacts(num_tokens=real.shape[0], logits=real),
        step_kind=kind,
        component="draft heads output",
        backend=ctx.backend,
    )
    return logits
