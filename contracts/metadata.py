"""Tensor-valued vocabulary of a step: attention metadata and the verifier's I/O.

Dimension names are shared with the descriptor: ``num_tokens`` is
``desc.num_tokens`` (the model rows that run, DP pad included),
``num_reqs_padded`` is ``desc.num_reqs or num_reqs``, and ``num_tokens_padded``
is the attention row count the kernel sees, which for draft decode must not
include the DP pad (AR-5, BLK-3).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxtyping import Float, Int
from torch import Tensor

PAD_SLOT_ID = -1
"""Slot of every padded token; a KV write to it is dropped."""

REJECTED_TOKEN_ID = -1
"""Sentinel for unused entries of the verifier's output rows."""


@dataclass(frozen=True, eq=False)
class AttentionMetadata:
    """What an attention kernel is told about one forward.

        ``num_reqs`` and ``num_tokens`` are the real (unpadded) counts;
        ``num_reqs_padded`` rows exist in every per-request tensor, padded requests
        being empty (``query_start_loc`` flat past ``num_reqs``, ``seq_lens`` 0);
        ``num_tokens_padded`` is the number of query rows attention runs over: the
    descriptor's ``num_tokens`` under FULL (the whole step, attention included, is
    one captured graph) and the real query rows otherwise (eager and piecewise
    steps run attention outside any graph, on exactly the real tokens; AR-5,
    BLK-3, TGT-7).
        ``slot_mapping`` is sized by the model rows (``desc.num_tokens``) because
        the KV write happens for every model row; padded rows hold ``PAD_SLOT_ID``.
        The ``*_cpu`` mirrors are host copies that [H] checks read without a sync.
    """

    num_reqs: int
    num_reqs_padded: int
    num_tokens: int
    num_tokens_padded: int
    max_query_len: int
    max_seq_len: int
    causal: bool
    seq_lens: Int[Tensor, " num_reqs_padded"]
    query_start_loc: Int[Tensor, " num_reqs_padded+1"]
    block_table: Int[Tensor, "num_reqs_padded max_blocks"]
    slot_mapping: Int[Tensor, " num_tokens"]
    query_start_loc_cpu: Int[Tensor, " num_reqs_padded+1"] | None = None
    seq_lens_cpu: Int[Tensor, " num_reqs_padded"] | None = None
    query_width: int | None = None
    """Per-request block width q for block drafters (bidirectional blocks)."""


@dataclass(frozen=True, eq=False)
class VerifierInput:
    """Drafts and distributions handed to the rejection sampler.

    ``target_logits`` has one row per verified position: for each real request
    ``num_draft_tokens[r] + 1`` rows (drafts plus the bonus), request-major.
    ``draft_probs`` is the proposal each draft token was drawn from; ``None``
    means deterministic (argmax) drafts, i.e. one-hot proposals.
    """

    draft_token_ids: Int[Tensor, "num_reqs max_draft"]
    num_draft_tokens: Int[Tensor, " num_reqs"]
    target_logits: Float[Tensor, "num_logits vocab"]
    draft_probs: Float[Tensor, "num_reqs max_draft vocab"] | None = None


@dataclass(frozen=True, eq=False)
class RecoveryEvidence:
    """What each sampled request's recovered (or bonus) token was drawn from, and the two distributions behind it.

    Row ``i`` is request ``rows[i]``, stopped at slot ``position[i]`` (its
    accepted drafts): ``target`` is p there and ``proposal`` the q of the
    rejected draft (all zero at the bonus, or where the slot had no usable
    draft). By definition ``distribution`` is max(0, p - q) normalised, or p
    itself where that residual has no mass (VER-10).
    """

    rows: Int[Tensor, " n"]
    position: Int[Tensor, " n"]
    target: Float[Tensor, "n vocab"]
    proposal: Float[Tensor, "n vocab"]
    distribution: Float[Tensor, "n vocab"]


@dataclass(frozen=True, eq=False)
class VerifierOutput:
    """Accepted tokens per request; entries past ``num_accepted + 1`` hold ``REJECTED_TOKEN_ID``."""

    output_token_ids: Int[Tensor, "num_reqs max_draft_plus_one"]
    num_accepted: Int[Tensor, " num_reqs"]
    recovery: RecoveryEvidence | None = None
    """The sampled requests' recovered-token distributions, for VER-10 (None when every request is greedy)."""
