"""The code paths a conformance family must reach, and the record of what its examples reached.

A family that passes has only shown that the paths its examples took are
correct. Generated configurations can miss whole paths: a backend option that
selects another decode loop, a request that drafts into ``max_model_len``, a
KV pool small enough to preempt a drafting request. Each family therefore
names the axes it must reach (``required_axes``), its examples record what they
configured and what the engine actually did (``AxesReached``), and a family
whose named values were not all reached fails as ``axes-unreached``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specdec.backend_registry import names_option

if TYPE_CHECKING:
    from specdec.speculator import DraftContext, TargetStep

AXES_UNREACHED = "axes-unreached"
"""What a family that missed a named axis value was caught by (in place of an invariant ID)."""

LOOKUP_DRAFTS = 10
"""The ``lookup_drafts`` a family tries: above every K a family draws (1..8), so a match drafts past the drafter."""
PATH_OPTIONS: dict[str, tuple[Any, ...]] = {
    "fused": (False, True),
    "argmax_drafts": (False, True),
    "lookup": (0, 2),
    "lookup_drafts": (0, LOOKUP_DRAFTS),
}
"""Backend options that select another code path (the fused decode of the autoregressive drafters, DFlash's argmax
drafts, prompt lookup first in front of a built-in drafter, and its matches drafting more than the drafter's K,
which widens the engine's K and checks the drafter's proposal at its own before widening it): every family cycles
through the values of each one a backend's factory names, in every combination ``OPTION_NEEDS`` allows."""
OPTION_NEEDS: dict[str, str] = {"lookup_drafts": "lookup"}
"""A path option whose non-zero values need another one non-zero (a factory refuses ``lookup_drafts`` without
``lookup``): combinations without it are not run."""

DP_SIZES = (1, 2, 4, 8)
BOUNDARIES = ("none", "max-model-len", "preempt")
"""What a ``dp`` example is built to run into: nothing special, ``max_model_len`` while drafting, or a KV pool
small enough that the scheduler preempts a request of a speculative run."""


def path_options(factory: Any, fixed: Mapping[str, Any] | None = None) -> dict[str, tuple[Any, ...]]:
    """The code-path options ``factory`` names, less those the caller fixed for the whole run.

    An option whose ``OPTION_NEEDS`` the caller fixed at 0 (``lookup=0``) is left out too, as is
    ``lookup_drafts`` where the caller fixed a K it would not exceed: the factory would refuse its value.
    """
    fixed = fixed or {}
    paths = {name: values for name, values in PATH_OPTIONS.items() if name not in fixed and names_option(factory, name)}
    for name, needed in OPTION_NEEDS.items():
        if name in paths and needed in fixed and not fixed[needed]:
            del paths[name]
    if "lookup_drafts" in paths and fixed.get("num_spec_tokens", 0) >= LOOKUP_DRAFTS:
        del paths["lookup_drafts"]
    return paths


def option_combinations(paths: Mapping[str, tuple[Any, ...]]) -> list[dict[str, Any]]:
    """Every combination of the code-path options' values that ``OPTION_NEEDS`` allows (one empty one without any)."""
    names = sorted(paths)
    combos = [dict(zip(names, values, strict=True)) for values in itertools.product(*(paths[n] for n in names))]
    return [c for c in combos if all(not c.get(name) or c.get(needed, True) for name, needed in OPTION_NEEDS.items())]


def required_axes(
    family: str, family_values: tuple[Any, ...], paths: Mapping[str, tuple[Any, ...]]
) -> dict[str, set[Any]]:
    """The values each named axis of ``family`` must reach over a full cycle of its examples."""
    required: dict[str, set[Any]] = {name: set(values) for name, values in paths.items()}
    if family == "dp":
        required["dp_size"] = set(DP_SIZES)
        required["drafted_into_max_model_len_at_dp"] = set(DP_SIZES)
        required["preempted_while_speculating_at_dp"] = set(DP_SIZES)
    elif family == "graph":
        required["graph_mode"] = {"NONE", "PIECEWISE", "FULL"}
        required["dp_size"] = {dp for _, dp in family_values}
    elif family == "draft-length":
        required["num_spec_tokens"] = {k for k, _ in family_values}
    elif family == "chunked-prefill":
        required["prefill_chunked"] = {True}
    elif family == "acceptance":
        required["acceptance"] = set(family_values)
    elif family == "sampling":
        required["sampled_request"] = {True}
    elif family == "capacity":
        required["capacity"] = set(family_values)
    return required


@dataclass
class AxesReached:
    """The values each axis took over a family's examples: configured ones and those the engine ran into."""

    values: dict[str, set[Any]] = field(default_factory=dict)

    def add(self, axis: str, value: Any) -> None:
        self.values.setdefault(axis, set()).add(value)

    def update(self, other: Mapping[str, Iterable[Any]]) -> None:
        for axis, values in other.items():
            for v in values:
                self.add(axis, v)

    def missing(self, required: Mapping[str, set[Any]]) -> dict[str, list[Any]]:
        """Per axis, the required values never reached (axes fully reached are left out)."""
        out = {axis: sorted(values - self.values.get(axis, set()), key=repr) for axis, values in required.items()}
        return {axis: values for axis, values in out.items() if values}

    def as_dict(self) -> dict[str, list[Any]]:
        """JSON-ready: every axis with its reached values in order."""
        return {axis: sorted(values, key=repr) for axis, values in sorted(self.values.items())}


class BoundaryWatch:
    """What one rank's engine ran into, seen from the backend's calls: drafts into ``max_model_len``, preemptions,
    mid-prefill steps and graph modes.

    A request the engine finished (``finish``) that later appears in a step again was preempted and resumed. A
    drafting request whose bonus token and ``K`` drafts reach ``max_model_len`` drafts into the model length. An
    unfinished request that sampled nothing (it does not draft) is mid-prefill: its prompt spans several steps.
    """

    def __init__(self) -> None:
        self.finished: set[str] = set()
        self.preempted = False
        self.drafted_into_max_model_len = False
        self.prefill_chunked = False
        self.graph_modes: set[str] = set()
        self.looked_up = 0
        """Drafts a prompt-lookup wrapper (a built-in drafter's ``lookup`` option) took from a request's history, as the
        axis ``lookup_drafted``: with ``lookup`` on, an example whose requests never repeat themselves tests only the
        wrapped drafter. Reported, not required: whether a random target repeats itself within a family's first
        few examples is chance (a full matrix run reached it in every cell)."""
        self.lookup_drafted_past_k = False
        """A proposal drafted more for a request than the wrapped drafter's K (``lookup_drafts`` above it, a match
        long enough), as the axis ``lookup_drafted_past_k``: reported, not required, as ``lookup_drafted``."""

    def propose(self, step: TargetStep, ctx: DraftContext, num_spec_tokens: int) -> None:
        self.graph_modes.add(step.desc.cg_mode.name)
        for r, req_id in enumerate(step.req_ids):
            if req_id in self.finished:
                self.preempted = True
                self.finished.discard(req_id)
            if step.drafting[r] and step.base_positions[r] + 1 + num_spec_tokens >= ctx.max_model_len:
                self.drafted_into_max_model_len = True
            if not step.drafting[r] and req_id in step.committed_lengths:  # unfinished, sampled nothing: mid-prefill
                self.prefill_chunked = True

    def finish(self, req_id: str) -> None:
        self.finished.add(req_id)
