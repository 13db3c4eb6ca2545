"""The device parts of a vLLM draft step, replaced by host code that fails the way the device would.

Everything else the harness runs is vLLM's own: the speculators' step methods,
the graph managers' dispatch, the DP sync, the metadata builders and
``CommonAttentionMetadata``. What is replaced here has no CPU build: Triton
kernels (input preparation, slot mappings, sampling), the attention backend,
the draft model's weights and the CUDA graph replay.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

PAD_SLOT_ID = -1


class KernelError(RuntimeError):
    """What the real attention kernel raises for metadata that does not fit its inputs."""


@dataclass(eq=False)
class PlannedAttention:
    """What a FlashInfer-style backend keeps after planning: the query row count and ``qo_indptr``."""

    num_actual_tokens: int
    qo_indptr: list[int]
    num_reqs: int


class StubAttentionBuilder:
    """Plans like a varlen attention backend: reads ``CommonAttentionMetadata``, keeps what its kernel checks."""

    supports_update_block_table = False

    def build(self, common_prefix_len: int, common_attn_metadata: Any, **_extra: Any) -> PlannedAttention:
        cam = common_attn_metadata
        return PlannedAttention(
            num_actual_tokens=int(cam.num_actual_tokens),
            qo_indptr=[int(x) for x in cam.query_start_loc_cpu.tolist()],
            num_reqs=int(cam.num_reqs),
        )

    def build_for_cudagraph_capture(self, common_attn_metadata: Any) -> PlannedAttention:
        return self.build(0, common_attn_metadata)

    def update_draft_decode_metadata(self, attn_metadata: Any) -> None:
        """Positions advance on the device between fused draft steps; the plan's row counts do not change."""


@dataclass
class StubAttentionGroup:
    layer_names: list[str]
    kv_cache_group_id: int = 0
    builder: StubAttentionBuilder = field(default_factory=StubAttentionBuilder)
    supports_draft_decode_metadata_update: bool = True

    def get_metadata_builder(self, ubatch_id: int = 0) -> StubAttentionBuilder:
        return self.builder

    def build_metadata(self, common_attn_metadata: Any, ubatch_id: int = 0, **extra: Any) -> PlannedAttention:
        return self.builder.build(0, common_attn_metadata, **extra)

    def build_metadata_for_cudagraph_capture(self, common_attn_metadata: Any, ubatch_id: int = 0) -> PlannedAttention:
        return self.builder.build_for_cudagraph_capture(common_attn_metadata)

    def update_draft_decode_metadata(self, attn_metadata: Any) -> None:
        self.builder.update_draft_decode_metadata(attn_metadata)

    def map_to_kernel_block_table(self, block_table: Tensor) -> None:
        """Block-size translation happens on the device; nothing to plan on the host."""

    @property
    def backend(self) -> Any:
        return SimpleNamespace(get_name=lambda: "STUB_FLASHINFER")


def attention_kernel(planned: PlannedAttention, num_rows: int) -> None:
    """The varlen kernel's own guard: the queries it is handed must be exactly the planned ones."""
    q_rows = min(planned.num_actual_tokens, num_rows)
    if q_rows != planned.qo_indptr[-1]:
        raise KernelError(f"q.shape[0] ({q_rows}) does not match qo_indptr[-1] ({planned.qo_indptr[-1]})")


_FORWARD = threading.local()


@contextmanager
def forward_context(attn_metadata: Any, *_args: Any, **kwargs: Any) -> Iterator[None]:
    """vLLM's ``set_forward_context`` reduced to what the stub model reads."""
    _FORWARD.attn_metadata = attn_metadata
    _FORWARD.num_tokens = kwargs.get("num_tokens")
    try:
        yield
    finally:
        _FORWARD.attn_metadata = None


class StubDraftModel(torch.nn.Module):
    """A draft model with one attention layer per planned group, run by the stub kernel."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.forwards = 0

    def forward(self, input_ids: Int[Tensor, " rows"], positions: Int[Tensor, " rows"], **_: Any) -> Tensor:
        self.forwards += 1
        rows = input_ids.shape[0]
        metadata = getattr(_FORWARD, "attn_metadata", None) or {}
        for planned in dict.fromkeys(metadata.values()):
            attention_kernel(planned, rows)
        return torch.zeros(rows, self.hidden_size)

    def combine_hidden_states(self, hidden: Tensor) -> Tensor:
        return hidden[..., : self.hidden_size]

    def precompute_and_store_context_kv(self, *_: Any, **__: Any) -> None:
        """Context K/V go into the paged cache on the device."""


class StubBlockTables:
    """Block tables and slot mappings as host buffers of vLLM's shapes; the slot kernels are not run."""

    def __init__(self, num_groups: int, max_num_reqs: int, max_num_tokens: int, max_blocks: int) -> None:
        self.input_block_tables = [torch.zeros(max_num_reqs, max_blocks, dtype=torch.int32) for _ in range(num_groups)]
        self.slot_mappings = torch.full((num_groups, max_num_tokens), PAD_SLOT_ID, dtype=torch.int64)
        self.block_sizes = [16] * num_groups
        self.kernel_block_sizes = [16] * num_groups
        self.cp_size = 1
        self.cp_rank = 0
        self.cp_interleave = 1

    def compute_slot_mappings(
        self, idx_mapping: Tensor, query_start_loc: Tensor, positions: Tensor, num_tokens: int
    ) -> Tensor:
        return self.slot_mappings[:, :num_tokens]

    def gather_block_tables(self, *_: Any, **__: Any) -> None:
        """Gathers on the device."""


def kv_cache_config(layer_names: list[str]) -> Any:
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=list(layer_names))])


def no_kernel(*_: Any, **__: Any) -> None:
    """A Triton kernel that prepares device buffers; its host-visible effects are set up by the harness."""
