"""What a block drafter reports beside its drafts, so the proposal contracts can judge how they were made.

A block drafter (one forward, q queries per request) hands the engine a
``BlockEvidence`` with its ``Proposal``: the block step's descriptor, how many
requests drafted and which block rows were sampled (BLK-7). A drafter that
also chains its drafts, scores them or proposes a per-request number of them
adds the matching capability part, and BLK-8 checks every part that is there,
whatever the backend is called. The types live in ``contracts`` so that both
the runtime (``specdec``) and a third-party backend can build them.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxtyping import Bool, Float, Int
from torch import Tensor

from contracts.descriptor import BatchExecutionDescriptor


@dataclass(frozen=True, eq=False)
class MarkovChainEvidence:
    """Drafts drawn left to right, each conditioned on the token before it.

    ``prev_token_ids[r, j]`` is the token draft ``j`` of drafting request ``r``
    was conditioned on; the chain must start at ``anchor_token_ids[r]`` (the
    token just sampled by the verifier).
    """

    anchor_token_ids: Int[Tensor, " num_drafting"]
    prev_token_ids: Int[Tensor, "num_drafting num_spec_tokens"]


@dataclass(frozen=True, eq=False)
class ConfidenceEvidence:
    """The drafter's estimate that draft ``j`` and every draft before it are accepted: never increasing in ``j``.

    A drafter that scores each draft given the ones before it also reports those
    per-draft ``confidence`` values; ``survival[r, j]`` is then by definition their
    running product ``confidence[r, 0] * ... * confidence[r, j]``, and BLK-8
    checks that definition, not only that survival never increases.
    """

    survival: Float[Tensor, "num_drafting num_spec_tokens"]
    confidence: Float[Tensor, "num_drafting num_spec_tokens"] | None = None


@dataclass(frozen=True, eq=False)
class CapacityEvidence:
    """How many drafts each drafting request proposes: ``capacity[r]`` in ``[0, K]``, a prefix of the K slots."""

    capacity: Int[Tensor, " num_drafting"]
    prefix_mask: Bool[Tensor, "num_drafting num_spec_tokens"]
    """True for the slots proposed; row ``r`` must be ``capacity[r]`` Trues followed by Falses."""
    draft_probs: Float[Tensor, "num_drafting num_spec_tokens vocab"] | None = None
    """The proposal handed to the verifier for the drafting rows only (None: argmax drafts, one-hot)."""


@dataclass(frozen=True, eq=False)
class ProposalSourceEvidence:
    """The logits a drafter made each proposal slot from, with the sampling settings it applied (VER-9).

    ``logits[r, j]`` are the drafter's logits for slot ``j`` of row ``r``;
    ``num_drafts[r]`` slots of row ``r`` are drafted from them. The settings are
    each row's request's: ``temperature`` (0 = greedy), ``top_k`` and ``top_p``
    (None = off). A drafter reports this only when it is checked in ``full``
    mode (``contracts.current_mode()``): it costs one more (rows, K, vocab) tensor.
    """

    logits: Float[Tensor, "rows num_spec_tokens vocab"]
    num_drafts: tuple[int, ...]
    temperature: tuple[float, ...]
    top_k: tuple[int | None, ...]
    top_p: tuple[float | None, ...]


@dataclass(frozen=True, eq=False)
class BlockEvidence:
    """A block drafter's account of one proposal: the block step it ran and, optionally, its capabilities.

    Per-request evidence has ``num_drafting`` rows, the drafting requests in
    batch order; ``sample_indices`` are the block rows whose logits became
    drafts (empty when no rank drafted and no block forward ran).
    """

    desc: BatchExecutionDescriptor
    num_drafting: int
    sample_indices: Int[Tensor, " num_samples"]
    markov: MarkovChainEvidence | None = None
    confidence: ConfidenceEvidence | None = None
    capacity: CapacityEvidence | None = None

    def __post_init__(self) -> None:
        if self.num_drafting < 0:
            raise ValueError(f"BlockEvidence.num_drafting must be >= 0 (drafting requests), got {self.num_drafting}")
