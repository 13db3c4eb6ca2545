"""Block-step attention metadata: q bidirectional queries per drafting request, request-major.

Model inputs of the block step have ``desc.num_tokens`` rows (the DP pad is
kept there: an MoE draft layer's collectives need equal sizes), but attention
runs over ``num_reqs * q`` query rows outside FULL mode and ``desc.num_tokens``
under FULL, where padded requests are zero-length (BLK-3, BLK-4). The block's
own K/V are never cached, so every slot is ``PAD_SLOT_ID`` (BLK-6).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from contracts import AttentionMetadata, BatchExecutionDescriptor, CUDAGraphMode
from specdec.attn_metadata import padded_request_fields, padded_slot_mapping
from specdec.kv_cache import KVCacheManager


def block_attention_rows(desc: BatchExecutionDescriptor, num_reqs: int, q: int) -> int:
    """Attention query rows; ``desc.num_tokens`` outside FULL would include the DP pad (the follow-up bug)."""
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
    """Metadata for blocks at ``P + 1 .. P + q`` of requests whose last committed position is ``P``."""
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
