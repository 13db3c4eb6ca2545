"""Reference paged attention in plain PyTorch that checks its inputs like a kernel.

Requests with the same query length are attended together: one gather of their
cached contexts through the block tables (padded to the group's longest, the
padding reading the cache's zero row and masked out) and one masked
``scaled_dot_product_attention``. The layout is planned once per forward and
shared by every layer (``AttentionPlan``), since a 30-layer model would
otherwise redo the same host work 30 times a step. What it shares with a
production kernel is the validation: the row counts a kernel would trust
(query rows vs ``query_start_loc[-1]``, slot mapping length) are checked with
the messages those kernels give, so that a metadata bug fails here the way it
fails on a GPU, rather than silently reading the wrong rows.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from contracts import PAD_SLOT_ID, AttentionMetadata
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
    *,
    buffer_rows: Int[Tensor, " num_tokens"] | None = None,
) -> None:
    """Store this step's K/V for every model row; padded rows carry ``PAD_SLOT_ID`` and are dropped.

    The slot mapping is sized by the model rows (``desc.num_tokens``), not by the
    attention rows: DP- and graph-padded rows run through the projections too,
    and a mapping that is too short would leave them without a slot.
    ``buffer_rows`` is ``kv.write_rows(meta.slot_mapping)``, when a forward
    computed it once for all its layers.
    """
    check_slot_mapping(meta, key.shape[0])
    kv.write(layer, meta.slot_mapping, key, value, buffer_rows=buffer_rows)


def check_slot_mapping(meta: AttentionMetadata, rows: int) -> None:
    """A KV write covers every model row: ``meta.slot_mapping`` must have ``rows`` entries (the kernel's check)."""
    if meta.slot_mapping.dim() != 1 or meta.slot_mapping.shape[0] != rows:
        raise ValueError(
            f"slot_mapping has {tuple(meta.slot_mapping.shape)} entries but the model runs {rows} rows; the KV write "
            "covers every model row (padded rows hold PAD_SLOT_ID), so slot_mapping must have desc.num_tokens entries"
        )


def query_rows_metadata(meta: AttentionMetadata, rows: Sequence[int]) -> AttentionMetadata:
    """Metadata that attends only ``rows`` of a causal forward whose K/V are already written.

    Each row becomes a one-query request over its own prefix: row ``j`` of
    request ``r`` (query rows ``qsl[r]:qsl[r+1]``, context ``S_r``) sits at
    position ``S_r - (qsl[r+1] - j)``. A drafter that samples a few rows (EAGLE's
    last row per request) still writes every row's K/V for later queries, but
    needs attention, the output projection and the MLP at those rows only.
    Nothing is written through this metadata (its slots are ``PAD_SLOT_ID``).
    """
    if not meta.causal:
        raise ValueError("query_rows_metadata needs causal metadata: a bidirectional block's rows see the whole block")
    qsl = host_query_start_loc(meta)[: meta.num_reqs + 1]
    seq = host_seq_lens(meta)
    owners, lens = [], []
    for row in rows:
        r = bisect.bisect_right(qsl, row) - 1
        if not (0 <= r < meta.num_reqs and qsl[r] <= row < qsl[r + 1]):
            raise ValueError(
                f"row {row} belongs to no real request: query_start_loc {qsl} covers rows 0..{qsl[-1] - 1}"
            )
        owners.append(r)
        lens.append(seq[r] - (qsl[r + 1] - 1 - row))
    m, device = len(rows), meta.seq_lens.device
    index = torch.tensor(owners, dtype=torch.int64, device=meta.block_table.device)
    starts = list(range(m + 1))
    return AttentionMetadata(
        num_reqs=m,
        num_reqs_padded=m,
        num_tokens=m,
        num_tokens_padded=m,
        max_query_len=1 if m else 0,
        max_seq_len=max(lens, default=0),
        causal=True,
        seq_lens=torch.tensor(lens, dtype=meta.seq_lens.dtype, device=device),
        query_start_loc=torch.tensor(starts, dtype=meta.query_start_loc.dtype, device=device),
        block_table=meta.block_table.index_select(0, index),
        slot_mapping=torch.full((m,), PAD_SLOT_ID, dtype=meta.slot_mapping.dtype, device=device),
        query_start_loc_cpu=torch.tensor(starts, dtype=torch.int32),
        seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
    )


def validate_attention_inputs(q: Float[Tensor, "rows heads head_dim"], meta: AttentionMetadata) -> list[int]:
    """The checks a batched prefill/decode kernel makes before launching; returns the host ``query_start_loc``."""
    return _validate_rows(q.shape[0], meta)


def _validate_rows(rows: int, meta: AttentionMetadata) -> list[int]:
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


EXACT_ROW_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16,)
"""Cache dtypes whose short causal groups of one request attend so that each row equals its decode step.

The CPU kernel rounds a query row differently depending on how many query rows
share its call (one row takes another path than two or more) and on its context
width unless that width is a multiple of ``EXACT_WIDTH_MULTIPLE``. So a verify
row attended in one call with its group's other rows can differ in the last bit
from the decode step of the same token. bf16's packed linears are row-invariant
(the same bits at any row count), so once attention is too, a verify row equals
that decode bit for bit, and a bf16 logit tie (frequent: logits are rounded to
bf16) breaks the same way in both: speculative decoding then reproduces plain
greedy exactly. fp32's linears differ with the row count anyway (MKL), so fp32
keeps the single masked call."""
EXACT_ROW_MAX_QUERY = 16
"""Verify and block-draft sizes; longer groups (prefill chunks) take the single masked call."""
EXACT_WIDTH_MULTIPLE = 16
"""Exact groups attend over their context rounded up to a multiple of this, the tail masked.

Measured on the AMX CPU (torch 2.13, bf16, SmolLM2's 9 query and 3 KV heads of
64, 1 and 2 threads): a one-row call gives the same bits over any width that is
a multiple of 16 and covers the context (in 1,500 random contexts of 1 to 2,100
positions, none differed between the width rounded up to 16, 32 or 64 and the
width rounded up to 64 plus 16 to 192 positions), but not over the exact width
(16 % of 1,883 rows differed from the width rounded up to 64) nor one rounded up
to 4 or 8 (9 % and 5 % of 1,500). With the width fixed this way, a query row is
computed alone, as a decode row is, whether it is the call's only row or one of
several laid along the batch dimension (0 of 1,883 verify rows of 1 to 9 rows
differed from their decodes) or along the heads dimension, each row a block of
query heads with a mask of its own (0 of 9,477 rows of batches of 1 to 8
requests of 1 to 6 rows over 7 to 1,200 positions, 1 and 2 threads); several
query rows of one request as one call's query length differ (12 % of 2,728
rows). The rule is the kernel's, not a documented guarantee:
``test_bf16_verify_rows_equal_the_decode_steps_of_the_same_tokens_bit_for_bit``
and the lossless tests hold that on whatever CPU runs them."""


@dataclass(frozen=True, eq=False)
class _Group:
    """Requests with one query length, attended in one batched call over their contexts padded to ``width``."""

    requests: Int[Tensor, " reqs"]
    query_len: int
    width: int
    rows: Int[Tensor, " group_rows"] | None
    """The group's query rows, request-major; ``None`` when they are exactly all rows in order (no gather)."""
    slots: Int[Tensor, "reqs key_width"]
    start: int | None
    """For a lone request whose context sits in consecutive slots (a CPU cache; batch 1 usually): its first slot,
    so every layer reads a view of the cache instead of gathering it."""
    bias: Float[Tensor, "reqs 1 q_len width"]
    """The mask as scores to add (0 or -inf) in the cache's dtype: the form ``scaled_dot_product_attention`` turns
    a boolean mask into on every call, made once here for every layer."""
    key_width: int
    """Context positions read from the cache: ``width``, or for an exact group ``width`` rounded up to
    ``EXACT_WIDTH_MULTIPLE`` (the extra positions read the null row, or the cache slots just past a consecutive
    context, and are masked)."""
    exact_bias: Float[Tensor, "reqs q_len key_width"] | None = None
    """For an exact group: each query row's mask over ``key_width`` positions, ``query_len`` rows a request. The
    call lays a request's rows along the heads dimension, a block of query heads a row, and the kernel computes
    each head's one query row alone, as the decode of its token."""
    head_bias: dict[int, Tensor] = field(default_factory=dict)
    """``exact_bias`` spread over the query heads, by query head count: made by the first layer for the rest."""

    def exact_call_bias(self, heads: int, kv_heads: int) -> Float[Tensor, "items q_heads 1 key_width"]:
        """The exact mask in the call's layout (``_attend_exact``): per row for a lone request (its rows along the
        batch dimension), else per query head, ordered KV head, then row, then the heads sharing that KV head (the
        order grouped-query attention maps query heads to KV heads in)."""
        assert self.exact_bias is not None
        reqs, q_len, width = self.exact_bias.shape
        if reqs == 1 or q_len == 1:  # one mask for all heads of a row
            return self.exact_bias.view(reqs * q_len, 1, 1, width)
        bias = self.head_bias.get(heads)
        if bias is None:
            bias = self.head_bias[heads] = (
                self.exact_bias[:, None, :, None, :]
                .expand(reqs, kv_heads, q_len, heads // kv_heads, width)
                .reshape(reqs, kv_heads * q_len * (heads // kv_heads), 1, width)
            )
        return bias


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """One forward's attention layout, validated and tabulated once and reused by every layer.

    Every layer attends with the same metadata, so the kernel-style validation,
    the host reads, the slot tables and the masks are built once per forward
    (``Transformer.forward`` shares one plan across its layers) instead of once
    per layer and request. Requests are grouped by query length (decode, verify
    and each prefill chunk form their own groups), so a group pads only its
    contexts, never its queries.
    """

    meta: AttentionMetadata
    rows: int
    seq_lens: tuple[int, ...]
    groups: tuple[_Group, ...]

    @classmethod
    def build(
        cls,
        meta: AttentionMetadata,
        kv: PagedKVStorage,
        rows: int,
        *,
        per_request: bool = False,
        exact_rows: bool = True,
    ) -> AttentionPlan:
        """Validate ``meta`` for ``rows`` query rows like a kernel, then tabulate the groups.

        ``per_request``: every request is attended exactly as if it ran alone
        (its own width; bf16 rows as in ``exact_rows``), so its outputs do not
        depend on what else is in the batch. Each request is a group of its own,
        one attention call each, except bf16 decodes and verifies: the requests of
        one query length share a call, a request per item of the batch dimension
        over a common width that is a multiple of ``EXACT_WIDTH_MULTIPLE``, its rows
        along the heads dimension, which gives each row the bits it gets alone (the
        width rule, measured over any width covering the context). ``exact_rows``:
        a bf16 group of one request (a decode, a verify) attends each query row
        as its decode step would (``EXACT_ROW_DTYPES``); off, every group is one
        masked call over its exact width.
        """
        qsl = _validate_rows(rows, meta)
        seq_lens = host_seq_lens(meta)
        exact_dtype = exact_rows and meta.causal and kv.dtype in EXACT_ROW_DTYPES
        by_len: dict[tuple[int, int], list[int]] = {}
        for r in range(meta.num_reqs):
            query_len = qsl[r + 1] - qsl[r]
            if query_len == 0:
                continue
            if seq_lens[r] < query_len:
                raise ValueError(
                    f"request {r}: seq_len {seq_lens[r]} < query_len {query_len}; its queries must be cached"
                )
            # Exact rows attend alone wherever they sit, so requests of one query length share a call.
            alone = per_request and not (exact_dtype and query_len <= EXACT_ROW_MAX_QUERY)
            by_len.setdefault((query_len, r if alone else -1), []).append(r)
        device = kv.device
        groups = []
        for (query_len, _), reqs in by_len.items():
            lens = [seq_lens[r] for r in reqs]
            width = max(lens)
            index = torch.tensor(reqs, dtype=torch.int64, device=device)
            table = meta.block_table.index_select(0, index)
            slots = kv.slot_table(table, lens, width)
            row_ids = [row for r in reqs for row in range(qsl[r], qsl[r + 1])]
            in_order = len(by_len) == 1 and row_ids == list(range(rows))
            key_pos = torch.arange(width, device=device)
            ends = torch.tensor(lens, dtype=torch.int64, device=device)[:, None, None]
            if meta.causal:  # query i of a request of length S sits at position S - query_len + i
                query_pos = ends - query_len + torch.arange(query_len, device=device)[None, :, None]
                allowed = key_pos[None, None, :] <= query_pos
            else:
                allowed = (key_pos[None, None, :] < ends).expand(len(reqs), query_len, width)
            start = _consecutive_start(table, width, kv) if len(reqs) == 1 else None
            exact = exact_dtype and (start is not None or per_request) and query_len <= EXACT_ROW_MAX_QUERY
            key_width = -(-width // EXACT_WIDTH_MULTIPLE) * EXACT_WIDTH_MULTIPLE if exact else width
            if start is not None and start + key_width > kv.num_slots:
                start = None  # the rounded-up width runs past the cache: gather, the tail reading the null row
            if key_width > width:
                slots = F.pad(slots, (0, key_width - width), value=kv.null_slot)
            exact_bias = None
            if exact:  # each query row masked to its own prefix
                row_pos = ends.view(-1, 1) - query_len + torch.arange(query_len, device=device)
                row_allowed = torch.arange(key_width, device=device) <= row_pos[:, :, None]
                exact_bias = torch.zeros(row_allowed.shape, dtype=kv.dtype, device=device).masked_fill_(
                    ~row_allowed, float("-inf")
                )
            groups.append(
                _Group(
                    requests=index,
                    query_len=query_len,
                    width=width,
                    rows=None if in_order else torch.tensor(row_ids, dtype=torch.int64, device=device),
                    slots=slots,
                    start=start,
                    bias=torch.zeros(allowed.shape, dtype=kv.dtype, device=device).masked_fill_(
                        ~allowed, float("-inf")
                    )[:, None],
                    key_width=key_width,
                    exact_bias=exact_bias,
                )
            )
        return cls(meta, rows, tuple(seq_lens), tuple(groups))


def _consecutive_start(table: Int[Tensor, "1 max_blocks"], seq_len: int, kv: PagedKVStorage) -> int | None:
    """The first slot of a context held in consecutive blocks, read from a CPU block table (no device sync)."""
    if table.device.type != "cpu" or seq_len == 0:
        return None
    blocks = table[0, : -(-seq_len // kv.block_size)].tolist()
    if any(b != blocks[0] + i for i, b in enumerate(blocks)):
        return None
    return int(blocks[0]) * kv.block_size


def paged_attention(
    q: Float[Tensor, "rows heads head_dim"],
    meta: AttentionMetadata,
    kv: PagedKVStorage,
    layer: int,
    *,
    scale: float | None = None,
    sparse_mask: Bool[Tensor, "num_reqs_padded max_seq"] | None = None,
    plan: AttentionPlan | None = None,
) -> Float[Tensor, "rows heads head_dim"]:
    """Attention of each request's queries over its cached context (this step's K/V already written).

    Request ``r < meta.num_reqs`` owns query rows ``qsl[r]:qsl[r+1]`` and the
    cached positions ``[0, seq_lens[r])``. Causal: query ``i`` of a request with
    query length ``L`` sits at position ``S - L + i`` and sees positions up to
    its own. Non-causal (block drafters): every query sees all ``S`` positions.
    ``sparse_mask[r, s]`` (sparse indexer) restricts request ``r`` to the
    selected positions. Rows of padded requests and rows past the real tokens
    get zeros. Grouped-query attention: query head ``h`` reads KV head
    ``h // (heads // kv_heads)``. Scores and softmax are accumulated in float32 (a bf16 model's
    queries, keys and values go to the kernel in bf16; it accumulates in float32).

    ``plan`` (from ``AttentionPlan.build`` for this ``meta``) skips rebuilding
    the layout; without it the call validates and plans on its own.
    """
    if plan is None:
        plan = AttentionPlan.build(meta, kv, q.shape[0])
    elif plan.meta is not meta or plan.rows != q.shape[0]:
        raise ValueError(
            f"the attention plan was built for other metadata or another row count ({plan.rows} rows, "
            f"got {q.shape[0]}); build one plan per forward from the metadata the layers attend with"
        )
    heads, head_dim = q.shape[1], q.shape[2]
    if head_dim != kv.head_dim or heads % kv.num_kv_heads != 0:
        raise ValueError(
            f"queries have {heads} heads of {head_dim}; the cache has {kv.num_kv_heads} KV heads of {kv.head_dim} "
            "(query heads must be a multiple of KV heads and head_dim must match)"
        )
    if sparse_mask is not None:
        if sparse_mask.shape[0] != meta.num_reqs_padded:
            raise ValueError(f"sparse_mask has {sparse_mask.shape[0]} rows; num_reqs_padded={meta.num_reqs_padded}")
        for r in range(meta.num_reqs):
            if sparse_mask.shape[1] < plan.seq_lens[r]:
                raise ValueError(
                    f"sparse_mask covers {sparse_mask.shape[1]} positions; request {r} has {plan.seq_lens[r]}"
                )
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if len(plan.groups) == 1 and plan.groups[0].rows is None:
        return _attend_group(q, plan.groups[0], kv, layer, scale, sparse_mask)
    out = torch.zeros_like(q)
    for group in plan.groups:
        assert group.rows is not None  # only a lone group covering every row in order has none
        out.index_copy_(
            0, group.rows, _attend_group(q.index_select(0, group.rows), group, kv, layer, scale, sparse_mask)
        )
    return out


def _attend_group(
    q: Float[Tensor, "group_rows heads head_dim"],
    group: _Group,
    kv: PagedKVStorage,
    layer: int,
    scale: float,
    sparse_mask: Bool[Tensor, "num_reqs_padded max_seq"] | None,
) -> Float[Tensor, "group_rows heads head_dim"]:
    """One ``scaled_dot_product_attention`` for the whole group: ``[reqs, heads, q_len, head_dim]`` queries, or for
    an exact group one query row a head (``_attend_exact``)."""
    reqs, heads, head_dim = group.slots.shape[0], q.shape[1], q.shape[2]
    if group.start is not None:
        keys, values = kv.slot_range(layer, group.start, group.key_width)
        keys, values = keys.unsqueeze(0), values.unsqueeze(0)
    else:
        keys, values = kv.gather_slots(layer, group.slots)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)
    if group.exact_bias is not None:
        return _attend_exact(q, keys, values, group, scale, sparse_mask)
    if group.key_width > group.width:
        keys, values = keys[:, :, : group.width], values[:, :, : group.width]
    bias = group.bias if group.bias.dtype == q.dtype else group.bias.to(q.dtype)
    if sparse_mask is not None:
        selected = sparse_mask.index_select(0, group.requests)[:, None, None, : group.width]
        bias = bias.masked_fill(~selected, float("-inf"))
    queries = q.reshape(reqs, group.query_len, heads, head_dim).transpose(1, 2)
    # bf16 goes in as bf16: the CPU kernel accumulates scores and softmax in float32 itself (casting the
    # whole cached context to float32 first cost more than the attention).
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=bias, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(reqs * group.query_len, heads, head_dim)


def _attend_exact(
    q: Float[Tensor, "group_rows heads head_dim"],
    keys: Float[Tensor, "reqs kv_heads key_width head_dim"],
    values: Float[Tensor, "reqs kv_heads key_width head_dim"],
    group: _Group,
    scale: float,
    sparse_mask: Bool[Tensor, "num_reqs_padded max_seq"] | None,
) -> Float[Tensor, "group_rows heads head_dim"]:
    """An exact group's call, in which every query head has one query row over its request's whole context.

    A lone request's rows lie along the batch dimension, sharing its context (expanded, no copy). Several requests
    are a batch item each, their rows along the heads dimension, a block of query heads a row, ordered KV head, row,
    query head sharing that KV head, so that grouped-query attention maps each to its KV head. Both give each row the
    bits of its decode (the width rule); the lone layout is the cheaper one there (no transposes).
    """
    reqs, heads, head_dim = keys.shape[0], q.shape[1], q.shape[2]
    q_len, kv_heads = group.query_len, keys.shape[1]
    bias = group.exact_call_bias(heads, kv_heads)
    bias = bias if bias.dtype == q.dtype else bias.to(q.dtype)
    if sparse_mask is not None:  # each row also restricted to its request's selected positions
        selected = F.pad(
            sparse_mask.index_select(0, group.requests)[:, : group.width], (0, group.key_width - group.width)
        )
        bias = bias.masked_fill(~selected[:, None, None, :], -math.inf)  # a lone request's broadcasts over its rows
    heads_layout = reqs > 1 and q_len > 1
    if heads_layout:
        queries = (
            q.reshape(reqs, q_len, kv_heads, heads // kv_heads, head_dim)
            .transpose(1, 2)
            .reshape(reqs, heads * q_len, 1, head_dim)
        )
    else:
        queries = q.unsqueeze(2)
        if reqs == 1:
            keys, values = keys.expand(q_len, -1, -1, -1), values.expand(q_len, -1, -1, -1)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=bias, scale=scale, enable_gqa=True)
    if heads_layout:
        out = out.view(reqs, kv_heads, q_len, heads // kv_heads, head_dim).transpose(1, 2)
    return out.reshape(reqs * q_len, heads, head_dim)
