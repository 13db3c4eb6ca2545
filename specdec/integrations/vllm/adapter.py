"""vLLM's step objects turned into the contracts' subjects.

Every function here reads vLLM objects by attribute and never imports vLLM, so it
serves every release in the version table. Each conversion keeps vLLM's values
as they are: a contract then judges vLLM's own numbers, and a violation quotes them.

Conventions resolved here rather than in the invariants:

- vLLM's attention metadata slot mapping covers the attention rows from 0.30 on,
  while the KV write of a forward goes through the per-layer slot mappings,
  which cover the model rows. The contracts' ``AttentionMetadata.slot_mapping``
  is the KV write's mapping, so the adapter hands over the per-layer one.
- vLLM keeps only an upper bound of the sequence lengths on the host, so
  ``seq_lens_cpu`` stays empty rather than holding a bound a check would read as exact.
- vLLM's ``DPSyncState`` carries no graph mode, DP size or collective counter:
  the graph mode is ``NONE`` when the ranks agreed on eager and otherwise the
  descriptor's, or ``PIECEWISE`` (the weakest graph mode) when the descriptor found
  no graph for the agreed size and fell back to eager with the agreed count,
  the DP size comes from the speculator, and no cross-rank evidence is claimed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxtyping import Float, Int
from torch import Tensor

from contracts import AttentionMetadata, BatchExecutionDescriptor, BatchFacts, CUDAGraphMode, DPSyncState


def descriptor(vllm_desc: Any) -> BatchExecutionDescriptor:
    """vLLM's ``BatchExecutionDescriptor`` (whatever extra fields its release has) as the contracts' one."""
    return BatchExecutionDescriptor(
        cg_mode=CUDAGraphMode[vllm_desc.cg_mode.name],
        num_tokens=int(vllm_desc.num_tokens),
        num_reqs=None if vllm_desc.num_reqs is None else int(vllm_desc.num_reqs),
        uniform_token_count=vllm_desc.uniform_token_count,
    )


def dp_state(vllm_sync: Any, desc: BatchExecutionDescriptor, dp_size: int) -> DPSyncState:
    """vLLM's ``DPSyncState``; its token counts live in a host tensor, so reading them costs no device sync."""
    counts = vllm_sync.num_tokens_across_dp
    if vllm_sync.eager:
        agreed = CUDAGraphMode.NONE
    else:
        # The ranks agreed on a graph mode; a descriptor that then found no graph for the
        # agreed size runs eager but keeps the agreed (padded) count, as vLLM intends.
        agreed = desc.cg_mode if desc.cg_mode is not CUDAGraphMode.NONE else CUDAGraphMode.PIECEWISE
    return DPSyncState(
        dp_size=dp_size,
        cg_mode=agreed,
        num_tokens_across_dp=tuple(int(n) for n in counts.tolist()),
        uniform_token_count=vllm_sync.uniform_token_count,
    )


def attention_metadata(
    common: Mapping[str, Any],
    *,
    num_reqs: int,
    num_tokens: int,
    slot_mapping: Int[Tensor, " model_rows"],
    query_width: int | None = None,
    kv_group: int = 0,
) -> AttentionMetadata:
    """Draft attention metadata from the arguments vLLM builds its ``CommonAttentionMetadata`` from.

    ``common`` holds those arguments by name (``num_reqs`` and ``num_tokens`` are
    the padded request rows and the attention rows, as vLLM passes them);
    ``num_reqs``/``num_tokens`` are the real counts of the step, and
    ``slot_mapping`` is the forward's per-layer mapping (model rows).
    """
    causal = common.get("causal", True)
    if isinstance(causal, Mapping):
        causal = causal.get(kv_group, True)
    return AttentionMetadata(
        num_reqs=num_reqs,
        num_reqs_padded=int(common["num_reqs"]),
        num_tokens=num_tokens,
        num_tokens_padded=int(common["num_tokens"]),
        max_query_len=int(common["max_query_len"]),
        max_seq_len=int(common["max_seq_len"]),
        causal=bool(causal),
        seq_lens=common["seq_lens"][: int(common["num_reqs"])],
        query_start_loc=common["query_start_loc_gpu"],
        block_table=common["block_tables"][kv_group],
        slot_mapping=slot_mapping,
        query_start_loc_cpu=common["query_start_loc_cpu"],
        seq_lens_cpu=None,
        query_width=query_width,
    )


def batch_facts(
    desc: BatchExecutionDescriptor,
    meta: AttentionMetadata,
    *,
    input_ids: Int[Tensor, " model_rows"],
    positions: Int[Tensor, " model_rows"],
    hidden_states: Float[Tensor, "model_rows hidden"] | None = None,
    max_model_len: int | None = None,
    num_spec_tokens: int | None = None,
    block_layout: str | None = None,
    dp_size: int | None = None,
) -> BatchFacts:
    return BatchFacts(
        desc=desc,
        num_reqs=meta.num_reqs,
        num_tokens=meta.num_tokens,
        meta=meta,
        input_ids=input_ids,
        positions=positions,
        hidden_states=hidden_states,
        max_model_len=max_model_len,
        num_spec_tokens=num_spec_tokens,
        block_layout=block_layout,
        dp_size=dp_size,
    )
