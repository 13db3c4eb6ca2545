"""Wrap vLLM's speculator methods so that every draft step is checked against the contracts.

What is wrapped, per release (``versions.ReleaseLayout``):

- the autoregressive speculator's ``_multi_step_decode`` and its fused decode loop (on
  whichever class of its MRO defines them) and the DFlash speculator's ``propose`` (DSpark
  inherits it) open a step: its
  kind, its real request count, and its descriptor;
- ``dispatch_cg_and_sync_dp``, as the modules of those classes and their bases call it, is checked on its result
  (DESC-*, DP-*) and hands the block step its descriptor;
- ``build_attn_metadata``, as the speculators' metadata builder calls it, is
  checked at once under FULL (attention rows are model rows there) and otherwise
  kept for the forward;
- the draft forward, ``_run_model`` (from 0.34 the autoregressive loop's ``_decode``, which the standalone
  draft model defines too), is checked before it runs, with the per-layer slot mapping it is given.

Every check runs before vLLM's own builder and kernels see the values, so a
violation names the invariant and quotes vLLM's numbers instead of a kernel
crash. With contracts ``off`` a wrapper costs one mode read.
"""

from __future__ import annotations

import collections
import functools
import importlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from contracts import DescriptorFacts, DPFacts, Mode, StepKind, Subject, check, current_mode
from specdec.integrations.vllm import adapter
from specdec.integrations.vllm.versions import ReleaseLayout, layout_for, unsupported_reason


@dataclass(frozen=True)
class HookReport:
    """What ``install`` did in this process."""

    vllm_version: str | None
    """The vLLM release found, or None when vLLM is not importable."""
    supported: bool
    """Whether the adapter's version table covers that release."""
    patched: tuple[str, ...]
    """``module:Class.method`` (or ``module:function``) of every wrapped callable."""
    reason: str | None = None
    """Why nothing was patched, when nothing was."""


@dataclass
class _Step:
    """One draft step in flight on this thread, filled in as vLLM reaches each boundary."""

    kind: StepKind
    speculator: Any
    component: str
    num_reqs: int
    desc: Any = None
    query_width: int | None = None
    num_spec_tokens: int | None = None
    block_layout: str | None = None
    pending: dict[str, Any] | None = field(default=None, repr=False)


_LOCAL = threading.local()
_ORIGINALS: dict[tuple[Any, str], Any] = {}
_LOCK = threading.Lock()
_REPORT: HookReport | None = None
CHECKS: collections.Counter[str] = collections.Counter()
"""Boundaries checked in this process, by subject (``descriptor``, ``dp``, ``batch``): evidence that checks ran."""


def _run(subject: Subject, facts: object, step_kind: StepKind, component: str) -> None:
    CHECKS[subject.value] += 1
    check(subject, facts, step_kind=step_kind, component=component)


def _stack() -> list[_Step]:
    stack: list[_Step] | None = getattr(_LOCAL, "steps", None)
    if stack is None:
        stack = _LOCAL.steps = []
    return stack


def _current() -> _Step | None:
    stack = _stack()
    return stack[-1] if stack else None


@contextmanager
def _open(step: _Step) -> Iterator[_Step]:
    stack = _stack()
    stack.append(step)
    try:
        yield step
    finally:
        stack.pop()


def _component(layout: ReleaseLayout, owner: str, method: str) -> str:
    return f"vLLM {layout.release} {owner}.{method}"


# -- the checks each boundary runs -------------------------------------------------


def _check_dispatch(layout: ReleaseLayout, result: Any, bound: dict[str, Any], step: _Step | None) -> None:
    vllm_desc, vllm_sync = result
    desc = adapter.descriptor(vllm_desc)
    dp_size = int(bound["dp_size"])
    kind = step.kind if step is not None else StepKind.DISPATCH
    component = step.component if step is not None else _component(layout, "dispatch_cg_and_sync_dp", "result")
    all_idle = None if dp_size == 1 else vllm_sync is None
    facts = DescriptorFacts(
        desc=desc, num_reqs=int(bound["num_reqs"]), num_tokens=int(bound["num_tokens"]), all_ranks_idle=all_idle
    )
    _run(Subject.DESCRIPTOR, facts, kind, component)
    if vllm_sync is not None:
        state = adapter.dp_state(vllm_sync, desc, dp_size)
        dp_facts = DPFacts(state=state, desc=desc, rank=int(bound["dp_rank"]), num_tokens=int(bound["num_tokens"]))
        _run(Subject.DP, dp_facts, StepKind.DP_SYNC, component)


def _check_batch(step: _Step, common: dict[str, Any], slot_mapping: Any, num_rows: int) -> None:
    spec = step.speculator
    q = step.query_width or 1
    meta = adapter.attention_metadata(
        common,
        num_reqs=step.num_reqs,
        num_tokens=step.num_reqs * q,
        slot_mapping=slot_mapping,
        query_width=step.query_width,
    )
    hidden = getattr(spec, "hidden_states", None) if step.kind is StepKind.DRAFT_DECODE else None
    facts = adapter.batch_facts(
        adapter.descriptor(step.desc),
        meta,
        input_ids=spec.input_buffers.input_ids[:num_rows],
        positions=spec.input_buffers.positions[:num_rows],
        hidden_states=None if hidden is None else hidden[:num_rows],
        max_model_len=getattr(spec, "max_model_len", None),
        num_spec_tokens=step.num_spec_tokens,
        block_layout=step.block_layout,
        dp_size=getattr(spec, "dp_size", None),
    )
    _run(Subject.BATCH, facts, step.kind, step.component)


def _first_slot_mapping(slot_mappings: Any) -> Any:
    if slot_mappings is None:
        return None
    if isinstance(slot_mappings, dict):
        return next(iter(slot_mappings.values()), None)
    return slot_mappings


# -- wrappers ------------------------------------------------------------------------


def _wrap_decode(layout: ReleaseLayout, owner: str, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def decode(self: Any, num_reqs: int, skip_attn: bool, batch_desc: Any, *rest: Any, **kw: Any) -> Any:
        if current_mode() is Mode.OFF:
            return original(self, num_reqs, skip_attn, batch_desc, *rest, **kw)
        step = _Step(
            kind=StepKind.DRAFT_DECODE,
            speculator=self,
            component=_component(layout, type(self).__name__, name),
            num_reqs=int(num_reqs),
            desc=batch_desc,
            num_spec_tokens=int(getattr(self, "num_speculative_steps", 0)) or None,
        )
        facts = DescriptorFacts(desc=adapter.descriptor(batch_desc), num_reqs=int(num_reqs), num_tokens=int(num_reqs))
        _run(Subject.DESCRIPTOR, facts, step.kind, step.component)
        with _open(step):
            return original(self, num_reqs, skip_attn, batch_desc, *rest, **kw)

    return decode


def _wrap_block_propose(layout: ReleaseLayout, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def propose(self: Any, input_batch: Any, *rest: Any, **kw: Any) -> Any:
        if current_mode() is Mode.OFF:
            return original(self, input_batch, *rest, **kw)
        # DSpark samples from the anchor unless its config turns that off (a 1 + K fill-in block, as DFlash's).
        anchor_first = bool(getattr(self, "sample_from_anchor", False))
        step = _Step(
            kind=StepKind.DRAFT_BLOCK,
            speculator=self,
            component=_component(layout, type(self).__name__, "propose"),
            num_reqs=int(input_batch.num_reqs),
            query_width=int(self.num_query_per_req),
            num_spec_tokens=int(self.num_speculative_steps),
            block_layout="anchor_first" if anchor_first else "bonus_first",
        )
        with _open(step):
            return original(self, input_batch, *rest, **kw)

    return propose


def _wrap_dispatch(layout: ReleaseLayout, original: Callable[..., Any]) -> Callable[..., Any]:
    names = ("cudagraph_manager", "num_reqs", "num_tokens", "uniform_token_count", "dp_size", "dp_rank")

    @functools.wraps(original)
    def dispatch(*args: Any, **kw: Any) -> Any:
        result = original(*args, **kw)
        if current_mode() is Mode.OFF:
            return result
        bound = dict(zip(names, args, strict=False)) | kw
        step = _current()
        if step is not None and step.kind is StepKind.DRAFT_BLOCK:
            step.desc = result[0]
        _check_dispatch(layout, result, bound, step)
        return result

    return dispatch


def _wrap_build_attn_metadata(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def build_attn_metadata(*args: Any, **kw: Any) -> Any:
        step = _current()
        if step is not None and step.desc is not None and current_mode() is not Mode.OFF and not args:
            if step.desc.cg_mode.name == "FULL":
                rows = int(step.desc.num_tokens)
                _check_batch(step, kw, kw["slot_mappings"][0][:rows], rows)
            else:
                step.pending = kw
        return original(*args, **kw)

    return build_attn_metadata


def _check_forward(num_tokens: int, slot_mappings: Any) -> None:
    """The open step's held attention metadata against the forward's model rows and per-layer slot mapping."""
    if current_mode() is Mode.OFF:
        return
    step = _current()
    if step is not None and step.pending is not None:
        slots = _first_slot_mapping(slot_mappings)
        if slots is not None:
            _check_batch(step, step.pending, slots, int(num_tokens))


def _wrap_run_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def run_model(self: Any, num_tokens: int, attn_metadata: Any, slot_mappings: Any, *rest: Any, **kw: Any) -> Any:
        _check_forward(num_tokens, slot_mappings)
        return original(self, num_tokens, attn_metadata, slot_mappings, *rest, **kw)

    return run_model


def _wrap_decode_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """0.34's ``_decode(num_reqs, num_tokens_padded, attn_metadata, slot_mappings, ...)``: one draft forward."""

    @functools.wraps(original)
    def decode_forward(
        self: Any, num_reqs: int, num_tokens: int, attn_metadata: Any, slot_mappings: Any, *rest: Any, **kw: Any
    ) -> Any:
        _check_forward(num_tokens, slot_mappings)
        return original(self, num_reqs, num_tokens, attn_metadata, slot_mappings, *rest, **kw)

    return decode_forward


_FORWARD_WRAPPERS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "_run_model": _wrap_run_model,
    "_decode": _wrap_decode_forward,
}


# -- install / uninstall -------------------------------------------------------------


def _patch(owner: Any, name: str, wrapper_factory: Callable[[Any], Any], label: str, patched: list[str]) -> None:
    key = (owner, name)
    if key in _ORIGINALS:
        return
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    _ORIGINALS[key] = original
    setattr(owner, name, wrapper_factory(original))
    patched.append(label)


def defining_class(cls: type, name: str) -> type | None:
    """The class of ``cls``'s MRO that defines ``name``: 0.34's decode loops are on ``AutoRegressiveSpeculator``,
    the base of the speculator the version table names, whose own class defines its forward."""
    return next((c for c in cls.__mro__ if name in c.__dict__), None)


def speculator_modules(*classes: type) -> list[Any]:
    """The vLLM modules that define these classes and their bases: each looks up ``dispatch_cg_and_sync_dp`` and
    its kernels in its own globals (0.34's decode loop dispatches from ``autoregressive/``)."""
    found: dict[str, Any] = {}
    for cls in classes:
        for c in cls.__mro__:
            if c.__module__.startswith("vllm.") and c.__module__ not in found:
                found[c.__module__] = importlib.import_module(c.__module__)
    return list(found.values())


def autoregressive_classes(layout: ReleaseLayout) -> list[type]:
    """The speculators that run the autoregressive loops with a forward of their own: the one the table names and,
    from 0.34, the standalone draft model's."""
    classes = [getattr(importlib.import_module(layout.ar_module), layout.ar_class)]
    if layout.standalone_module is not None:
        classes.append(importlib.import_module(layout.standalone_module).StandaloneARSpeculator)
    return classes


def _vllm_version() -> str | None:
    try:
        import vllm
    except ImportError:
        return None
    return str(getattr(vllm, "__version__", "unknown"))


def install() -> HookReport:
    """Wrap the methods the version table names; idempotent (a second call patches nothing twice)."""
    global _REPORT
    with _LOCK:
        if _REPORT is not None and _REPORT.supported:
            return _REPORT
        version = _vllm_version()
        if version is None:
            return HookReport(None, False, (), "vLLM is not importable in this environment")
        layout = layout_for(version)
        if layout is None:
            return HookReport(version, False, (), unsupported_reason(version))
        patched: list[str] = []
        ar_classes = autoregressive_classes(layout)
        ar_cls = ar_classes[0]
        dflash_cls = importlib.import_module(layout.dflash_module).DFlashSpeculator
        base = importlib.import_module(layout.base_module)
        for method in ("_multi_step_decode", layout.fused_decode):
            owner = defining_class(ar_cls, method)
            if owner is not None:
                _patch(
                    owner,
                    method,
                    functools.partial(_wrap_decode, layout, owner.__name__, method),
                    f"{owner.__module__}:{owner.__name__}.{method}",
                    patched,
                )
        _patch(
            dflash_cls,
            "propose",
            functools.partial(_wrap_block_propose, layout),
            f"{layout.dflash_module}:DFlashSpeculator.propose",
            patched,
        )
        for module in speculator_modules(ar_cls, dflash_cls):
            if hasattr(module, "dispatch_cg_and_sync_dp"):
                _patch(
                    module,
                    "dispatch_cg_and_sync_dp",
                    functools.partial(_wrap_dispatch, layout),
                    f"{module.__name__}:dispatch_cg_and_sync_dp",
                    patched,
                )
        _patch(base, "build_attn_metadata", _wrap_build_attn_metadata, f"{base.__name__}:build_attn_metadata", patched)
        forwards = [(cls, layout.ar_forward) for cls in ar_classes] + [(dflash_cls, "_run_model")]
        for cls, name in forwards:
            owner = defining_class(cls, name)
            if owner is not None:
                label = f"{owner.__module__}:{owner.__name__}.{name}"
                _patch(owner, name, _FORWARD_WRAPPERS[name], label, patched)
        _REPORT = HookReport(version, True, tuple(patched))
        return _REPORT


def uninstall() -> None:
    """Restore every wrapped callable."""
    global _REPORT
    with _LOCK:
        for (owner, name), original in _ORIGINALS.items():
            setattr(owner, name, original)
        _ORIGINALS.clear()
        _REPORT = None
