"""The matrix reaches every code path it names, and every failure prints a command that reproduces it.

Each judgement is shown both ways: a correct backend reaches every named axis value within a cycle of examples
(and a planted gap in the generation fails the family, naming the axis and the values), a late-failing drafter's
printed command reruns exactly its failing example, and a drafter with a host tensor in its attention metadata
fails the fake-cuda replay with IN-2 through ``run_family``, ``specdec matrix`` and the pytest plugin.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from host_metadata_drafter import make_host_slot_mapping

import specdec.testing.conformance as conformance
from specdec.backend_registry import factory_for
from specdec.testing import axes
from specdec.testing.axes import AXES_UNREACHED, DP_SIZES, LOOKUP_DRAFTS
from specdec.testing.conformance import run_family
from specdec.testing.corpus import get

SUPPORT = Path(__file__).resolve().parents[1] / "support"
LATE = "late_failing_drafter:make_drafts_for_everyone_from_dp4"
HOST = "host_metadata_drafter:make_host_slot_mapping"


def test_dp_family_drafts_into_max_model_len_and_preempts_at_every_dp_size() -> None:
    result = run_family(factory_for("ngram"), "dp", examples=12)
    assert result.passed, result.first_failure
    assert result.axes_judged and result.axes_missing == {}
    for axis in ("dp_size", "drafted_into_max_model_len_at_dp", "preempted_while_speculating_at_dp"):
        assert result.axes_reached[axis] == list(DP_SIZES)


def test_a_generation_that_misses_the_boundaries_fails_the_family(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conformance, "_boundary_engine", lambda *a: {})  # the planted gap: default pool and length
    result = run_family(factory_for("ngram"), "dp", examples=12)
    assert not result.passed and result.caught_by == [AXES_UNREACHED]
    assert result.axes_missing == {
        "drafted_into_max_model_len_at_dp": list(DP_SIZES),
        "preempted_while_speculating_at_dp": list(DP_SIZES),
    }
    message = result.first_failure or ""
    assert "axis 'preempted_while_speculating_at_dp' never reached [1, 2, 4, 8]" in message
    assert result.repro is not None and "--examples 12" in result.repro  # a whole-family failure reruns the family


def test_every_path_option_value_is_run_and_a_missed_one_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    no_lookup = {"lookup": 0}  # fixed for the run, so fused is the one path option: a cycle of 3 x 2 examples
    good = run_family(factory_for("eagle"), "acceptance", examples=6, options=no_lookup)
    assert good.passed and good.axes_reached["fused"] == [False, True], good.first_failure
    short = run_family(factory_for("eagle"), "acceptance", examples=5, options=no_lookup)
    assert short.passed and not short.axes_judged  # under a full cycle: recorded, not judged
    monkeypatch.setattr(conformance, "option_combinations", lambda paths: [{"fused": False}])  # never fused
    bad = run_family(factory_for("eagle"), "acceptance", examples=6, options=no_lookup)
    assert bad.caught_by == [AXES_UNREACHED] and bad.axes_missing == {"fused": [True]}
    assert "axis 'fused' never reached [True]" in (bad.first_failure or "")
    # A mutation run (stop at the first failure) hunts one bug and claims no coverage; the pytest plugin does.
    assert run_family(
        factory_for("eagle"), "acceptance", examples=6, stop_at_first_failure=True, options=no_lookup
    ).passed
    plugin_like = run_family(
        factory_for("eagle"), "acceptance", examples=6, stop_at_first_failure=True, judge_axes=True, options=no_lookup
    )
    assert plugin_like.caught_by == [AXES_UNREACHED]


def test_the_lookup_axis_runs_both_paths_and_records_drafts_from_history(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cycle of the acceptance family runs DFlash with and without lookup, and the lookup drafted from history."""
    options = {"argmax_drafts": False, "lookup_drafts": 0}  # lookup is the one path option: a cycle of 3 x 2 examples
    good = run_family(factory_for("dflash"), "acceptance", examples=6, options=options)
    assert good.passed and good.axes_reached["lookup"] == [0, 2] and good.axes_reached["lookup_drafted"] == [True]
    monkeypatch.setattr("backends.prompt_lookup.SuffixIndex.drafts", lambda self, next_token, k: [])
    never = run_family(factory_for("dflash"), "acceptance", examples=6, options=options)
    assert never.passed and "lookup_drafted" not in never.axes_reached  # reported missing, not failed (chance)


def test_the_lookup_drafts_axis_drafts_past_the_drafters_k_and_catches_a_bug_only_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cycle of the acceptance family runs DFlash's lookup drafting up to ``LOOKUP_DRAFTS``, past its own K. A bug
    on that path alone (the ids widened to the engine's K, the distributions not) is caught by the sampling family,
    and a matrix without the axis passes it: the axis is what finds it."""
    options = {"argmax_drafts": False}  # lookup and lookup_drafts vary: a cycle of 3 x 3 examples
    good = run_family(factory_for("dflash"), "acceptance", examples=9, options=options)
    assert good.passed and good.axes_judged and good.axes_missing == {}, good.first_failure
    assert good.axes_reached["lookup_drafts"] == [0, LOOKUP_DRAFTS]
    assert good.axes_reached["lookup_drafted_past_k"] == [True]  # forced acceptance: the greedy text repeats
    [mutant] = get(["lookup-widens-ids-not-distributions"])
    with mutant.apply():
        caught = run_family(factory_for("dflash"), "sampling", examples=6, options=options, stop_at_first_failure=True)
        # VER-9, or first the test suite's annotation hook (draft_probs' K is the draft ids' K on a Proposal).
        assert caught.caught_by and caught.caught_by[0] in ("VER-9", "TypeCheckError"), caught.caught_by
        assert f"'lookup_drafts': {LOOKUP_DRAFTS}" in (caught.first_failure or "")
        monkeypatch.setitem(axes.PATH_OPTIONS, "lookup_drafts", (0,))  # the matrix before the axis
        assert run_family(factory_for("dflash"), "sampling", examples=6, options=options).passed


def test_the_dp_boundaries_are_built_for_the_engines_k_when_a_lookup_widens_it() -> None:
    """With ``lookup_drafts`` the engine's K is the lookup's, not the drafter's: a preempting pool sized for the
    drafter's K could not admit the request at all (nor one sized for a drawn K where the caller fixed a larger
    one). A whole cycle of DSpark's dp family (12 x 3 examples) passes and still preempts and drafts into
    ``max_model_len`` at every DP size."""
    result = run_family(factory_for("dspark"), "dp", examples=36)
    assert result.passed and result.axes_judged and result.axes_missing == {}, result.first_failure
    assert result.axes_reached["lookup_drafts"] == [0, LOOKUP_DRAFTS]
    for axis in ("drafted_into_max_model_len_at_dp", "preempted_while_speculating_at_dp"):
        assert result.axes_reached[axis] == list(DP_SIZES)
    # So is a K the caller fixes above the ones the family draws (1..4).
    fixed = run_family(factory_for("dspark"), "dp", examples=12, options={"num_spec_tokens": 6, "lookup": 0})
    assert fixed.passed and fixed.axes_judged and fixed.axes_missing == {}, fixed.first_failure


def _matrix(args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, dict[str, Any]]:
    from specdec.cli.main import main

    out = tmp_path / f"m{len(list(tmp_path.iterdir()))}.json"
    code = main([*args, "--json", str(out)])
    return code, capsys.readouterr().out, json.loads(out.read_text())


def _cell(data: dict[str, Any]) -> dict[str, Any]:
    [backend] = data["backends"]
    [cell] = [r for r in backend["results"] if r["status"] != "skipped"]
    return cell  # type: ignore[no-any-return]


def test_the_matrix_prints_a_command_that_reruns_the_failing_example(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["matrix", "-b", LATE, "--families", "dp", "--tensor-modes", "cpu", "-n", "6", "--workers", "1"]
    code, printed, data = _matrix(args, tmp_path, capsys)
    cell = _cell(data)
    assert code == 1 and cell["first_failure_example"] == 3  # DP sizes 1 and 2 pass; DP 4 is the third example
    [command] = re.findall(r"reproduce: (specdec matrix .*)", printed)
    assert command == cell["repro"] and "--example 3" in command
    code, printed, again = _matrix(shlex.split(command)[1:], tmp_path, capsys)
    rerun = _cell(again)
    assert code == 1 and rerun["examples"] == 1 and rerun["first_failure_example"] == 3
    assert rerun["caught_by"] == cell["caught_by"][:1]  # the same finding, from that example alone
    assert rerun["first_failure"] == cell["first_failure"]  # the same configuration
    assert "axes reached" in printed


def _plugin_files(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        **{name: (SUPPORT / f"{name}.py").read_text() for name in ("step_kind_drafters", "late_failing_drafter")},
        host_metadata_drafter=(SUPPORT / "host_metadata_drafter.py").read_text(),
    )


def test_the_pytest_plugin_prints_commands_that_rerun_the_failing_example(pytester: pytest.Pytester) -> None:
    _plugin_files(pytester)
    common = ["--specdec-families", "dp", "--specdec-tensor-modes", "cpu", "-p", "no:cacheprovider"]
    first = pytester.runpytest_subprocess("--specdec-backend", LATE, "--specdec-examples", "6", *common)
    first.assert_outcomes(failed=1)
    text = first.stdout.str()
    assert f"reproduce: specdec matrix -b {LATE} --families dp --tensor-modes cpu --seed 0 --example 3" in text
    # Under CI=true pytest's short summary repeats the whole message, so the line can appear twice: always the same.
    [again] = set(re.findall(r"or: pytest (.*)", text))
    assert "--specdec-example 3" in again
    rerun = pytester.runpytest_subprocess(*shlex.split(again))
    rerun.assert_outcomes(failed=1)
    caught = re.findall(r"at generated example 3 of \d+: (\S+):", text)
    assert caught and re.findall(r"at generated example 3 of 1: (\S+):", rerun.stdout.str()) == caught


def test_host_tensor_metadata_fails_the_fake_cuda_replay_with_in2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_family(make_host_slot_mapping, "dp", examples=2, tensor_mode="cpu").passed  # CPU tensors cannot tell
    result = run_family(make_host_slot_mapping, "dp", examples=2, tensor_mode="fake-cuda", stop_at_first_failure=True)
    assert result.caught_by == ["IN-2"], result.first_failure
    message = result.first_failure or ""
    assert "'slot_mapping': 'cpu'" in message and "instead of the model's device" in message  # the fix
    args = ["matrix", "-b", HOST, "--families", "dp", "--tensor-modes", "fake-cuda", "-n", "2", "--workers", "1"]
    code, printed, data = _matrix(args, tmp_path, capsys)
    assert code == 1 and _cell(data)["caught_by"][0] == "IN-2" and "IN-2" in printed


def test_host_tensor_metadata_fails_the_pytest_plugin_with_in2(pytester: pytest.Pytester) -> None:
    _plugin_files(pytester)
    args = ["--specdec-backend", HOST, "--specdec-families", "dp", "--specdec-examples", "2", "-p", "no:cacheprovider"]
    result = pytester.runpytest_subprocess(*args, "--specdec-tensor-modes", "cpu,fake-cuda")
    result.assert_outcomes(passed=1, failed=1)  # cpu passes; the fake-cuda replay sees the host tensor
    assert "IN-2" in result.stdout.str() and "instead of the model's device" in result.stdout.str()
