"""Reference paged attention: a per-request loop in plain PyTorch that checks its inputs like a kernel.

The point is clarity, not speed: each real request gathers its context from the
paged cache and runs ordinary masked softmax attention. What it shares with a
production kernel is the validation: the row counts a kernel would trust
(query rows vs ``query_start_loc[-1]``, slot mapping length) are checked with
the messages those kernels give, so that a metadata bug fails here the way it
fails on a GPU, rather than silently reading the wrong rows.
"""

from __future__ import annotations

import itertools
import math

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from contracts import AttentionMetadata
from specdec.kv_storage import PagedKVStorage


def host_query_start_loc(meta: AttentionMetadata) -> list[int]:
    """``query_start_loc`` as host integers: the mirror when present (no sync), else a device read."""
    source = meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc
    return [int(v) for v in source.tolist()]


def host_seq_lens(meta: AttentionMetadata) -> list[int]:
    """``seq_lens`` as host integers: the mirror when present (no sync), else a device read."""
    source = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens
    return [int(v) for v in source.tolist()]


def write_kv(
    kv: PagedKVStorage,
    layer: int,
    meta: AttentionMetadata,
    key: Float[Tensor, "num_tokens kv_heads head_dim"],
    value: Float[Tensor, "num_tokens kv_heads head_dim"],
) -> None:
    """Store this step's K/V for every model row; padded rows carry ``PAD_SLOT_ID`` and are dropped.

    The slot mapping is sized by the model rows (``desc.num_tokens``), not by the
    attention rows: DP- and graph-padded rows run through the projections too,
    and a mapping that is too short would leave them without a slot.
    """
    rows = key.shape[0]
    if meta.slot_mapping.dim() != 1 or meta.slot_mapping.shape[0] != rows:
        raise ValueError(
            f"slot_mapping has {tuple(meta.slot_mapping.shape)} entries but the model runs {rows} rows; the KV write "
            "covers every model row (padded rows hold PAD_SLOT_ID), so slot_mapping must have desc.num_tokens entries"
        )
    kv.write(layer, meta.slot_mapping, key, value)


def validate_attention_inputs(q: Float[Tensor, "rows heads head_dim"], meta: AttentionMetadata) -> list[int]:
    """The checks a batched prefill/decode kernel makes before launching; returns the host ``query_start_loc``."""
    rows = q.shape[0]
    padded = meta.num_reqs_padded
    if meta.query_start_loc.shape[0] != padded + 1:
        raise ValueError(
            f"query_start_loc has {meta.query_start_loc.shape[0]} entries; num_reqs_padded + 1 = {padded + 1} expected"
        )
    if meta.seq_lens.shape[0] != padded:
        raise ValueError(f"seq_lens has {meta.seq_lens.shape[0]} entries; num_reqs_padded = {padded} expected")
    if meta.block_table.dim() != 2 or meta.block_table.shape[0] != padded:
        raise ValueError(
            f"block_table has shape {tuple(meta.block_table.shape)}; [num_reqs_padded={padded}, max_blocks] expected"
        )
    if not 0 <= meta.num_reqs <= padded:
        raise ValueError(f"num_reqs={meta.num_reqs} is outside [0, num_reqs_padded={padded}]")
    if rows != meta.num_tokens_padded:
        raise ValueError(
            f"attention got {rows} query rows but meta.num_tokens_padded is {meta.num_tokens_padded}; "
            "the kernel runs over exactly num_tokens_padded rows"
        )
    qsl = host_query_start_loc(meta)
    qsl_last = qsl[-1]
    # FlashInfer's plan() checks this; with request padding (FULL graphs) the rows past the tail belong to
    # padded requests and are legal, without it they are rows no request owns.
    if (padded == meta.num_reqs and rows != qsl_last) or rows < qsl_last:
        raise RuntimeError(f"q.shape[0] ({rows}) != qo_indptr[-1] ({qsl_last})")
    if qsl[0] != 0 or any(b < a for a, b in itertools.pairwise(qsl)):
        raise ValueError(f"query_start_loc must start at 0 and be non-decreasing, got {qsl}")
    return qsl


def paged_attention(
    q: Float[Tensor, "rows heads head_dim"],
    meta: AttentionMetadata,
    kv: PagedKVStorage,
    layer: int,
    *,
    scale: float | None = None,
    sparse_mask: Bool[Tensor, "num_reqs_padded max_seq"] | None = None,
) -> Float[Tensor, "rows heads head_dim"]:
    """Attention of each request's queries over its cached context (this step's K/V already written).

    Request ``r < meta.num_reqs`` owns query rows ``qsl[r]:qsl[r+1]`` and the
    cached positions ``[0, seq_lens[r])``. Causal: query ``i`` of a request with
    query length ``L`` sits at position ``S - L + i`` and sees positions up to
    its own. Non-causal (block drafters): every query sees all ``S`` positions.
    ``sparse_mask[r, s]`` (sparse indexer) restricts request ``r`` to the
    selected positions. Rows of padded requests and rows past the real tokens
    get zeros. Grouped-query attention repeats each KV head for its query heads.
    """
    qsl = validate_attention_inputs(q, meta)
    seq_lens = host_seq_lens(meta)
    heads, head_dim = q.shape[1], q.shape[2]
    if head_dim != kv.head_dim or heads % kv.num_kv_heads != 0:
        raise ValueError(
            f"queries have {heads} heads of {head_dim}; the cache has {kv.num_kv_heads} KV heads of {kv.head_dim} "
            "(query heads must be a multiple of KV heads and head_dim must match)"
        )
    if sparse_mask is not None and sparse_mask.shape[0] != meta.num_reqs_padded:
        raise ValueError(f"sparse_mask has {sparse_mask.shape[0]} rows; num_reqs_padded={meta.num_reqs_padded}")
    n_rep = heads // kv.num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros_like(q)
    for r in range(meta.num_reqs):
        start, end, seq_len = qsl[r], qsl[r + 1], seq_lens[r]
        query_len = end - start
        if query_len == 0:
            continue
        if seq_len < query_len:
            raise ValueError(f"request {r}: seq_len {seq_len} < query_len {query_len}; its queries must be cached")
        keys, values = kv.gather(layer, meta.block_table[r], seq_len)
        allowed = _allowed(query_len, seq_len, meta.causal, q.device)
        if sparse_mask is not None:
            if sparse_mask.shape[1] < seq_len:
                raise ValueError(f"sparse_mask covers {sparse_mask.shape[1]} positions; request {r} has {seq_len}")
            allowed = allowed & sparse_mask[r, :seq_len][None, :]
        out[start:end] = attend(
            q[start:end],
            keys.repeat_interleave(n_rep, dim=1),
            values.repeat_interleave(n_rep, dim=1),
            allowed,
            scale,
        )
    return out


def attend(
    q: Float[Tensor, "q_len heads head_dim"],
    keys: Float[Tensor, "kv_len heads head_dim"],
    values: Float[Tensor, "kv_len heads head_dim"],
    allowed: Bool[Tensor, "q_len kv_len"],
    scale: float,
) -> Float[Tensor, "q_len heads head_dim"]:
    """Masked softmax attention of one request, scores in float32."""
    scores = torch.einsum("qhd,khd->hqk", q.to(torch.float32), keys.to(torch.float32)) * scale
    scores = scores.masked_fill(~allowed[None, :, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, values.to(torch.float32)).to(q.dtype)


def _allowed(query_len: int, seq_len: int, causal: bool, device: torch.device) -> Bool[Tensor, "q_len kv_len"]:
    if not causal:
        return torch.ones((query_len, seq_len), dtype=torch.bool, device=device)
    query_pos: Int[Tensor, " q_len"] = seq_len - query_len + torch.arange(query_len, device=device)
    key_pos = torch.arange(seq_len, device=device)
    return key_pos[None, :] <= query_pos[:, None]
