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

from contracts import PAD_SLOT_ID, AttentionMetadata, BatchExecutionDescriptor, CUDAGraphMode
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
    rows = desc.num_reqs_padded(num_reqs)
    qsl = [min(r, num_reqs) * q for r in range(rows + 1)]
    seq = [min(p + 1 + q, max_model_len) for p in base_positions] + [0] * (rows - num_reqs)
    tables = [kv.block_table(r) for r in req_ids]
    width = max([1, *(len(t) for t in tables)])
    block_table = [t + [0] * (width - len(t)) for t in tables] + [[0] * width] * (rows - num_reqs)
    return AttentionMetadata(
        num_reqs=num_reqs,
        num_reqs_padded=rows,
        num_tokens=num_reqs * q,
        num_tokens_padded=block_attention_rows(desc, num_reqs, q),
        max_query_len=q,
        max_seq_len=max(seq, default=0),
        causal=False,
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        block_table=torch.tensor(block_table, dtype=torch.int32, device=device).reshape(rows, width),
        slot_mapping=torch.full((desc.num_tokens,), PAD_SLOT_ID, dtype=torch.int64, device=device),
        query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
        seq_lens_cpu=torch.tensor(seq, dtype=torch.int32),
        query_width=q,
    )
