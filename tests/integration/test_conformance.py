"""The conformance kit: families, forced acceptance patterns, reports, the matrix command and the pytest plugin."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from typing import Any
from unittest import mock
from xml.etree import ElementTree

import pytest
from hypothesis import Phase, given, seed, settings
from hypothesis import strategies as st

from specdec.backend_registry import factory_for
from specdec.engine import RunMetrics
from specdec.nn.transformer import Transformer
from specdec.sampling import SamplingParams
from specdec.speculator import Proposal, Speculator, TargetStep
from specdec.testing.conformance import (
    AXES,
    FAMILIES,
    MODEL,
    TENSOR_MODES,
    Case,
    check_backend,
    family_cases,
    run_case,
    run_family,
)
from specdec.testing.dp_run import (
    DPRunSpec,
    RequestSpec,
    plain_outputs,
    plain_reference,
    reference_cache,
    run_in_process,
)
from specdec.testing.forced_acceptance import ForcedAcceptance

BUILT_IN = ["eagle", "draft-model", "dflash", "dspark"]


def _cases(family: str, n: int) -> list[Case]:
    out: list[Case] = []

    @seed(7)
    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None)
    @given(family_cases(family))
    def collect(case: Case) -> None:
        out.append(case)

    collect()
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_generates_what_it_names(family: str) -> None:
    cases = _cases(family, 30)
    runs = [c.run for c in cases]
    assert all(len(r.requests[0]) >= 1 for r in runs)  # rank 0 always has work
    if family == "dp":
        assert {r.dp_size for r in runs} >= {2, 4, 8}
        assert any(any(len(rank) == 0 for rank in r.requests) for r in runs)  # idle ranks
        assert any(len({len(rank) for rank in r.requests}) > 1 for r in runs)  # uneven ranks
    if family == "graph":
        assert {r.engine.capture.mode.name for r in runs} == {"NONE", "PIECEWISE", "FULL"}
    if family == "draft-length":
        assert max(c.options["num_spec_tokens"] for c in cases) >= 6
    if family == "chunked-prefill":
        assert any(sum(len(q.prompt) for q in r.requests[0]) > r.engine.scheduler.max_num_batched_tokens for r in runs)
    if family == "acceptance":
        assert {c.acceptance for c in cases} == {"all-accept", "all-reject", "random"}
    if family == "sampling":
        assert any(not q.params.greedy for r in runs for rank in r.requests for q in rank)
    if family == "capacity":
        assert {c.options["capacity"] for c in cases} == {"threshold", "budget", "full"}


def _accept_run(pattern: str) -> RunMetrics:
    """Two greedy requests with EAGLE drafts rewritten to ``pattern``; returns the run's metrics."""
    spec = DPRunSpec(
        MODEL,
        0,
        _cases("acceptance", 1)[0].run.engine,
        ((RequestSpec("a", (1, 2, 3), 20), RequestSpec("b", (9, 8), 14)),),
        lambda t: factory_for("eagle")(t, num_spec_tokens=3),
    )
    plain = plain_outputs(spec)
    sequences = {"a": [1, 2, 3, *plain["a"]], "b": [9, 8, *plain["b"]]}

    def forced(target: Transformer) -> Speculator:
        assert spec.speculator is not None
        return ForcedAcceptance(spec.speculator(target), pattern, sequences, MODEL.vocab_size, 0)

    [result] = run_in_process(dataclasses.replace(spec, speculator=forced))
    assert result.outputs == plain
    return result.metrics


def test_forced_acceptance_patterns_happen_and_stay_lossless() -> None:
    everything = _accept_run("all-accept")
    nothing = _accept_run("all-reject")
    some = _accept_run("random")
    # Every draft inside the plain continuation is accepted; only a request's last step may draft past its end.
    assert everything.drafted > 0 and everything.accepted >= everything.drafted - 2 * 3
    assert everything.acceptance_length > 3.0
    assert nothing.drafted > 0 and nothing.accepted == 0
    assert 0 < some.accepted < some.drafted


def test_forced_acceptance_rejects_unknown_patterns() -> None:
    inner = factory_for("eagle")(Transformer(MODEL, seed=0), num_spec_tokens=2)
    with pytest.raises(ValueError, match="all-accept, all-reject or random"):
        ForcedAcceptance(inner, "most", {}, 10, 0)


def test_forced_acceptance_is_a_speculator_that_delegates_to_its_backend() -> None:
    inner = factory_for("dspark")(Transformer(MODEL, seed=0), num_spec_tokens=3)
    forced = ForcedAcceptance(inner, "all-accept", {}, MODEL.vocab_size, 0)
    assert isinstance(forced, Speculator)
    assert (forced.name, forced.num_spec_tokens, forced.draft_step_kinds, forced.aux_layers) == (
        inner.name,
        inner.num_spec_tokens,
        inner.draft_step_kinds,
        inner.aux_layers,
    )
    assert forced.capacity == "full" and forced.measure_cost == inner.measure_cost  # the rest is the backend's own
    with pytest.raises(AttributeError):
        _ = forced.no_such_attribute


@pytest.mark.parametrize("backend", BUILT_IN)
def test_built_in_backends_pass_a_small_matrix(backend: str) -> None:
    report = check_backend(factory_for(backend), name=backend, examples=1)
    failed = [(r.family, r.first_failure) for r in report.results if not r.passed and not r.skipped]
    assert report.ok, failed
    cpu = [r for r in report.results if r.tensor_mode == "cpu" and not r.skipped]
    assert len(cpu) == len(FAMILIES) - (0 if backend == "dspark" else 1)  # capacity only where it is an option
    assert all(r.examples == 1 for r in cpu)


class _DraftsForEveryone:
    """A broken backend: wraps EAGLE but claims drafts for requests that do not draft (mid-prefill, finished)."""

    def __init__(self, inner: Speculator) -> None:
        self.inner = inner
        self.name, self.num_spec_tokens = "broken", inner.num_spec_tokens
        self.draft_step_kinds, self.aux_layers = inner.draft_step_kinds, inner.aux_layers

    def bind(self, target: Transformer, ctx: Any) -> None:
        self.inner.bind(target, ctx)

    def propose(self, step: TargetStep, ctx: Any) -> Proposal:
        p = self.inner.propose(step, ctx)
        return dataclasses.replace(p, num_drafts=(self.num_spec_tokens,) * step.num_reqs)

    def finish(self, req_id: str) -> None:
        self.inner.finish(req_id)


def broken_factory(target: Transformer, **options: Any) -> Speculator:
    return _DraftsForEveryone(factory_for("eagle")(target, **options))


def test_a_broken_backend_fails_with_the_example_that_broke_it() -> None:
    result = run_family(broken_factory, "chunked-prefill", examples=10, stop_at_first_failure=True)
    assert not result.passed and result.first_failure_example is not None
    assert result.caught_by == ["PROP-4"] and "non-drafting requests" in (result.first_failure or "")
    assert "family=chunked-prefill" in (result.first_failure or "")
    case = _cases("chunked-prefill", 1)[0]
    assert run_case(factory_for("eagle"), case).ok


def test_matrix_command_writes_json_and_junit(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from specdec.cli.main import main

    out_json, out_xml = tmp_path / "m.json", tmp_path / "m.xml"
    args = ["matrix", "-b", "dflash", "-n", "2", "--families", "dp,capacity", "--workers", "1", "--json", str(out_json)]
    assert main([*args, "--junit", str(out_xml)]) == 0
    printed = capsys.readouterr().out
    assert "dflash: 4 generated configurations" in printed  # 2 per family on cpu and on fake-cuda
    data = json.loads(out_json.read_text())
    cells = {(r["family"], r["tensor_mode"]): r["status"] for r in data["backends"][0]["results"]}
    assert cells[("dp", "cpu")] == cells[("dp", "fake-cuda")] == "passed"
    assert cells[("dp", "cuda")] in {"skipped", "passed"}
    assert ("capacity", "cpu") not in cells  # dflash takes no capacity option
    suite = ElementTree.fromstring(out_xml.read_text()).find("testsuite")
    assert suite is not None and suite.get("name") == "dflash" and suite.get("failures") == "0"


def test_pytest_plugin_runs_the_suite_and_reports_the_failing_family(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        broken_backend=textwrap.dedent(
            """
            from test_conformance_helpers import broken_factory
            """
        ),
        test_conformance_helpers=textwrap.dedent(
            """
            import dataclasses
            from specdec.backend_registry import factory_for

            class Broken:
                def __init__(self, inner):
                    self.inner = inner
                    self.name, self.num_spec_tokens = "broken", inner.num_spec_tokens
                    self.draft_step_kinds, self.aux_layers = inner.draft_step_kinds, inner.aux_layers
                def bind(self, target, ctx):
                    self.inner.bind(target, ctx)
                def propose(self, step, ctx):
                    p = self.inner.propose(step, ctx)
                    return dataclasses.replace(p, num_drafts=(self.num_spec_tokens,) * step.num_reqs)
                def finish(self, req_id):
                    self.inner.finish(req_id)

            def broken_factory(target, **options):
                return Broken(factory_for("eagle")(target, **options))
            """
        ),
    )
    common = ["--specdec-examples", "2", "--specdec-families", "chunked-prefill", "-p", "no:cacheprovider"]
    good = pytester.runpytest_subprocess("--specdec-backend", "eagle", *common)
    good.assert_outcomes(passed=2, skipped=1)  # cpu and fake-cuda pass; cuda is skipped without a GPU
    bad = pytester.runpytest_subprocess("--specdec-backend", "broken_backend:broken_factory", "-rf", *common)
    bad.assert_outcomes(failed=2, skipped=1)
    bad.stdout.fnmatch_lines(["*specdec[[]broken_backend:broken_factory[]]::chunked-prefill[[]cpu[]]*"])
    assert "failed family 'chunked-prefill' (cpu) at generated example" in bad.stdout.str()


class _HostReadingEagle(_DraftsForEveryone):
    """EAGLE plus a value read of the target's hidden states in every proposal: a device sync on a GPU."""

    def propose(self, step: TargetStep, ctx: Any) -> Proposal:
        if step.num_reqs:
            float(step.output.hidden_states[0, 0])
        return self.inner.propose(step, ctx)


class _HostProposals(_DraftsForEveryone):
    """EAGLE whose drafts are copied to the host before they are returned: the verifier would get host tensors."""

    def propose(self, step: TargetStep, ctx: Any) -> Proposal:
        p = self.inner.propose(step, ctx)
        return dataclasses.replace(p, draft_token_ids=p.draft_token_ids.to("cpu"))


@pytest.mark.parametrize(
    ("wrapper", "message"),
    [
        (_HostReadingEagle, ("no data", "meta tensors", "data-dependent")),
        (_HostProposals, ("lives on ['cpu']", "no data")),
    ],
    ids=["hidden-device-read", "proposal-on-host"],
)
def test_the_fake_device_replay_catches_what_only_a_gpu_would_show(wrapper: Any, message: tuple[str, ...]) -> None:
    def factory(target: Transformer, **options: Any) -> Speculator:
        return wrapper(factory_for("eagle")(target, **options))  # type: ignore[no-any-return]

    assert run_family(factory, "dp", examples=3, tensor_mode="cpu").passed  # CPU tensors cannot tell
    result = run_family(factory, "dp", examples=3, tensor_mode="fake-cuda", stop_at_first_failure=True)
    assert not result.passed and any(m in (result.first_failure or "") for m in message), result.first_failure
    assert "fake-cuda replay" in (result.first_failure or "") and TENSOR_MODES == ("cpu", "fake-cuda", "cuda")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_run_family_cycles_through_every_axis_value(family: str) -> None:
    """Example ``i`` of a cell takes ``AXES[family][i % n]``: coverage by construction, not by the draw."""
    seen: list[Case] = []

    @seed(3)
    @settings(max_examples=1, database=None, phases=[Phase.generate], deadline=None)
    @given(st.data())
    def collect(data: st.DataObject) -> None:
        seen.extend(data.draw(family_cases(family, cycle=i)) for i in range(len(AXES[family])))

    collect()
    runs = [c.run for c in seen]
    if family == "dp":
        assert [(r.dp_size) for r in runs] == [dp for dp, _, _ in AXES["dp"]]
        for (dp, layout, _), r in zip(AXES["dp"], runs, strict=True):
            counts = [len(rank) for rank in r.requests]
            assert counts[0] >= 1
            if dp > 1 and layout == "idle":
                assert counts[-1] == 0
            if dp > 1 and layout == "uneven":
                assert counts[-1] != counts[0]
    if family == "graph":
        assert {(r.engine.capture.mode, r.dp_size) for r in runs} == set(AXES["graph"])
    if family == "draft-length":
        assert [(c.options["num_spec_tokens"], c.run.dp_size) for c in seen] == list(AXES["draft-length"])
    if family == "chunked-prefill":
        long = seen[AXES[family].index("long")].run
        assert len(long.requests[0][0].prompt) > long.engine.scheduler.max_num_batched_tokens
    if family == "acceptance":
        assert [c.acceptance for c in seen] == list(AXES["acceptance"])
    if family == "sampling":
        assert not seen[AXES[family].index("sampled")].run.requests[0][0].params.greedy
    if family == "capacity":
        assert [c.options["capacity"] for c in seen] == ["threshold", "budget", "budget", "full"]
        assert ["c0" in c.options for c in seen] == [False, True, False, False]  # the budget measures its own cost


def test_plain_reference_reuses_continuations_and_matches_plain_decoding() -> None:
    engine = _cases("dp", 1)[0].run.engine
    greedy = (RequestSpec("a", (5, 6, 7), 9), RequestSpec("b", (1,), 4))
    sampled = RequestSpec("s", (2, 3), 3, params=SamplingParams(temperature=1.0))
    spec = DPRunSpec(MODEL, 1, engine, ((*greedy, sampled),))
    plain = plain_outputs(spec)
    assert plain_reference(spec) == {"a": plain["a"], "b": plain["b"]}  # no cache: decoded afresh, greedy only
    shorter = DPRunSpec(MODEL, 1, engine, ((RequestSpec("x", (5, 6, 7), 4),), (RequestSpec("y", (1,), 6),)))
    with reference_cache():
        assert plain_reference(spec) == {"a": plain["a"], "b": plain["b"]}
        with mock.patch("specdec.testing.dp_run.Engine", side_effect=AssertionError("decoded again")):
            assert plain_reference(spec) == {"a": plain["a"], "b": plain["b"]}  # all known now
            with pytest.raises(AssertionError, match="decoded again"):
                plain_reference(shorter)  # "y" wants 6 tokens of a continuation known to 4
        reference = plain_reference(shorter)
        assert reference["x"] == plain["a"][:4]
        assert reference["y"] == plain_outputs(shorter)["y"]
