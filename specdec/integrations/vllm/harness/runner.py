"""Run one scenario through vLLM's own speculator code on CPU and say what happened on each rank.

The speculator objects are vLLM's classes, made without their ``__init__``
(which loads weights and allocates device buffers) and given the host buffers,
stub attention groups and stub model of ``stubs``. Graph managers are vLLM's,
built by the speculator's own ``init_cudagraph_manager`` and marked captured
without capturing, so that ``dispatch`` picks graphs as it does after start-up.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

import contracts
from contracts import ContractViolation
from specdec.integrations.vllm import hooks
from specdec.integrations.vllm.harness import stubs
from specdec.integrations.vllm.harness.dp import CollectiveMismatch, InProcessDPGroup
from specdec.integrations.vllm.harness.scenario import Scenario
from specdec.integrations.vllm.versions import ReleaseLayout

HIDDEN = 16
MAX_MODEL_LEN = 4096
MAX_BLOCKS = 8
DRAFT_LAYER = "draft.layers.0.attn"
MAX_BATCHED_TOKENS = 8192


@dataclass(frozen=True)
class RankOutcome:
    """``ok``, ``violation`` (a contract fired), ``kernel`` (the stub kernel failed as the device would) or ``error``."""

    rank: int
    kind: str
    invariant: str | None = None
    message: str = ""
    observed: dict[str, Any] = field(default_factory=dict)
    component: str = ""
    """For a violation, the vLLM method it was caught in (``vLLM 0.32.0 Gemma4Speculator._multi_step_decode``)."""


@dataclass(frozen=True)
class ScenarioResult:
    scenario: Scenario
    mode: str
    ranks: tuple[RankOutcome, ...]
    checks: dict[str, int] = field(default_factory=dict)
    """Boundaries the hooks checked in this scenario, by subject: a scenario that checked nothing proves nothing."""

    @property
    def kind(self) -> str:
        """The scenario's verdict: the first non-``ok`` rank outcome by severity, else ``ok``."""
        for kind in ("error", "violation", "kernel"):
            if any(r.kind == kind for r in self.ranks):
                return kind
        return "ok"

    @property
    def invariants(self) -> tuple[str, ...]:
        return tuple(sorted({r.invariant for r in self.ranks if r.invariant}))


class Release:
    """The imported modules of the vLLM release under test, and the patches the harness needs on them."""

    def __init__(self, layout: ReleaseLayout) -> None:
        self.layout = layout
        self.dflash = importlib.import_module(layout.dflash_module)
        self.dspark = importlib.import_module(layout.dspark_module)
        self.gemma4 = importlib.import_module(layout.gemma4_module).Gemma4Speculator
        self.dp_utils = importlib.import_module(layout.dp_module)
        self.graphs = importlib.import_module(layout.graphs_module)
        self.base = importlib.import_module(layout.base_module)
        self.ar_class, *standalone = hooks.autoregressive_classes(layout)
        self.standalone: type | None = standalone[0] if standalone else None
        self.step_modules = hooks.speculator_modules(self.ar_class, *standalone, self.dspark.DSparkSpeculator)
        """The modules the step code runs in, base classes' included (0.34's decode loop is a base class's)."""
        decode_owner = hooks.defining_class(self.ar_class, "_multi_step_decode")
        self.decode_module = importlib.import_module((decode_owner or self.ar_class).__module__)
        """Where the release's decode loop dispatches from (0.34: ``autoregressive/``, not the class's own module)."""
        self.mode_enum = importlib.import_module("vllm.config.compilation").CUDAGraphMode

    @contextmanager
    def patched(self, group: InProcessDPGroup, dispatch: Callable[..., Any] | None) -> Iterator[None]:
        """Stub the device parts for one scenario; ``dispatch`` replaces the speculators' dispatch when set."""
        saved: list[tuple[Any, str, Any]] = []

        def put(owner: Any, name: str, value: Any) -> None:
            if hasattr(owner, name):
                saved.append((owner, name, getattr(owner, name)))
                setattr(owner, name, value)

        pp = SimpleNamespace(is_first_rank=True, is_last_rank=True)
        put(self.graphs, "get_pp_group", lambda: pp)
        put(self.graphs, "current_platform", SimpleNamespace(get_global_graph_pool=lambda: None))
        put(self.dp_utils, "get_dp_group", group.dp_group)
        put(self.dp_utils, "dist", group.torch_distributed())
        for module in self.step_modules:
            put(module, "set_forward_context", stubs.forward_context)
            for kernel in ("update_draft_inputs", "prepare_decode_inputs", "prepare_dflash_inputs"):
                put(module, kernel, stubs.no_kernel)
            if dispatch is not None:
                put(module, "dispatch_cg_and_sync_dp", dispatch)
        try:
            yield
        finally:
            for owner, name, value in reversed(saved):
                setattr(owner, name, value)


def _config(scenario: Scenario, layout: ReleaseLayout) -> Any:
    sizes = list(scenario.capture_sizes)
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=scenario.max_num_seqs),
        compilation_config=SimpleNamespace(
            cudagraph_capture_sizes=sizes, max_cudagraph_capture_size=max(sizes, default=0)
        ),
        parallel_config=SimpleNamespace(
            data_parallel_size=scenario.dp_size, tensor_parallel_size=1, enable_dbo=False, use_ubatching=False
        ),
        speculative_config=None,
        cache_config=SimpleNamespace(use_kda_recoverssm=False),
        model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN),  # 0.33 on read the limit from here
    )
    if layout.split_graph_sizes:
        _resolve_split_graph_sizes(config, scenario)
    return config


def _resolve_split_graph_sizes(config: Any, scenario: Scenario) -> None:
    """0.34 on: the scenario's capture sizes given as the deprecated shared sizes, which vLLM's own config code turns
    into prefill token sizes and decode request sizes. ``VllmConfig``'s methods run on this stand-in, with a
    speculative config of the scenario's method and K (no dynamic speculation): the method matters, since EAGLE's
    one-token draft decodes add their request grid to the recorded largest graph (32 for sizes up to 8, where a
    DFlash config keeps 8), which sizes a block drafter's decode graphs."""
    vllm_config = importlib.import_module("vllm.config").VllmConfig
    compilation = importlib.import_module("vllm.config.compilation")
    sizes = list(scenario.capture_sizes)
    config.compilation_config = compilation.CompilationConfig(  # vLLM's own, every other field at its default
        cudagraph_capture_sizes=sizes,
        max_cudagraph_capture_size=max(sizes, default=0),
        cudagraph_mode=getattr(compilation.CUDAGraphMode, scenario.graph_mode),
    )
    config.scheduler_config.max_num_batched_tokens = MAX_BATCHED_TOKENS
    config.performance_mode = "balanced"
    config.speculative_config = SimpleNamespace(
        method="eagle" if scenario.method.startswith("ar") else scenario.method,
        num_speculative_tokens=scenario.k,
        enable_adaptive_verification=False,
        uses_dynamic_speculative_decoding=lambda: False,
        use_multi_module_mtp=lambda: False,
        use_gemma4_mtp=lambda: False,
    )
    for name in ("num_speculative_tokens", "uniform_decode_query_len"):
        setattr(config, name, getattr(vllm_config, name).fget(config))
    for name in (
        "get_decode_cudagraph_query_lens",
        "get_draft_decode_cudagraph_request_sizes",
        "get_varlen_decode_cudagraph_token_sizes",
        "_split_cudagraph_capture_sizes",
    ):
        setattr(config, name, types.MethodType(getattr(vllm_config, name), config))
    query_lens = config.get_decode_cudagraph_query_lens(config.uniform_decode_query_len)
    config._split_cudagraph_capture_sizes(True, query_lens)


def _speculator(release: Release, scenario: Scenario, rank: int) -> Any:
    """A vLLM speculator of the scenario's method, with host buffers sized as its ``__init__`` sizes them."""
    layout = release.layout
    if scenario.method == "ar-gemma4":
        cls = release.gemma4
    elif scenario.method == "ar-standalone":
        if release.standalone is None:
            raise ValueError(f"vLLM {layout.release} has no standalone draft model on the autoregressive loops")
        cls = release.standalone
    elif scenario.method.startswith("ar"):
        cls = release.ar_class
    elif scenario.method.startswith("dspark"):
        cls = release.dspark.DSparkSpeculator
    else:
        cls = release.dflash.DFlashSpeculator
    concrete: Any = _concrete(cls)
    spec = concrete.__new__(concrete)
    k = scenario.k
    max_reqs = scenario.max_num_seqs
    max_tokens = max_reqs * (k + 1) * 2
    buffers = importlib.import_module(f"{layout.graphs_module.rsplit('.', 1)[0]}.input_batch").InputBuffers
    config = _config(scenario, layout)
    values: dict[str, Any] = {
        "vllm_config": config,
        "scheduler_config": config.scheduler_config,
        "speculative_config": config.speculative_config,
        "device": torch.device("cpu"),
        "num_speculative_steps": k,
        "max_num_reqs": max_reqs,
        "max_num_tokens": max_tokens,
        "max_model_len": MAX_MODEL_LEN,
        "dp_size": scenario.dp_size,
        "dp_rank": rank,
        "dcp_size": 1,
        "hidden_size": HIDDEN,
        "dtype": torch.float32,
        "method": "eagle",
        "input_buffers": buffers(max_reqs, max_tokens, torch.device("cpu")),
        "hidden_states": torch.zeros(max_tokens, HIDDEN),
        "idx_mapping": torch.arange(max_reqs, dtype=torch.int32),
        "arange": torch.arange(max_tokens + 1, dtype=torch.int32),
        "arange_np": np.arange(max_tokens + 1, dtype=np.int32),
        "block_tables": stubs.StubBlockTables(1, max_reqs, max_tokens, MAX_BLOCKS),
        "kv_cache_config": stubs.kv_cache_config([DRAFT_LAYER]),
        "attn_groups": [[stubs.StubAttentionGroup([DRAFT_LAYER])]],
        "draft_attn_layer_names": {DRAFT_LAYER},
        "model": stubs.StubDraftModel(HIDDEN),
        "eplb_state": None,
        "pcp_manager": None,
        "supports_mm_inputs": False,
        "inputs_embeds": None,
        "current_draft_step": torch.tensor(0),
        "draft_max_seq_len": MAX_MODEL_LEN,
        "draft_tokens": torch.zeros(max_reqs, k, dtype=torch.int64),
        "temperature": torch.zeros(max_reqs),
        "seeds": torch.zeros(max_reqs, dtype=torch.int64),
        "draft_logits": None,
        "sample_src_positions": torch.zeros(max_reqs, dtype=torch.int64),
        "draft_is_prefilling": torch.zeros(max_reqs, dtype=torch.bool),
        "prefill_cudagraph_manager": None,
        # 0.34 on: adaptive verification, acceptance estimates, watermarks and draft logits, all off.
        "enable_adaptive_verification": False,
        "use_acceptance_estimator": False,
        "acceptance_estimator": None,
        "draft_watermarker": None,
        "use_draft_logits": False,
        "use_local_argmax_reduction": False,
        "max_model_len_gpu": torch.tensor(MAX_MODEL_LEN, dtype=torch.int32),
        "draft_token_confidence_probs": torch.zeros(max_reqs, k),
    }
    if not scenario.method.startswith("ar"):
        anchor_first = scenario.method == "dspark"
        values |= {
            "num_query_per_req": scenario.query_width,
            "sample_from_anchor": anchor_first,
            "parallel_drafting_token_id": 0,
            "requires_non_causal": True,
            "_group_causal": False,
            "draft_kv_cache_group_id": 0,
            "draft_kv_cache_group_ids": [0],
            "_layer_group_idx": None,
            "_context_slot_mappings": torch.full((1, max_tokens), stubs.PAD_SLOT_ID, dtype=torch.int64),
            "context_positions": torch.zeros(max_tokens, dtype=torch.int64),
            "sample_indices": torch.zeros(max_tokens, dtype=torch.int64),
            "sample_pos": torch.zeros(max_tokens, dtype=torch.int64),
            "sample_idx_mapping": torch.zeros(max_tokens, dtype=torch.int32),
            "sample_col": torch.arange(max_tokens, dtype=torch.int32) % max(k, 1),
            "supports_decode_metadata_update": False,
            "attn_cg_support": SimpleNamespace(
                min_cg_support=importlib.import_module("vllm.v1.attention.backend").AttentionCGSupport.UNIFORM_BATCH,
                min_cg_attn_backend="STUB_FLASHINFER",
            ),
            "_speculator_name": "DSpark" if scenario.method.startswith("dspark") else "DFlash",
            "_sample_sequential": lambda num_reqs, head_hidden: None,
            "_sharded_sequential_comm": None,  # 0.34 on: DSpark samples on one rank (no TP sharding)
            "_aux_staging": None,  # 0.33 on: the FULL graph's staged aux hidden states (none without EAGLE-3 layers)
            "_num_rejected": None,
        }
    for name, value in values.items():
        # A read-only property of some release computes its value from the ones above.
        with contextlib.suppress(AttributeError):
            setattr(spec, name, value)
    spec.sample_draft = lambda hidden, *_a, **_k: torch.zeros(hidden.shape[0], dtype=torch.int64)
    spec.use_fused_multi_step_decode = scenario.method == "ar-fused"
    return spec


_CONCRETE: dict[type, type] = {}


def _concrete(cls: type) -> type:
    """``cls`` with its abstract weight-loading methods filled in: the harness loads no weights."""
    if cls not in _CONCRETE:
        missing: frozenset[str] = getattr(cls, "__abstractmethods__", frozenset())
        body: dict[str, Any] = {name: lambda *_a, **_k: None for name in missing}
        body["__module__"] = cls.__module__
        _CONCRETE[cls] = type(cls.__name__, (cls,), body)
    return _CONCRETE[cls]


def _mark_captured(*managers: Any) -> None:
    """Graphs are never captured on CPU; dispatch then behaves as after a capture, and a replay is recorded."""
    for manager in managers:
        if manager is None:
            continue
        manager._graphs_captured = True
        manager.graphs = {desc: None for descs in manager._capture_descs.values() for desc in descs}
        manager.run_fullgraph = lambda desc, _m=manager: setattr(_m, "replayed", desc)


def _fill_decode_inputs(spec: Any, num_reqs: int) -> None:
    """What ``prepare_decode_inputs`` leaves on the host side: one query per request, flat past ``num_reqs``."""
    qsl = spec.input_buffers.query_start_loc
    qsl.copy_(torch.clamp(torch.arange(qsl.shape[0]), max=num_reqs).to(qsl.dtype))
    spec.input_buffers.seq_lens.zero_()
    spec.input_buffers.seq_lens[:num_reqs] = 100


class Runner:
    """Runs scenarios on one release under one contract mode."""

    def __init__(self, layout: ReleaseLayout, mode: str) -> None:
        self.release = Release(layout)
        self.layout = layout
        self.mode = mode

    def run(self, scenario: Scenario) -> ScenarioResult:
        group = InProcessDPGroup(scenario.dp_size)
        dispatch = self._padded_dispatch(scenario) if scenario.source == "dp-padded" else None
        with self.release.patched(group, dispatch), contracts.enforce(self.mode):
            hooks.install()
            before = collections.Counter(hooks.CHECKS)
            try:
                results = group.run(lambda rank: self._rank(scenario, rank))
            finally:
                hooks.uninstall()
            checks = dict(hooks.CHECKS - before)
        outcomes = tuple(_outcome(r, res) for r, res in enumerate(results))
        return ScenarioResult(scenario, self.mode, outcomes, checks)

    def _padded_dispatch(self, scenario: Scenario) -> Callable[..., Any]:
        """The DP-padded eager descriptor, with the agreement every rank would hold for it."""
        graphs, dp_utils = self.release.graphs, self.release.dp_utils
        mode_none = self.release.mode_enum.NONE
        q = scenario.query_width
        padded = max(max(n, 1) for n in scenario.reqs_per_rank) * q
        fields = set(dp_utils.DPSyncState.__dataclass_fields__)

        def dispatch(manager: Any, num_reqs: int, num_tokens: int, uniform_token_count: Any, **kw: Any) -> Any:
            desc = graphs.BatchExecutionDescriptor(cg_mode=mode_none, num_tokens=padded, num_reqs=num_reqs)
            state: dict[str, Any] = {
                "num_tokens_across_dp": torch.full((scenario.dp_size,), padded, dtype=torch.int32),
                "uniform_token_count": uniform_token_count,
                "eager": False,
                "max_query_len": None,  # 0.34 on: no varlen decode graphs under an eager agreement
            }
            if "num_reqs" in fields:
                state["num_reqs"] = padded // q
            return desc, dp_utils.DPSyncState(**{k: v for k, v in state.items() if k in fields})

        return dispatch

    def _rank(self, scenario: Scenario, rank: int) -> str:
        spec = _speculator(self.release, scenario, rank)
        mode = getattr(self.release.mode_enum, scenario.graph_mode)
        spec.init_cudagraph_manager(mode)
        num_reqs = max(scenario.reqs_per_rank[rank], 1)
        if scenario.method.startswith("ar"):
            _mark_captured(spec.decode_cudagraph_manager, spec.prefill_cudagraph_manager)
            return self._ar_decode(spec, scenario, rank, num_reqs)
        _mark_captured(spec.query_cudagraph_manager)
        return self._block_propose(spec, scenario, rank, num_reqs)

    def _target_sync(self, scenario: Scenario, rank: int, num_reqs: int) -> Any:
        """The target step's DP agreement, which releases from 0.30 reuse for their draft steps."""
        if scenario.dp_size == 1:
            return None
        config = _config(scenario, self.layout)
        # The target's decode query length; from 0.34 each query length with the most requests it may have.
        q = scenario.k + 1
        queries = config.get_decode_cudagraph_query_lens(q) if self.layout.split_graph_sizes else q
        mode = getattr(self.release.mode_enum, scenario.graph_mode)
        manager = self.release.graphs.CudaGraphManager(config, torch.device("cpu"), mode, queries)
        _mark_captured(manager)
        _, sync = self.release.dp_utils.dispatch_cg_and_sync_dp(
            manager, num_reqs, num_reqs * q, q, scenario.dp_size, rank
        )
        return sync

    def _ar_decode(self, spec: Any, scenario: Scenario, rank: int, num_reqs: int) -> str:
        layout, ar = self.layout, self.release.decode_module
        _fill_decode_inputs(spec, num_reqs)
        reuse = layout.sync_kwarg if layout.fixed else None
        target_sync = self._target_sync(scenario, rank, num_reqs) if reuse and scenario.source == "dispatch" else None
        if target_sync is not None:
            sync, num_tokens = spec._build_uniform_batch_dp_sync(target_sync, num_reqs, num_query_per_req=1)
            desc, sync = ar.dispatch_cg_and_sync_dp(
                spec.decode_cudagraph_manager, num_reqs, num_tokens, uniform_token_count=1,
                dp_size=scenario.dp_size, dp_rank=rank, **{layout.sync_kwarg: sync},
            )  # fmt: skip
        else:
            desc, sync = ar.dispatch_cg_and_sync_dp(
                spec.decode_cudagraph_manager, num_reqs, num_reqs, uniform_token_count=1,
                dp_size=scenario.dp_size, dp_rank=rank,
            )  # fmt: skip
        k = scenario.step_k or scenario.k  # the speculator's buffers and graphs stay sized for scenario.k
        if hasattr(spec.decode_cudagraph_manager, "specialize_spec_tokens"):
            desc = spec.decode_cudagraph_manager.specialize_spec_tokens(desc, k)
        across = None if sync is None else sync.num_tokens_across_dp
        upper = torch.full((spec.max_num_reqs,), 100, dtype=torch.int32)
        args: tuple[Any, ...] = (num_reqs, False, desc, across, upper)
        if layout.decode_takes_k:
            args += (k,)
        elif scenario.step_k is not None:
            raise ValueError(f"vLLM {layout.release}'s decode loop takes no step K: {scenario.label()}")
        method = layout.fused_decode if scenario.method == "ar-fused" else "_multi_step_decode"  # Gemma4: multi-step
        getattr(spec, method)(*args)
        return f"{desc.cg_mode.name} num_tokens={desc.num_tokens} num_reqs={desc.num_reqs}"

    def _block_propose(self, spec: Any, scenario: Scenario, rank: int, num_reqs: int) -> str:
        layout = self.layout
        q = spec.num_query_per_req
        num_target = num_reqs * (scenario.k + 1)
        batch = SimpleNamespace(
            num_reqs=num_reqs,
            num_tokens=num_target,
            seq_lens_cpu_upper_bound=torch.full((spec.max_num_reqs,), 100, dtype=torch.int32),
            idx_mapping=torch.arange(num_reqs, dtype=torch.int32),
            query_start_loc=torch.arange(num_reqs + 1, dtype=torch.int32) * (scenario.k + 1),  # read from 0.33 on
        )
        qsl = spec.input_buffers.query_start_loc
        qsl.copy_((torch.clamp(torch.arange(qsl.shape[0]), max=num_reqs) * q).to(qsl.dtype))
        # What ``prepare_dflash_inputs``'s kernel also writes: each real request's context + block length (every
        # request sits at position 99 - q here, within seq_lens_cpu_upper_bound), 0 for the padded requests.
        spec.input_buffers.seq_lens.zero_()
        spec.input_buffers.seq_lens[:num_reqs] = 100
        target_sync = None
        if layout.fixed and scenario.source == "dispatch":
            target_sync = self._target_sync(scenario, rank, num_reqs)
        zeros = torch.zeros(num_reqs, dtype=torch.int32)
        spec.propose(
            batch, {}, {}, torch.zeros(num_target, HIDDEN), None, zeros, zeros,
            torch.zeros(spec.max_num_reqs, dtype=torch.int64), torch.zeros(spec.max_num_reqs, dtype=torch.int32),
            spec.temperature, spec.seeds, **{layout.sync_kwarg: target_sync},
        )  # fmt: skip
        desc = getattr(spec.query_cudagraph_manager, "replayed", None)
        return "FULL replay" if desc is not None else "eager"


def _outcome(rank: int, result: object) -> RankOutcome:
    if isinstance(result, ContractViolation):
        first_line = str(result).splitlines()[0]
        component = result.component or ""
        return RankOutcome(rank, "violation", result.invariant_id, first_line, dict(result.observed), component)
    if isinstance(result, stubs.KernelError):
        return RankOutcome(rank, "kernel", None, str(result))
    if isinstance(result, CollectiveMismatch):
        return RankOutcome(rank, "error", None, str(result))
    if isinstance(result, BaseException):
        return RankOutcome(rank, "error", None, f"{type(result).__name__}: {result}")
    return RankOutcome(rank, "ok", None, str(result))
