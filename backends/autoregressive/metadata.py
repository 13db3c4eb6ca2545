"""Draft-decode attention metadata: exactly one query per request.

Model inputs of a draft decode step have ``desc.num_tokens`` rows (the DP pad
is kept there because the drafter's collectives need equal sizes), but the
attention metadata has ``num_reqs_padded`` requests and ``num_reqs_padded``
query rows: one per request, padded requests included under FULL, never the
DP pad (AR-5). The multi-step decode rebuilds it every step; the fused decode
builds its buffers once and advances ``seq_lens`` and slots in them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from jaxtyping import Int
from torch import Tensor

from contracts import AttentionMetadata, BatchExecutionDescriptor
from specdec.attn_metadata import padded_request_fields, padded_slot_mapping
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
    """The fused decode's step to the next positions: ``seq_lens`` and slots updated in the same buffers.

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


def padded_rows(values: Sequence[int], rows: int, device: torch.device) -> Int[Tensor, " rows"]:
    """``values`` followed by zeros up to ``rows`` model rows."""
    out = torch.zeros(rows, dtype=torch.int64, device=device)
    if values:
        out[: len(values)] = torch.tensor(list(values), dtype=torch.int64)
    return out
