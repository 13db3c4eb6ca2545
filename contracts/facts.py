"""What a boundary hands to the checks: the object under test plus the local truth.

Each class bundles one subject with the unpadded counts it must be compared to;
they are plain frozen dataclasses so that building one costs well under a
microsecond and the checks stay free of framework code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from jaxtyping import Bool, Float, Int
from torch import Tensor

from contracts.descriptor import BatchExecutionDescriptor, DPSyncState
from contracts.evidence import CapacityEvidence, ConfidenceEvidence, MarkovChainEvidence, ProposalSourceEvidence
from contracts.metadata import AttentionMetadata, VerifierInput, VerifierOutput


@dataclass(frozen=True, eq=False)
class DescriptorFacts:
    desc: BatchExecutionDescriptor
    num_reqs: int
    num_tokens: int
    all_ranks_idle: bool | None = None
    """True when the DP sync saw zero tokens on every rank; None without DP."""


@dataclass(frozen=True, eq=False)
class DPFacts:
    state: DPSyncState
    desc: BatchExecutionDescriptor
    rank: int
    num_tokens: int
    collective_seqs: tuple[tuple[int, int], ...] | None = None
    """(collectives run so far, purpose tag) as every rank reported them in this sync."""
    peer_states: Sequence[DPSyncState] | None = None
    """Sync results of every rank, where one process can see them all."""


@dataclass(frozen=True, eq=False)
class BatchFacts:
    """A forward's inputs and attention metadata, with the real counts.

    Optional fields are filled by the step kinds that have them: ``target_desc``
    and ``hidden_states`` for draft prefill, ``base_positions``/``draft_step``
    for draft decode, ``query_width``/``block_layout`` for block drafters,
    ``dp_size`` wherever the caller knows it.
    """

    desc: BatchExecutionDescriptor
    num_reqs: int
    num_tokens: int
    meta: AttentionMetadata
    input_ids: Int[Tensor, " num_tokens"]
    positions: Int[Tensor, " num_tokens"]
    block_size: int | None = None
    max_model_len: int | None = None
    hidden_states: Float[Tensor, "num_tokens hidden"] | None = None
    target_desc: BatchExecutionDescriptor | None = None
    last_token_indices: Int[Tensor, " num_reqs_padded"] | None = None
    base_positions: Int[Tensor, " num_reqs"] | None = None
    draft_step: int | None = None
    num_spec_tokens: int | None = None
    block_layout: str | None = None
    """``"bonus_first"`` (DFlash) or ``"anchor_first"`` (DSpark)."""
    context_slot_mapping: Int[Tensor, " num_context"] | None = None
    context_committed: Bool[Tensor, " num_context"] | None = None
    dp_size: int | None = None
    """DP ranks whose collectives this forward joins; 1 means no DP, so no DP pad can explain extra rows (AR-4).

    None when the caller does not say: the checks then accept any DP pad.
    """


@dataclass(frozen=True, eq=False)
class HeadFacts:
    """A KV-less draft forward (heads on the target's hidden states) with the real counts.

    There is no attention metadata: the heads attend to nothing and write no
    KV. ``hidden_states`` are the heads' input, one model row per drafting
    request followed by the DP pad (an idle rank's dummy rows included).
    """

    desc: BatchExecutionDescriptor
    num_reqs: int
    hidden_states: Float[Tensor, "rows hidden"]
    dp_size: int | None = None
    """DP ranks whose collectives this forward joins; 1 means no DP (HEAD-1, as AR-4)."""


@dataclass(frozen=True, eq=False)
class ForwardOutputFacts:
    """What a draft forward returned, checked before the drafter samples from it.

    Without ``scored_rows`` the logits follow the forward's model rows, and the
    first ``num_tokens`` are the real tokens (a padded row's values are garbage
    by design and never sampled). A drafter that samples a few rows only (EAGLE
    at its prefill: each request's last row) names them in ``scored_rows``, and
    the logits hold those rows alone, in that order: scoring every row would
    cost a vocabulary-wide product per prompt token.
    """

    num_tokens: int
    logits: Float[Tensor, "rows vocab"]
    scored_rows: tuple[int, ...] | None = None
    """The model rows the forward was asked to score, one logits row each (None: every model row)."""


@dataclass(frozen=True, eq=False)
class ProposalFacts:
    """What a drafter returns for one step, before the verifier sees it.

    For a block drafter ``desc`` and ``num_reqs`` are its block step's
    (``BlockEvidence``); the capability parts are set only when the drafter
    reports them, and BLK-8 checks each one that is set.
    """

    desc: BatchExecutionDescriptor
    num_reqs: int
    num_spec_tokens: int
    draft_token_ids: Int[Tensor, "rows num_spec_tokens"]
    sample_indices: Int[Tensor, " num_samples"] | None = None
    markov: MarkovChainEvidence | None = None
    confidence: ConfidenceEvidence | None = None
    capacity: CapacityEvidence | None = None
    draft_probs: Float[Tensor, "prob_rows num_spec_tokens vocab"] | None = None
    source: ProposalSourceEvidence | None = None
    """The logits and sampling settings ``draft_probs`` was made from, where the drafter reports them (VER-9)."""


@dataclass(frozen=True, eq=False)
class ProposalCountFacts:
    """A proposal's row and draft counts against the target step it answers (PROP-*): all host values.

    ``num_reqs`` is the target step's request count and ``num_reqs_padded`` its
    DP-padded one (named when rows match it); ``drafting[r]`` says whether
    request ``r`` verifies drafts next step.
    """

    num_reqs: int
    num_reqs_padded: int
    num_spec_tokens: int
    rows: int
    num_drafts: Sequence[object]
    """As the drafter returned them: PROP-3 is what says each must be an int, so a bad one is named, not a crash."""
    drafting: Sequence[bool]
    req_ids: Sequence[str]
    counts_type: str = "tuple"
    """The type the drafter returned ``num_drafts`` as; anything but a tuple or list of ints is PROP-2's."""


@dataclass(frozen=True, eq=False)
class VerifierFacts:
    """Verifier input and output with the host-side draft counts the scheduler knows."""

    num_reqs: int
    num_spec_tokens: int
    num_draft_tokens: Sequence[int]
    verifier_input: VerifierInput
    verifier_output: VerifierOutput | None = None
    sampled_from: Float[Tensor, "num_reqs num_spec_tokens vocab"] | None = None
    """The distribution the drafter actually drew from (VER-3)."""
    host_output: tuple[Sequence[Sequence[int]], Sequence[int]] | None = None
    """``(output_token_ids, num_accepted)`` as host lists, where the caller already copied them (the engine):
    VER-1 and VER-2 read these in every mode, before any later device op could crash on a bad id."""


@dataclass(frozen=True, eq=False)
class CacheFacts:
    """A snapshot of one paged KV cache's bookkeeping (host-side)."""

    num_blocks_total: int
    free_blocks: Sequence[int]
    block_tables: Mapping[str, Sequence[int]]
    finished_requests: Sequence[str] = ()
    cache_lengths: Mapping[str, int] | None = None
    committed_lengths: Mapping[str, int] | None = None
    block_size: int | None = None
    live_requests: frozenset[str] | None = None
    """Requests the scheduler still runs after the step; any other request holding a block is a leak (KV-4)."""
