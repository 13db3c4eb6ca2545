"""vLLM's own draft-step code against the contracts: caught on the buggy release, silent on the fixed ones.

Runs where vLLM is importable (the vLLM environment that ``.ci/vllm-env``
builds). Other releases' Python files come from ``$SPECDEC_VLLM_RELEASES``
(``.vllm-releases`` in CI), each checked by ``specdec vllm-check`` in a child
process, since one process can import one vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed in this environment (see .ci/vllm-env)")

from specdec.integrations.vllm import hooks  # noqa: E402
from specdec.integrations.vllm.harness.runner import Runner  # noqa: E402
from specdec.integrations.vllm.harness.scenario import Scenario, matrix, release_methods  # noqa: E402
from specdec.integrations.vllm.versions import LAYOUTS, layout_for, normalise  # noqa: E402

BUGGY = "0.29.0"
INSTALLED = normalise(vllm.__version__)
ROOT = Path(__file__).resolve().parents[2]


def _releases_dir() -> Path:
    return Path(os.environ.get("SPECDEC_VLLM_RELEASES", ROOT / ".vllm-releases"))


def _release_or_skip(version: str) -> None:
    if not (_releases_dir() / version / "vllm" / "__init__.py").exists():
        message = f"vLLM {version} files are not under {_releases_dir()} (.ci/vllm-env installs them)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def _vllm_check(version: str, mode: str, tmp_path: Path) -> list[dict[str, Any]]:
    out = tmp_path / f"{version}-{mode}.json"
    env = dict(os.environ, SPECDEC_VLLM_RELEASES=str(_releases_dir()))
    command = [sys.executable, "-m", "specdec.cli.main", "vllm-check", "--vllm-version", version]
    proc = subprocess.run(
        [*command, "--contracts", mode, "--json", str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["vllm"] == version
    return list(data["scenarios"])


def _q(scenario: dict[str, Any]) -> int:
    """The query width of a scenario read back from ``--json`` (its tuples come back as lists)."""
    return Scenario(**{k: tuple(v) if isinstance(v, list) else v for k, v in scenario.items()}).query_width


def _padded_ranks(scenario: dict[str, Any]) -> list[int]:
    """Ranks whose real token count is below the largest rank's in a DP-padded step."""
    reqs = [max(n, 1) for n in scenario["reqs_per_rank"]]
    return [r for r, n in enumerate(reqs) if n < max(reqs)]


@pytest.fixture(scope="module")
def buggy_shapes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    _release_or_skip(BUGGY)
    return _vllm_check(BUGGY, "shapes", tmp_path_factory.mktemp("buggy"))


def test_buggy_release_dp_pad_is_caught_before_the_forward_with_vllms_values(
    buggy_shapes: list[dict[str, Any]],
) -> None:
    padded = [s for s in buggy_shapes if s["scenario"]["source"] == "dp-padded"]
    assert padded, "the matrix has DP-padded steps"
    for s in padded:
        scenario = s["scenario"]
        expected = "AR-5" if scenario["method"].startswith("ar") else "BLK-3"
        q, ranks = _q(scenario), _padded_ranks(scenario)
        padded_tokens = max(max(n, 1) for n in scenario["reqs_per_rank"]) * q
        for outcome in s["ranks"]:
            if outcome["rank"] not in ranks:
                assert outcome["kind"] == "ok", (s["label"], outcome)
                continue
            num_reqs = max(scenario["reqs_per_rank"][outcome["rank"]], 1)
            assert (outcome["kind"], outcome["invariant"]) == ("violation", expected), (s["label"], outcome)
            observed = outcome["observed"]
            assert observed["meta.num_tokens_padded"] == padded_tokens == observed["desc.num_tokens"]
            assert observed["expected attention tokens"] == num_reqs * q
            assert observed["num_reqs"] == num_reqs


def test_buggy_release_seed_case_values(buggy_shapes: list[dict[str, Any]]) -> None:
    """The deployment that started the project: a rank with 12 requests in a step padded to 13 tokens."""
    seed = next(
        s
        for s in buggy_shapes
        if s["scenario"]["method"] == "ar-multi-step"
        and s["scenario"]["reqs_per_rank"] == [12, 13]
        and s["scenario"]["source"] == "dp-padded"
    )
    rank0 = seed["ranks"][0]
    assert rank0["invariant"] == "AR-5"
    assert rank0["observed"] == {
        "meta.num_reqs_padded": 12,
        "meta.num_tokens_padded": 13,
        "expected num_reqs_padded": 12,
        "expected attention tokens": 12,
        "desc.num_tokens": 13,
        "num_reqs": 12,
    }


def test_buggy_release_own_dispatch_has_no_false_positive(buggy_shapes: list[dict[str, Any]]) -> None:
    """0.29's draft steps run their own DP collective, so eager ranks keep their own count: nothing to flag."""
    dispatched = [s for s in buggy_shapes if s["scenario"]["source"] == "dispatch"]
    assert dispatched
    assert [s["label"] for s in dispatched if s["verdict"] != "ok"] == []


def test_buggy_release_with_contracts_off_crashes_in_the_kernel(tmp_path: Path) -> None:
    _release_or_skip(BUGGY)
    results = _vllm_check(BUGGY, "off", tmp_path)
    for s in results:
        scenario = s["scenario"]
        ranks = _padded_ranks(scenario) if scenario["source"] == "dp-padded" else []
        for outcome in s["ranks"]:
            if outcome["rank"] in ranks:
                num_reqs = max(scenario["reqs_per_rank"][outcome["rank"]], 1)
                padded_tokens = max(max(n, 1) for n in scenario["reqs_per_rank"]) * _q(scenario)
                want = f"q.shape[0] ({padded_tokens}) does not match qo_indptr[-1] ({num_reqs * _q(scenario)})"
                assert (outcome["kind"], outcome["message"]) == ("kernel", want), (s["label"], outcome)
            else:
                assert outcome["kind"] == "ok", (s["label"], outcome)


@pytest.mark.parametrize("mode", ["shapes", "full"])
def test_installed_fixed_release_has_zero_violations_over_the_whole_matrix(mode: str) -> None:
    layout = layout_for(vllm.__version__)
    assert layout is not None and layout.fixed, f"the vLLM environment has a fixed release, not {vllm.__version__}"
    runner = Runner(layout, mode)
    results = [runner.run(s) for s in matrix(layout)]
    assert [(r.scenario.label(), r.ranks) for r in results if r.kind != "ok"] == []
    outcomes = [o.message for r in results for o in r.ranks]
    assert any(m == "FULL replay" or m.startswith("FULL ") for m in outcomes), "FULL steps are part of the matrix"
    assert any(m.startswith("NONE num_tokens=13 num_reqs=12") for m in outcomes), "DP-padded eager steps are dispatched"
    assert {r.scenario.method for r in results} == set(release_methods(layout))
    assert any(r.scenario.step_k for r in results), "steps of a K below the configured K are part of the matrix"


OTHER_FIXED = sorted(v for v in LAYOUTS if LAYOUTS[v].fixed and v != INSTALLED)


@pytest.mark.parametrize("version", OTHER_FIXED)
def test_other_fixed_releases_have_zero_violations(version: str, tmp_path: Path) -> None:
    _release_or_skip(version)
    results = _vllm_check(version, "shapes", tmp_path)
    assert [s["label"] for s in results if s["verdict"] != "ok"] == []
    unchecked = [  # and not because nothing was checked: every rank's draft step went through the hooks
        s["label"]
        for s in results
        if not _checked_on_every_rank(s["checks"], [o["message"] for o in s["ranks"]], s["scenario"])
    ]
    assert unchecked == []


PLANT_THE_BUG = """
import dataclasses, importlib, json
import vllm
from specdec.integrations.vllm.harness.runner import Runner
from specdec.integrations.vllm.harness.scenario import Scenario, release_methods
from specdec.integrations.vllm.versions import layout_for

layout = layout_for(vllm.__version__)
base = importlib.import_module(layout.base_module)
full = importlib.import_module("vllm.config.compilation").CUDAGraphMode.FULL
builder = base.DraftModelSpeculator._build_attn_metadata

def buggy(self, *args, batch_desc, **kw):
    return builder(self, *args, batch_desc=dataclasses.replace(batch_desc, cg_mode=full), **kw)

base.DraftModelSpeculator._build_attn_metadata = buggy
scenarios = {m: Scenario(m, (12, 13), "NONE", (1, 2, 4, 8), 3, "dp-padded") for m in release_methods(layout)}
if layout.decode_takes_k:
    for m in ("ar-multi-step", "ar-fused"):
        scenarios[m + " step K=2"] = dataclasses.replace(scenarios[m], step_k=2)
outcomes = {}
for name, scenario in scenarios.items():
    result = Runner(layout, "shapes").run(scenario)
    outcomes[name] = [[o.kind, o.invariant, o.component.rpartition(" ")[2]] for o in result.ranks]
print(json.dumps({"vllm": vllm.__version__, "outcomes": outcomes}))
"""


@pytest.mark.parametrize("version", sorted(v for v in LAYOUTS if LAYOUTS[v].fixed))
def test_the_bug_planted_into_each_fixed_release_is_caught(version: str) -> None:
    """The fixed builder, made to size attention by desc.num_tokens in every graph mode again, is caught: AR-5 on
    every autoregressive path (Gemma4's held positions and, where the release has it, a step of K below the
    configured K included), BLK-3 on every block layout. In a child process, which imports the release's files."""
    path = [str(ROOT)]
    if version != INSTALLED:
        _release_or_skip(version)
        path.insert(0, str(_releases_dir() / version))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    proc = subprocess.run(
        [sys.executable, "-c", PLANT_THE_BUG], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert normalise(report["vllm"]) == version
    layout = LAYOUTS[version]
    ar, fused = layout.ar_class, layout.fused_decode
    # The invariant, and the vLLM class and method it was caught in: Gemma4 and DSpark's fill-in layout run their
    # own classes' inherited step methods through the same hooks.
    expected = {
        "ar-multi-step": ("AR-5", f"{ar}._multi_step_decode"),
        "ar-fused": ("AR-5", f"{ar}.{fused}"),
        "ar-gemma4": ("AR-5", "Gemma4Speculator._multi_step_decode"),
        "ar-standalone": ("AR-5", "StandaloneARSpeculator._multi_step_decode"),
        "dflash": ("BLK-3", "DFlashSpeculator.propose"),
        "dspark": ("BLK-3", "DSparkSpeculator.propose"),
        "dspark-fill-in": ("BLK-3", "DSparkSpeculator.propose"),
    }
    expected = {m: expected[m] for m in release_methods(layout)}
    if layout.decode_takes_k:
        expected |= {f"{m} step K=2": expected[m] for m in ("ar-multi-step", "ar-fused")}
    assert report["outcomes"] == {m: [["violation", *caught], ["ok", None, ""]] for m, caught in expected.items()}


def test_a_fill_in_dspark_block_of_k_queries_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """DSpark with ``sample_from_anchor`` off drafts a 1 + K block; one of K queries (the anchor-first width) is
    wrong for it. The hooks take the layout from the speculator's attribute, not its class name, so BLK-1 fires."""
    layout = layout_for(vllm.__version__)
    assert layout is not None
    width = Scenario.query_width.fget  # type: ignore[attr-defined]
    scenario = Scenario("dspark-fill-in", (12,), "NONE", (1, 2, 4, 8), 3)
    assert Runner(layout, "shapes").run(scenario).kind == "ok"
    monkeypatch.setattr(Scenario, "query_width", property(lambda s: s.k if s.method == "dspark-fill-in" else width(s)))
    result = Runner(layout, "shapes").run(scenario)
    assert [(o.kind, o.invariant, o.observed.get("query_width")) for o in result.ranks] == [("violation", "BLK-1", 3)]


def test_a_release_outside_the_table_is_refused_by_name_before_any_fetch(tmp_path: Path) -> None:
    env = dict(os.environ, SPECDEC_VLLM_RELEASES=str(tmp_path))
    command = [sys.executable, "-m", "specdec.cli.main", "vllm-check", "--vllm-version", "0.28.0", "--fetch"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().splitlines()[-1].startswith("specdec: error: vLLM 0.28.0 is not in specdec's version table")
    )
    assert list(tmp_path.iterdir()) == [], "nothing was fetched"


def test_a_method_the_release_has_no_code_for_is_a_usage_error() -> None:
    """The standalone draft model runs the autoregressive loops from 0.34 only: asked of an earlier release, the
    check names the method, the release and the methods it has."""
    layout = layout_for(vllm.__version__)
    assert layout is not None and layout.standalone_module is None, "the vLLM environment's release predates 0.34"
    command = [sys.executable, "-m", "specdec.cli.main", "vllm-check", "--methods", "ar-standalone"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"specdec: error: unknown method(s) ar-standalone for vLLM {layout.release}; expected some of "
        + ", ".join(release_methods(layout))
    )


def test_contracts_off_on_the_fixed_release_runs_clean() -> None:
    runner = Runner(layout_for(vllm.__version__), "off")  # type: ignore[arg-type]
    results = [runner.run(s) for s in matrix(runner.layout, quick=True)]
    assert all(r.kind == "ok" for r in results)


def test_hooks_install_is_idempotent_and_uninstall_restores() -> None:
    layout = layout_for(vllm.__version__)
    assert layout is not None
    import importlib

    base = importlib.import_module(layout.base_module)
    original = base.build_attn_metadata
    first = hooks.install()
    try:
        assert first.supported and first.vllm_version == vllm.__version__
        assert base.build_attn_metadata is not original
        wrapped = base.build_attn_metadata
        assert hooks.install() == first
        assert base.build_attn_metadata is wrapped, "a second install wraps nothing twice"
        assert any(p.endswith("._multi_step_decode") for p in first.patched)
        assert any(p.endswith("DFlashSpeculator.propose") for p in first.patched)
    finally:
        hooks.uninstall()
    assert base.build_attn_metadata is original


def test_a_dp_rank_that_skips_the_collective_is_named_not_hung() -> None:
    import torch

    from specdec.integrations.vllm.harness.dp import CollectiveMismatch, InProcessDPGroup

    group = InProcessDPGroup(2, timeout_s=2.0)

    def body(rank: int) -> int:
        if rank == 0:
            group.all_reduce(torch.zeros(1))
        return rank

    results = group.run(body)
    assert isinstance(results[0], CollectiveMismatch) and results[1] == 1


def test_scenario_labels_are_unique() -> None:
    labels = [s.label() for s in matrix(LAYOUTS["0.34.0"])]  # every method, steps of a lower K included
    assert len(labels) == len(set(labels))
    assert Scenario("dflash", (12, 13), "NONE", (1, 2), 3, "dp-padded").dp_size == 2


def test_every_eager_scenario_was_actually_checked_on_every_rank() -> None:
    """Zero violations means something only if every draft forward went through a check."""
    runner = Runner(layout_for(vllm.__version__), "shapes")  # type: ignore[arg-type]
    results = [runner.run(s) for s in matrix(runner.layout, quick=True)]
    unchecked = [
        r.scenario.label()
        for r in results
        if not _checked_on_every_rank(r.checks, [o.message for o in r.ranks], dataclasses.asdict(r.scenario))
    ]
    assert unchecked == []


def _checked_on_every_rank(checks: dict[str, int], rank_messages: list[str], scenario: dict[str, Any]) -> bool:
    """A descriptor check per rank, a DP agreement check per rank under DP (the step's dispatch went through the
    hooks), and a batch check per rank where every rank ran eager (no graph replay): one per draft step for the
    autoregressive loops, so a step of K below the configured K runs as many steps as its own K says."""
    dp = len(rank_messages)
    eager = all(m == "eager" or m.startswith("NONE") for m in rank_messages)
    batch = checks.get("batch", 0)
    if eager and scenario["method"].startswith("ar"):
        batch_ok = batch == dp * ((scenario["step_k"] or scenario["k"]) - 1)
    else:
        batch_ok = not eager or batch >= dp
    return checks.get("descriptor", 0) >= dp and (dp == 1 or checks.get("dp", 0) >= dp) and batch_ok
