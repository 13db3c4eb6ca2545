"""Small builders of well-formed step objects that trigger tests then break on purpose."""

from __future__ import annotations

import torch

from contracts import AttentionMetadata, BatchExecutionDescriptor, BatchFacts, CUDAGraphMode

I32 = torch.int32


def decode_metadata(
    num_reqs: int, rows: int, attn_tokens: int, *, model_tokens: int | None = None, seq_base: int = 7
) -> AttentionMetadata:
    """One query per request: ``rows`` request rows, ``attn_tokens`` query rows, ``model_tokens`` slots."""
    qsl = torch.tensor([min(i, num_reqs) for i in range(rows + 1)], dtype=I32)
    seq = torch.tensor([seq_base + 1] * num_reqs + [0] * (rows - num_reqs), dtype=I32)
    return AttentionMetadata(
        num_reqs=num_reqs,
        num_reqs_padded=rows,
        num_tokens=num_reqs,
        num_tokens_padded=attn_tokens,
        max_query_len=1,
        max_seq_len=seq_base + 1,
        causal=True,
        seq_lens=seq,
        query_start_loc=qsl,
        block_table=torch.zeros((rows, 4), dtype=I32),
        slot_mapping=torch.full((model_tokens or attn_tokens,), -1, dtype=torch.int64),
        query_start_loc_cpu=qsl.clone(),
        seq_lens_cpu=seq.clone(),
    )


def decode_facts(
    num_reqs: int = 12, model_tokens: int = 13, *, mode: CUDAGraphMode = CUDAGraphMode.NONE, **meta_overrides: object
) -> BatchFacts:
    """The motivating rank: 12 requests, model inputs DP-padded to 13, metadata correct."""
    if mode is CUDAGraphMode.FULL:
        desc = BatchExecutionDescriptor(
            cg_mode=mode, num_tokens=model_tokens, num_reqs=model_tokens, uniform_token_count=1
        )
        rows, attn = model_tokens, model_tokens
    else:
        desc = BatchExecutionDescriptor(cg_mode=mode, num_tokens=model_tokens, num_reqs=num_reqs, uniform_token_count=1)
        rows, attn = num_reqs, num_reqs
    meta = decode_metadata(num_reqs, rows, attn, model_tokens=model_tokens)
    if meta_overrides:
        import dataclasses

        meta = dataclasses.replace(meta, **meta_overrides)  # type: ignore[arg-type]
    base = torch.arange(num_reqs, dtype=torch.int64) + 5
    positions = torch.zeros(model_tokens, dtype=torch.int64)
    positions[:num_reqs] = base + 1
    meta = _with_seq(meta, positions[:num_reqs] + 1)
    return BatchFacts(
        desc=desc,
        num_reqs=num_reqs,
        num_tokens=num_reqs,
        meta=meta,
        input_ids=torch.zeros(model_tokens, dtype=torch.int64),
        positions=positions,
        hidden_states=torch.zeros((model_tokens, 8)),
        base_positions=base,
        draft_step=1,
        max_model_len=4096,
    )


def _with_seq(meta: AttentionMetadata, real_seq: torch.Tensor) -> AttentionMetadata:
    import dataclasses

    seq = meta.seq_lens.clone()
    seq[: real_seq.shape[0]] = real_seq.to(seq.dtype)
    return dataclasses.replace(meta, seq_lens=seq, seq_lens_cpu=seq.clone())


def block_facts(
    num_reqs: int = 12, q: int = 4, model_tokens: int | None = None, *, n_spec: int = 3, layout: str = "bonus_first"
) -> BatchFacts:
    """A block-drafter step: ``q`` queries per request, model rows possibly DP-padded."""
    tokens = model_tokens if model_tokens is not None else num_reqs * q
    desc = BatchExecutionDescriptor(
        cg_mode=CUDAGraphMode.NONE, num_tokens=tokens, num_reqs=num_reqs, uniform_token_count=q
    )
    qsl = torch.tensor([r * q for r in range(num_reqs + 1)], dtype=I32)
    last_valid = torch.arange(num_reqs, dtype=torch.int64) + 10
    positions = torch.zeros(tokens, dtype=torch.int64)
    positions[: num_reqs * q] = (last_valid[:, None] + 1 + torch.arange(q)).reshape(-1)
    seq = (last_valid + 1 + q).to(I32)
    meta = AttentionMetadata(
        num_reqs=num_reqs,
        num_reqs_padded=num_reqs,
        num_tokens=num_reqs * q,
        num_tokens_padded=num_reqs * q,
        max_query_len=q,
        max_seq_len=int(seq.max()),
        causal=False,
        seq_lens=seq,
        query_start_loc=qsl,
        block_table=torch.zeros((num_reqs, 4), dtype=I32),
        slot_mapping=torch.full((tokens,), -1, dtype=torch.int64),
        query_start_loc_cpu=qsl.clone(),
        seq_lens_cpu=seq.clone(),
        query_width=q,
    )
    return BatchFacts(
        desc=desc,
        num_reqs=num_reqs,
        num_tokens=num_reqs * q,
        meta=meta,
        input_ids=torch.zeros(tokens, dtype=torch.int64),
        positions=positions,
        base_positions=last_valid,
        max_model_len=4096,
        num_spec_tokens=n_spec,
        block_layout=layout,
        context_slot_mapping=torch.tensor([3, 4, -1, -1]),
        context_committed=torch.tensor([True, True, False, False]),
    )
