"""Draft-decode attention metadata: exactly one query per request.

Model inputs of a draft decode step have ``desc.num_tokens`` rows (the DP pad
is kept there because the drafter's collectives need equal sizes), but the
attention metadata has ``num_reqs_padded`` requests and ``num_reqs_padded``
query rows: one per request, padded requests included under FULL, never the
DP pad (AR-5). The multi-step decode rebuilds it every step; the fused decode
builds it once and advances positions, ``seq_lens`` and slots in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Int
from torch import Tensor

from contracts import PAD_SLOT_ID, AttentionMetadata, BatchExecutionDescriptor
from specdec.kv_cache import KVCacheManager


def decode_attention_rows(desc: BatchExecutionDescriptor, num_reqs: int) -> int:
    """One query per request row; ``desc.num_tokens`` would include the DP pad (the motivating bug)."""
    return desc.num_reqs_padded(num_reqs)


def build_decode_metadata(
    desc: BatchExecutionDescriptor,
    req_ids: Sequence[str],
    positions: Sequence[int],
    kv: KVCacheManager,
    max_model_len: int,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata for one decode step whose real requests sit at ``positions`` (already clamped)."""
    num_reqs = len(req_ids)
    rows = desc.num_reqs_padded(num_reqs)
    qsl = [min(i, num_reqs) for i in range(rows + 1)]
    seq = [min(p + 1, max_model_len) for p in positions] + [0] * (rows - num_reqs)
    tables = [kv.block_table(r) for r in req_ids]
    width = max([1, *(len(t) for t in tables)])
    block_table = [t + [0] * (width - len(t)) for t in tables] + [[0] * width] * (rows - num_reqs)
    slots = [kv.slot_mapping(r, [p])[0] for r, p in zip(req_ids, positions, strict=True)]
    slots += [PAD_SLOT_ID] * (desc.num_tokens - num_reqs)
    return AttentionMetadata(
        num_reqs=num_reqs,
        num_reqs_padded=rows,
        num_tokens=num_reqs,
        num_tokens_padded=decode_attention_rows(desc, num_reqs),
        max_query_len=1,
        max_seq_len=max(seq, default=0),
        causal=True,
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        block_table=torch.tensor(block_table, dtype=torch.int32, device=device).reshape(rows, width),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
        seq_lens_cpu=torch.tensor(seq, dtype=torch.int32),
    )


def advance_decode_metadata(
    meta: AttentionMetadata,
    req_ids: Sequence[str],
    positions: Sequence[int],
    kv: KVCacheManager,
    max_model_len: int,
) -> None:
    """The fused decode's in-place update between steps: new ``seq_lens`` and slots, same buffers."""
    n = len(req_ids)
    seq = [min(p + 1, max_model_len) for p in positions]
    slots = [kv.slot_mapping(r, [p])[0] for r, p in zip(req_ids, positions, strict=True)]
    if n:
        meta.seq_lens[:n] = torch.tensor(seq, dtype=meta.seq_lens.dtype)
        meta.slot_mapping[:n] = torch.tensor(slots, dtype=meta.slot_mapping.dtype)
        if meta.seq_lens_cpu is not None:
            meta.seq_lens_cpu[:n] = torch.tensor(seq, dtype=meta.seq_lens_cpu.dtype)
    # max_seq_len is a plain int on a frozen dataclass; it bounds kernels, so keep it an upper bound.
    object.__setattr__(meta, "max_seq_len", max([meta.max_seq_len, *seq]))


def padded_rows(values: Sequence[int], rows: int, device: torch.device) -> Int[Tensor, " rows"]:
    """``values`` followed by zeros up to ``rows`` model rows."""
    out = torch.zeros(rows, dtype=torch.int64, device=device)
    if values:
        out[: len(values)] = torch.tensor(list(values), dtype=torch.int64)
    return out
