"""Public builders for a drafter's draft steps: the DP-synced step shape, draft-decode and block-draft metadata.

Hand-building draft metadata and the DP-padded descriptor is where the
padding bugs live (the DP pad counted as attention queries, an idle rank
skipping the dummy step its peers' collectives wait for). The shipped drafters
build theirs with these functions, and a third-party drafter can too:

- ``sync_draft_step``: one draft DP sync and the model rows every rank runs
  (the DP pad included, an idle rank's dummy step included);
- ``draft_decode_positions`` / ``build_decode_metadata`` /
  ``advance_decode_metadata``: one query per drafting request at step k;
- ``build_block_metadata``: q bidirectional queries per drafting request;
- ``padded_rows`` / ``pad_model_rows``: model inputs padded to ``desc.num_tokens``.

Model inputs of a draft step have ``desc.num_tokens`` rows (the DP pad is kept
there because a drafter's collectives need equal sizes); attention metadata
never counts the DP pad as queries (AR-5, BLK-3).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from jaxtyping import Int, Shaped
from torch import Tensor

from contracts import AttentionMetadata, BatchExecutionDescriptor, CUDAGraphMode, DPSyncState
from specdec.attn_metadata import padded_request_fields, padded_slot_mapping
from specdec.dp_sync import pad_model_rows_for_dp
from specdec.kv_cache import KVCacheManager

if TYPE_CHECKING:
    from specdec.speculator import DraftContext

# -- the step shape: DP sync and DP pad -------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftStep:
    """One draft step after its DP sync: the descriptor every rank agreed on, with this rank's requests.

    ``desc.num_tokens`` is the model rows this rank runs: under eager DP it is
    padded to the largest rank's count (every rank passes equal rows to the
    drafter's collectives); an idle rank (``num_reqs == 0``) still runs those
    rows as a dummy step while a peer drafts. ``skipped`` means no rank drafts:
    every rank then skips the forward alike.
    """

    state: DPSyncState
    desc: BatchExecutionDescriptor
    num_reqs: int
    query_width: int
    num_tokens_across_dp: tuple[int, ...]

    @property
    def skipped(self) -> bool:
        return self.desc.num_tokens == 0

    @property
    def idle(self) -> bool:
        """This rank drafts nothing but runs the dummy step its peers' collectives need."""
        return self.num_reqs == 0 and not self.skipped


def sync_draft_step(ctx: DraftContext, num_reqs: int, query_width: int, *, purpose: str) -> DraftStep:
    """The DP sync of a draft step with ``query_width`` queries per drafting request, and its padded model rows.

    Every rank must call it equally often, drafting or not (DP-3). The sync
    never picks a piecewise graph (AR-3), dispatches exactly ``query_width``
    tokens per request (AR-4, BLK-2), and under eager DP the model rows are
    padded to the largest rank's (DP-2 accepts that common pad), so a rank with
    no requests runs a dummy step rather than skipping it (DESC-5).
    """
    if num_reqs < 0 or query_width < 1:
        raise ValueError(f"a draft step needs num_reqs >= 0 and query_width >= 1, got {num_reqs} and {query_width}")
    state, desc = ctx.sync(
        num_reqs,
        num_reqs * query_width,
        query_width if num_reqs else None,
        allow_piecewise=False,
        purpose=purpose,
    )
    if desc.num_tokens == 0:
        return DraftStep(state, desc, num_reqs, query_width, state.num_tokens_across_dp)
    padded, across = pad_model_rows_for_dp(desc, state, num_reqs, query_width)
    return DraftStep(state, padded, num_reqs, query_width, across)


def padded_rows(values: Sequence[int], rows: int, device: torch.device) -> Int[Tensor, " rows"]:
    """Host integers (positions, ids, row indices) followed by zeros up to ``rows`` model rows."""
    out = torch.zeros(rows, dtype=torch.int64, device=device)
    if values:
        out[: len(values)] = torch.tensor(list(values), dtype=torch.int64)
    return out


def pad_model_rows(x: Shaped[Tensor, n * rest], rows: int) -> Shaped[Tensor, rows * rest]:
    """Device rows (drafted ids, hidden states) followed by zero rows up to ``rows``: no host copy of ``x``."""
    if x.shape[0] > rows:
        raise ValueError(f"{x.shape[0]} rows do not fit in {rows} model rows (desc.num_tokens)")
    out = x.new_zeros((rows, *x.shape[1:]))
    out[: x.shape[0]] = x
    return out


# -- draft decode: one query per drafting request ---------------------------------------------------------------------


def draft_decode_positions(base_positions: Sequence[int], k: int, max_model_len: int) -> list[int]:
    """Positions of draft decode step ``k`` (1-based): ``P + k``, clamped to ``max_model_len - 1`` (AR-8)."""
    return [min(p + k, max_model_len - 1) for p in base_positions]


def decode_attention_rows(desc: BatchExecutionDescriptor, num_reqs: int) -> int:
    """One query per request row; ``desc.num_tokens`` would include the DP pad (the motivating bug, AR-5)."""
    return desc.num_reqs_padded(num_reqs)


def build_decode_metadata(
    desc: BatchExecutionDescriptor,
    req_ids: Sequence[str],
    positions: Sequence[int],
    kv: KVCacheManager,
    max_model_len: int,
    device: torch.device,
) -> AttentionMetadata:
    """Draft decode metadata for requests at ``positions`` (``draft_decode_positions``: already clamped).

    Satisfies AR-5 (``num_reqs_padded`` attention rows, never the DP pad),
    AR-7 (``query_start_loc[i] == min(i, num_reqs)``), AR-8 (``seq_lens ==
    positions + 1``), KV-3 (``desc.num_tokens`` slots, ``PAD_SLOT_ID`` past the
    real rows) and PAD-1..PAD-3 (padded requests empty). The block table is
    ``kv``'s, a draft cache from ``ctx.new_cache``; each position must lie in
    the request's blocks (``kv.ensure_capacity``).
    """
    num_reqs = len(req_ids)
    seq = [min(p + 1, max_model_len) for p in positions]
    slots = [kv.slot_mapping(r, [p])[0] for r, p in zip(req_ids, positions, strict=True)]
    return AttentionMetadata(
        num_reqs=num_reqs,
        num_tokens=num_reqs,
        num_tokens_padded=decode_attention_rows(desc, num_reqs),
        max_query_len=1,
        causal=True,
        slot_mapping=padded_slot_mapping(slots, desc.num_tokens, device),
        **padded_request_fields(
            [1] * num_reqs, seq, [kv.block_table(r) for r in req_ids], desc.num_reqs_padded(num_reqs), device
        ),
    )


def advance_decode_metadata(
    meta: AttentionMetadata,
    req_ids: Sequence[str],
    positions: Sequence[int],
    kv: KVCacheManager,
    max_model_len: int,
) -> AttentionMetadata:
    """A fused decode's step to the next positions: ``seq_lens`` and slots updated in the same buffers (AR-8).

    The tensors are written in place (what makes the decode fused: one set of
    buffers for every step); the metadata itself stays frozen, so the step gets
    a new ``AttentionMetadata`` over those buffers with its ``max_seq_len``,
    which bounds kernels and therefore stays an upper bound.
    """
    n = len(req_ids)
    seq = [min(p + 1, max_model_len) for p in positions]
    slots = [kv.slot_mapping(r, [p])[0] for r, p in zip(req_ids, positions, strict=True)]
    if n:
        meta.seq_lens[:n] = torch.tensor(seq, dtype=meta.seq_lens.dtype)
        meta.slot_mapping[:n] = torch.tensor(slots, dtype=meta.slot_mapping.dtype)
        if meta.seq_lens_cpu is not None:
            meta.seq_lens_cpu[:n] = torch.tensor(seq, dtype=meta.seq_lens_cpu.dtype)
    return dataclasses.replace(meta, max_seq_len=max([meta.max_seq_len, *seq]))


# -- block draft: q bidirectional queries per drafting request --------------------------------------------------------


def block_attention_rows(desc: BatchExecutionDescriptor, num_reqs: int, q: int) -> int:
    """Attention query rows; ``desc.num_tokens`` outside FULL would include the DP pad (the follow-up bug, BLK-3)."""
    if desc.cg_mode is CUDAGraphMode.FULL:
        return desc.num_tokens
    return num_reqs * q


def build_block_metadata(
    desc: BatchExecutionDescriptor,
    req_ids: Sequence[str],
    base_positions: Sequence[int],
    q: int,
    kv: KVCacheManager,
    max_model_len: int,
    device: torch.device,
) -> AttentionMetadata:
    """Block metadata for queries at ``P + 1 .. P + q`` of requests whose last committed position is ``P``.

    Satisfies BLK-3 (``num_reqs * q`` attention rows outside FULL, never the DP
    pad), BLK-4 (``query_start_loc[r] == r * q``, padded requests empty), BLK-5
    (``seq_lens == P + 1 + q``, clamped to ``max_model_len``) and BLK-6 (the
    block's own K/V are never cached: every slot is ``PAD_SLOT_ID``).
    """
    num_reqs = len(req_ids)
    return AttentionMetadata(
        num_reqs=num_reqs,
        num_tokens=num_reqs * q,
        num_tokens_padded=block_attention_rows(desc, num_reqs, q),
        max_query_len=q,
        causal=False,
        slot_mapping=padded_slot_mapping([], desc.num_tokens, device),  # block K/V are never cached (BLK-6)
        query_width=q,
        **padded_request_fields(
            [q] * num_reqs,
            [min(p + 1 + q, max_model_len) for p in base_positions],
            [kv.block_table(r) for r in req_ids],
            desc.num_reqs_padded(num_reqs),
            device,
        ),
    )
