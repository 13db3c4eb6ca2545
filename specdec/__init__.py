"""The specdec runtime: padding and DP sync, paged KV cache, attention metadata, engine.

The names below are the public API a third-party backend is written against.
They load lazily (PEP 562), so ``import specdec`` stays cheap and importing a
submodule does not pull in the whole runtime before an import hook (the test
suite's jaxtyping hook) is installed.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING, Any

try:
    __version__ = metadata.version("specdec")
    """From the installed distribution, so ``pyproject.toml`` is the one place the version is written."""
except metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "CompletionOutput": "specdec.llm",
    "ContextTaker": "specdec.speculator",
    "LLM": "specdec.llm",
    "RequestOutput": "specdec.llm",
    "DPGroup": "specdec.dp_group",
    "DraftContext": "specdec.speculator",
    "DraftHeads": "specdec.draft_heads",
    "DraftStep": "specdec.draft_builders",
    "DraftModel": "specdec.speculator",
    "DraftOutput": "specdec.speculator",
    "Engine": "specdec.engine",
    "EngineConfig": "specdec.engine",
    "FreeDraft": "specdec.shadow_drafts",
    "ModelConfig": "specdec.nn.config",
    "ModelOutput": "specdec.nn.transformer",
    "PagedKVStorage": "specdec.kv_storage",
    "Proposal": "specdec.speculator",
    "RunMetrics": "specdec.engine",
    "SamplingParams": "specdec.sampling",
    "ScheduledRequest": "specdec.attn_metadata",
    "SchedulerConfig": "specdec.scheduler",
    "Speculator": "specdec.speculator",
    "StepKindError": "specdec.draft_step_kinds",
    "TargetStep": "specdec.speculator",
    "Transformer": "specdec.nn.transformer",
    "advance_decode_metadata": "specdec.draft_builders",
    "build_block_metadata": "specdec.draft_builders",
    "build_decode_metadata": "specdec.draft_builders",
    "draft_decode_positions": "specdec.draft_builders",
    "keep_freed_memory": "specdec.host_allocator",
    "pad_model_rows": "specdec.draft_builders",
    "padded_rows": "specdec.draft_builders",
    "rows_to_score": "specdec.speculator",
    "sync_draft_step": "specdec.draft_builders",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "ContextTaker",
    "DPGroup",
    "DraftContext",
    "DraftHeads",
    "DraftModel",
    "DraftOutput",
    "DraftStep",
    "Engine",
    "EngineConfig",
    "FreeDraft",
    "ModelConfig",
    "ModelOutput",
    "PagedKVStorage",
    "Proposal",
    "RequestOutput",
    "RunMetrics",
    "SamplingParams",
    "ScheduledRequest",
    "SchedulerConfig",
    "Speculator",
    "StepKindError",
    "TargetStep",
    "Transformer",
    "__version__",
    "advance_decode_metadata",
    "build_block_metadata",
    "build_decode_metadata",
    "draft_decode_positions",
    "keep_freed_memory",
    "pad_model_rows",
    "padded_rows",
    "rows_to_score",
    "sync_draft_step",
]

if TYPE_CHECKING:
    from specdec.attn_metadata import ScheduledRequest
    from specdec.dp_group import DPGroup
    from specdec.draft_builders import (
        DraftStep,
        advance_decode_metadata,
        build_block_metadata,
        build_decode_metadata,
        draft_decode_positions,
        pad_model_rows,
        padded_rows,
        sync_draft_step,
    )
    from specdec.draft_heads import DraftHeads
    from specdec.draft_step_kinds import StepKindError
    from specdec.engine import Engine, EngineConfig, RunMetrics
    from specdec.host_allocator import keep_freed_memory
    from specdec.kv_storage import PagedKVStorage
    from specdec.llm import LLM, CompletionOutput, RequestOutput
    from specdec.nn.config import ModelConfig
    from specdec.nn.transformer import ModelOutput, Transformer
    from specdec.sampling import SamplingParams
    from specdec.scheduler import SchedulerConfig
    from specdec.shadow_drafts import FreeDraft
    from specdec.speculator import (
        ContextTaker,
        DraftContext,
        DraftModel,
        DraftOutput,
        Proposal,
        Speculator,
        TargetStep,
        rows_to_score,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
