"""The axes a conformance family must reach: what is cycled, how dp examples are built to hit their boundaries,
and how a family's record of what it reached judges it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import Phase, given, seed, settings
from hypothesis import strategies as st

from specdec.backend_registry import factory_for
from specdec.kv_cache import blocks_for
from specdec.testing.axes import (
    BOUNDARIES,
    DP_SIZES,
    LOOKUP_DRAFTS,
    AxesReached,
    option_combinations,
    path_options,
    required_axes,
)
from specdec.testing.conformance import (
    AXES,
    PREEMPT_MAX_TOKENS,
    Case,
    build,
    cycle_length,
    family_cases,
    repro_command,
)
from specdec.testing.host_copies import HostCopiesOfMeta


def _cycled(family: str, paths: dict[str, tuple[Any, ...]], n: int) -> list[Case]:
    seen: list[Case] = []

    @seed(5)
    @settings(max_examples=1, database=None, phases=[Phase.generate], deadline=None)
    @given(st.data())
    def collect(data: st.DataObject) -> None:
        seen.extend(data.draw(family_cases(family, cycle=i, paths=paths)) for i in range(n))

    collect()
    return seen


def test_path_options_are_the_ones_a_factory_names_and_the_caller_left_free() -> None:
    lookup = {"lookup": (0, 2), "lookup_drafts": (0, LOOKUP_DRAFTS)}
    assert path_options(factory_for("eagle")) == {"fused": (False, True), **lookup}
    assert path_options(factory_for("draft-model")) == {"fused": (False, True), **lookup}
    assert path_options(factory_for("dflash")) == {"argmax_drafts": (False, True), **lookup}
    assert path_options(factory_for("dspark")) == lookup
    assert path_options(factory_for("ngram")) == {}
    assert path_options(factory_for("eagle"), {"fused": True, "lookup": 0}) == {}  # fixed for the run: not axes
    # A lookup fixed on leaves its drafts free; one fixed off, or a K the drafts would not exceed, rules them out.
    assert path_options(factory_for("dspark"), {"lookup": 3}) == {"lookup_drafts": (0, LOOKUP_DRAFTS)}
    assert path_options(factory_for("dspark"), {"num_spec_tokens": LOOKUP_DRAFTS}) == {"lookup": (0, 2)}
    assert "lookup_drafts" in path_options(factory_for("dspark"), {"num_spec_tokens": LOOKUP_DRAFTS - 1})
    assert option_combinations({}) == [{}]
    assert option_combinations({"b": (1, 2), "a": ("x",)}) == [{"a": "x", "b": 1}, {"a": "x", "b": 2}]


def test_lookup_drafts_are_only_combined_with_a_lookup_that_is_on() -> None:
    """A factory refuses ``lookup_drafts`` without ``lookup`` (OPTION_NEEDS): that combination is never generated."""
    combos = option_combinations(path_options(factory_for("dspark")))
    assert combos == [
        {"lookup": 0, "lookup_drafts": 0},
        {"lookup": 2, "lookup_drafts": 0},
        {"lookup": 2, "lookup_drafts": LOOKUP_DRAFTS},
    ]
    largest = max(k for k, _ in AXES["draft-length"])  # the largest K a family draws
    assert largest < LOOKUP_DRAFTS  # so a match drafts past every drafter K
    for options in combos:  # and the factory takes every generated combination at that K
        widened = max(largest, options["lookup_drafts"])
        assert build(factory_for("dspark"), num_spec_tokens=largest, **options).num_spec_tokens == widened
    paths = path_options(factory_for("dspark"))
    cases = _cycled("draft-length", paths, cycle_length("draft-length", paths))
    met = {(c.options["num_spec_tokens"], c.options["lookup"], c.options["lookup_drafts"]) for c in cases}
    assert met == {(k, *combo.values()) for k in range(1, largest + 1) for combo in combos}  # every K meets every one


@pytest.mark.parametrize("family", sorted(AXES))
def test_every_axis_value_meets_every_option_combination_within_a_cycle(family: str) -> None:
    paths = {"fused": (False, True)}
    n = cycle_length(family, paths)
    assert n == 2 * len(AXES[family])
    cases = _cycled(family, paths, n)
    met = {(i % len(AXES[family]), c.options["fused"]) for i, c in enumerate(cases)}
    assert met == {(i, f) for i in range(len(AXES[family])) for f in (False, True)}


def test_every_dp_size_meets_every_boundary_and_layout() -> None:
    assert {(dp, b) for dp, _, b in AXES["dp"]} == {(dp, b) for dp in DP_SIZES for b in BOUNDARIES}
    assert {(dp, lay) for dp, lay, _ in AXES["dp"]} == {
        (dp, lay) for dp in DP_SIZES for lay in ("idle", "uneven", "any")
    }


def test_dp_boundaries_are_built_to_be_reached() -> None:
    cases = _cycled("dp", {}, 3 * len(AXES["dp"]))
    for i, case in enumerate(cases):
        _, _, boundary = AXES["dp"][i % len(AXES["dp"])]
        run, k = case.run, case.options["num_spec_tokens"]
        requests = [r for rank in run.requests for r in rank]
        limit = run.engine.scheduler.max_model_len
        if boundary == "max-model-len":
            longest = max(len(r.prompt) for r in requests)
            # After its prefill the longest request commits P = L - 1 and drafts positions up to L + K >= limit
            # (at least K + 2, so a block drafter's K + 1 queries fit: one token later when L is 1).
            assert limit == max(longest + 2, k + 2) and k >= 2 and all(r.max_tokens >= 2 for r in requests)
        elif boundary == "preempt":
            first = run.requests[0]
            assert len(first) >= 2 and [r.max_tokens for r in first[:2]] == [PREEMPT_MAX_TOKENS] * 2
            need = [
                blocks_for(min(len(r.prompt) + r.max_tokens + k + 1, limit), run.engine.block_size) for r in first[:2]
            ]
            assert run.engine.num_blocks == max(
                blocks_for(min(len(r.prompt) + r.max_tokens + k + 1, limit), run.engine.block_size) for r in requests
            )
            assert sum(need) > run.engine.num_blocks  # both cannot hold their KV at once
        else:
            assert (limit, run.engine.num_blocks) == (48, 96)


def test_axes_reached_names_what_is_missing() -> None:
    required = required_axes("dp", AXES["dp"], {"fused": (False, True)})
    assert required["drafted_into_max_model_len_at_dp"] == set(DP_SIZES)
    reached = AxesReached()
    reached.update({"dp_size": DP_SIZES, "fused": [False], "drafted_into_max_model_len_at_dp": [1, 2, 4, 8]})
    reached.add("preempted_while_speculating_at_dp", 2)
    assert reached.missing(required) == {"fused": [True], "preempted_while_speculating_at_dp": [1, 4, 8]}
    reached.update({"fused": [True], "preempted_while_speculating_at_dp": [1, 4, 8]})
    assert reached.missing(required) == {}
    assert reached.as_dict()["dp_size"] == [1, 2, 4, 8]


def test_repro_command_is_one_line_naming_the_cell_and_example() -> None:
    command = repro_command("my_pkg.drafter:make", "dp", "fake-cuda", 3, example=17)
    assert command == (
        "specdec matrix -b my_pkg.drafter:make --families dp --tensor-modes fake-cuda --seed 3 --example 17 --workers 1"
    )
    assert "--examples 24" in repro_command("eagle", "dp", "cpu", 0, examples=24)
    assert "not importable" in repro_command(None, "dp", "cpu", 0, example=1)
    assert "\n" not in repro_command(None, "dp", "cpu", 0, example=1, options={"fused": True})


def test_meta_replay_copies_to_the_host_are_data_less_host_tensors() -> None:
    meta = torch.zeros(4, dtype=torch.int64, device="meta")
    host = torch.arange(3)
    original_cpu, original_to = torch.Tensor.cpu, torch.Tensor.to
    with HostCopiesOfMeta():
        copied = meta.cpu()
        narrowed = meta.to("cpu", torch.int32)
        assert (copied.device.type, copied.shape, copied.dtype) == ("cpu", meta.shape, torch.int64)
        assert (narrowed.device.type, narrowed.dtype) == ("cpu", torch.int32)
        assert meta.to(torch.int32).is_meta and meta.to("meta").is_meta  # no host copy: untouched
        assert host.cpu() is host and host.to("cpu").tolist() == [0, 1, 2]  # real host tensors stay real
        with pytest.raises(Exception, match=r"local_scalar_dense|data"):
            copied.tolist()  # its values were never copied: reading them is the hidden sync it stands for
        with pytest.raises(Exception, match="device"):
            _ = copied + meta  # a host tensor in device compute fails as on a GPU
    assert torch.Tensor.cpu is original_cpu and torch.Tensor.to is original_to  # torch's own again outside
    with pytest.raises(NotImplementedError, match="meta"):
        meta.cpu()
