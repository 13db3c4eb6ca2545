"""``specdec bench``: interleaving, speedup pairing, the losslessness check, contract modes and the report.

Everything but one check runs on a random tiny target (seconds); the figures
are meaningless there, the bookkeeping is not: outputs must match plain decoding token for
token, ratios must pair runs of the same round, the report must hold every
section and render. The one real-model check (skipped when SmolLM2 is not
pulled) makes sure the logit gap a mismatch is judged by comes from the target.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from real_models import PulledModel, smollm2  # noqa: F401  (fixture)

import contracts
import contracts.enforcement
from specdec import engine as engine_module
from specdec.bench.contract_modes import CheckTimer, contract_mode
from specdec.bench.driver import count_runs, peer_section, run_bench
from specdec.bench.lossless import (
    TopTwo,
    check_lossless,
    first_difference,
    relative_tie_tolerance_for,
    tie_tolerance_for,
    top_two,
)
from specdec.bench.options import BenchOptions
from specdec.bench.output import DOCS_BEGIN, DOCS_END, write_docs
from specdec.bench.peer import PEER, PROMPT_LOOKUP
from specdec.bench.report import render_markdown, round_noise
from specdec.bench.runner import PLAIN, EngineRunner, RunRecord, RunSpec, interleave, pair_ratios
from specdec.bench.suites import Batch, BenchPrompt, Workload, build_workload
from specdec.cli.main import main
from specdec.nn.config import ModelConfig
from specdec.nn.packed_linear import mkldnn_available, mkldnn_bf16_available
from specdec.nn.transformer import Transformer

# -- pieces ----------------------------------------------------------------------------------------------------


def record(runner: str, repeat: int, outputs: list[list[int]], wall: float, batch: str = "s/b1/0") -> RunRecord:
    return RunRecord(
        runner=runner,
        suite="s",
        batch_size=1 if "/b1/" in batch else 8,
        batch_key=batch,
        temperature=0.0,
        repeat=repeat,
        prompt_ids=[f"p{i}" for i in range(len(outputs))],
        outputs=outputs,
        wall_s=wall,
    )


@dataclass
class FakeRunner:
    """Records the order it was called in; a fixed wall time per run."""

    name: str
    wall: float
    calls: list[tuple[str, int, str]]

    def supports(self, batch_size: int, spec: RunSpec) -> bool:
        return self.name != "peer" or batch_size == 1

    def run(self, batch: Batch, spec: RunSpec, repeat: int) -> RunRecord:
        self.calls.append((batch.key, repeat, self.name))
        return record(self.name, repeat, [[1, 2, 3, 4]] * len(batch.prompts), self.wall, batch.key)


def batches(n: int, size: int = 1) -> tuple[Batch, ...]:
    return tuple(Batch("s", size, i, tuple(BenchPrompt(f"p{i}.{j}", (1, 2)) for j in range(size))) for i in range(n))


def test_interleave_alternates_the_order_and_skips_unsupported_runners() -> None:
    calls: list[tuple[str, int, str]] = []
    runners = [FakeRunner(name, 1.0, calls) for name in (PLAIN, "a", "b", "peer")]
    spec = RunSpec(0.0, 4, ())
    interleave(batches(2), runners, spec, repeats=2)
    rounds = [[name for key, rep, name in calls if (key, rep) == (b.key, r)] for b in batches(2) for r in range(2)]
    assert rounds == [
        [PLAIN, "a", "b", "peer"],
        ["peer", "b", "a", PLAIN],
        ["peer", "b", "a", PLAIN],
        [PLAIN, "a", "b", "peer"],
    ]
    calls.clear()
    interleave(batches(1, size=8), runners, spec, repeats=1)
    assert [name for _, _, name in calls] == [PLAIN, "a", "b"], "the peer runs batch 1 only"
    with pytest.raises(ValueError, match="repeats"):
        interleave(batches(1), runners, spec, repeats=0)


def test_pair_ratios_compare_runs_of_the_same_round_only() -> None:
    records = [
        record(PLAIN, 0, [[1] * 10], 1.0),
        record("spec", 0, [[1] * 10], 0.5),  # 2x in round 0
        record(PLAIN, 1, [[1] * 10], 4.0),  # a slow round: both sides slowed
        record("spec", 1, [[1] * 10], 1.0),  # 4x in round 1
        record("spec", 2, [[1] * 10], 0.1),  # no plain run in round 2: no sample
    ]
    assert sorted(pair_ratios(records)["spec"]) == [2.0, 4.0]
    assert round_noise(records) == pytest.approx(3.0), "plain ran at 10 and 2.5 tokens/s on the same batch"
    assert round_noise(records[:2]) is None, "one round: no noise figure"


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_lossless_check_reports_the_first_difference_and_whether_a_tie_explains_it() -> None:
    prompt = {"p0": (7, 8), "p1": (9,)}
    records = [
        record(PLAIN, 0, [[1, 2, 3], [4, 5, 6]], 1.0),
        record("tied", 0, [[1, 2, 9], [4, 5, 6]], 1.0),
        record("buggy", 0, [[1, 2, 3], [4, 0, 6]], 1.0),
    ]
    seen: list[tuple[int, ...]] = []

    def gap(ids: Sequence[int]) -> TopTwo:
        seen.append(tuple(ids))
        return TopTwo(3, 9, 0.0) if tuple(ids) == (7, 8, 1, 2) else TopTwo(5, 0, 3.5)

    report = check_lossless(records, prompt, gap, tie_tolerance=1e-3)
    assert report.compared == {"tied": 2, "buggy": 2}
    assert report.identical == {"tied": 1, "buggy": 1}
    by_runner = {m.runner: m for m in report.mismatches}
    assert (by_runner["tied"].position, by_runner["tied"].expected, by_runner["tied"].got) == (2, 3, 9)
    assert by_runner["tied"].verdict == "exact tie"
    assert by_runner["buggy"].position == 1 and by_runner["buggy"].verdict.startswith("NOT a tie")
    assert (9, 4) in seen, "the gap is taken after the prompt and the agreed prefix"
    assert not report.lossless
    only_tie = check_lossless(records[:2], prompt, gap, tie_tolerance=1e-3)
    assert only_tie.lossless and len(only_tie.mismatches) == 1


def test_a_bf16_tie_scales_with_the_logit() -> None:
    """0.25 apart at a logit of 24 is two bf16 rounding steps (noise); at a logit of 4 it is sixteen (a bug)."""
    prompt = {"p0": (7,)}
    records = [record(PLAIN, 0, [[1, 2]], 1.0), record("spec", 0, [[1, 3]], 1.0)]
    bf16 = {
        "tie_tolerance": tie_tolerance_for(torch.bfloat16),
        "relative_tolerance": relative_tie_tolerance_for(torch.bfloat16),
    }
    high = check_lossless(records, prompt, lambda ids: TopTwo(2, 3, 0.25, 24.0), **bf16)
    assert high.mismatches[0].verdict.startswith("near tie") and high.lossless
    low = check_lossless(records, prompt, lambda ids: TopTwo(2, 3, 0.25, 4.0), **bf16)
    assert low.mismatches[0].verdict.startswith("NOT a tie") and not low.lossless
    fp32 = check_lossless(
        records, prompt, lambda ids: TopTwo(2, 3, 0.25, 24.0), tie_tolerance=tie_tolerance_for(torch.float32)
    )
    assert fp32.mismatches[0].verdict.startswith("NOT a tie")


def test_lossless_check_compares_plain_alone_with_plain_in_a_batch() -> None:
    alone = [record(PLAIN, 0, [[1, 2]], 1.0, "s/b1/0"), record(PLAIN, 0, [[3, 4]], 1.0, "s/b1/1")]
    for i, r in enumerate(alone):
        r.prompt_ids = [f"p{i}"]
    batched = record(PLAIN, 0, [[1, 2], [3, 5]], 1.0, "s/b8/0")
    report = check_lossless([*alone, batched], {}, lambda ids: None, tie_tolerance=1e-3)
    assert report.batching == {"compared": 2, "identical": 1}
    assert [(m.prompt, m.position, m.verdict) for m in report.batching_mismatches] == [
        ("p1", 1, "unexplained: no logits")
    ]


def test_build_workload_skips_long_prompts_and_fails_when_too_few_remain() -> None:
    @dataclass(frozen=True)
    class P:
        id: str
        text: str
        chat: bool

    class Tok:
        def encode(self, text: str) -> list[int]:
            return [len(w) for w in text.split()]

        def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
            return [99, *self.encode(messages[0]["content"]), 98]

    prompts = [P("humaneval/a", "x y", True), P("humaneval/b", "x " * 50, False), P("humaneval/c", "z", False)]
    w = build_workload("humaneval", Tok(), singles=2, group_size=2, max_prompt_tokens=10, source=lambda _: prompts)
    assert [b.prompts[0].ids for b in w.singles] == [(99, 1, 1, 98), (1,)]
    assert w.skipped_long == 1 and [p.id for p in w.groups[0].prompts] == ["humaneval/a", "humaneval/c"]
    with pytest.raises(ValueError, match="only 2 prompts"):
        build_workload("humaneval", Tok(), singles=3, max_prompt_tokens=10, source=lambda _: prompts)
    with pytest.raises(ValueError, match="unknown suite"):
        build_workload("gsm8k", Tok(), singles=1)


# -- contract modes --------------------------------------------------------------------------------------------


def test_contract_mode_none_removes_the_entry_points_and_restores_them() -> None:
    check, proposal = contracts.enforcement.check, engine_module.check_proposal
    with contract_mode("none"):
        assert contracts.check is not check and engine_module.check_proposal is not proposal
        assert contracts.current_mode() is contracts.Mode.OFF
    assert contracts.check is check and engine_module.check_proposal is proposal
    timer = CheckTimer()
    with contract_mode("shapes", timer):
        assert contracts.current_mode() is contracts.Mode.SHAPES
        assert engine_module.check_proposal is not proposal, "timed while the block runs"
    assert engine_module.check_proposal is proposal
    with pytest.raises(ValueError, match="unknown contract mode"), contract_mode("strict"):
        pass


# -- the whole bench on a tiny target --------------------------------------------------------------------------


def tiny() -> tuple[Transformer, Workload]:
    config = ModelConfig.tiny(num_layers=2, hidden_size=32, intermediate_size=64, head_dim=8)
    prompts = [BenchPrompt(f"humaneval/p{i}", tuple(3 + (5 * i + j) % 40 for j in range(6))) for i in range(2)]
    workload = Workload(
        "humaneval",
        tuple(Batch("humaneval", 1, i, (p,)) for i, p in enumerate(prompts)),
        (Batch("humaneval", 2, 0, tuple(prompts)),),
        0,
    )
    return Transformer(config, seed=0), workload


@pytest.fixture(scope="module")
def tiny_report() -> dict[str, object]:
    target, workload = tiny()
    options = BenchOptions(
        suites=("humaneval",),
        max_tokens=5,
        singles=2,
        group_size=2,
        batch_sizes=(1, 2),
        temperatures=(0.0, 1.0),
        repeats=1,
        weights="random",
        contract_prompts=1,
        peer=False,
    )
    seen: list[RunRecord] = []
    with contracts.enforce("off"):
        report = run_bench(target, [workload], (), options, on_run=seen.append)
    assert len(seen) == count_runs([workload], options, peers=0)
    return report


def test_greedy_runs_stop_at_stop_tokens_and_sampled_runs_decode_every_token() -> None:
    """Sampled runs do the same work under every runner (``RunSpec.equal_work``); greedy ones stop as generate does."""
    target, workload = tiny()
    options = BenchOptions(
        suites=("humaneval",),
        backends=("eagle",),
        max_tokens=5,
        singles=1,
        group_size=2,
        batch_sizes=(1,),
        temperatures=(0.0, 1.0),
        repeats=1,
        weights="random",
        contract_prompts=0,
        peer=False,
    )
    every_token = tuple(range(target.config.vocab_size))  # each token stops a request that honours stop tokens
    with contracts.enforce("off"):
        report = run_bench(target, [workload], every_token, options)
    lengths = {(r["temperature"], r["runner"]): [len(o) for o in r["outputs"]] for r in report["runs"]}
    assert lengths[(0.0, PLAIN)] == lengths[(0.0, "eagle")] == [1]
    assert lengths[(1.0, PLAIN)] == lengths[(1.0, "eagle")] == [5]
    assert RunSpec.equal_work(0.0, 5, (7,), 0).stop_token_ids == (7,)
    assert RunSpec.equal_work(1.0, 5, (7,), 0) == RunSpec(1.0, 5, (), 0)


def test_tiny_bench_is_lossless_and_summarizes_every_runner(tiny_report: dict[str, object]) -> None:
    report = json.loads(json.dumps(tiny_report))  # JSON-ready throughout
    lossless = report["lossless"]
    assert lossless["lossless"] and not lossless["mismatches"]
    assert lossless["compared"] == {"eagle": 4, "dflash": 4, "dspark": 4}, "2 prompts alone + a batch of 2, greedy"
    runners = {(s["batch_size"], s["temperature"], s["runner"]) for s in report["summaries"]}
    assert runners == {(b, t, r) for b in (1, 2) for t in (0.0, 1.0) for r in (PLAIN, "eagle", "dflash", "dspark")}
    for s in report["summaries"]:
        if s["runner"] == PLAIN:
            assert s["tau"] is None and s["speedup"] is None
        else:
            assert 1.0 <= s["tau"] <= 5.0 and s["speedup"]["n"] >= 1
            assert len(s["acceptance_by_position"]) == 4
    for run in report["runs"]:
        assert all(len(o) <= 5 for o in run["outputs"])
        # The adaptive policy decides once per step in which a request could draft: at most once per step.
        assert (run["decisions"] == "") == (run["runner"] == PLAIN) and len(run["decisions"]) <= run["steps"]
    for s in report["summaries"]:
        traces = [
            r["decisions"]
            for r in report["runs"]
            if (r["suite"], r["batch_size"], r["temperature"], r["runner"])
            == (s["suite"], s["batch_size"], s["temperature"], s["runner"])
        ]
        assert (s["decisions"] is None) == (s["runner"] == PLAIN)
        assert s["decisions"] is None or sum(s["decisions"].values()) == sum(map(len, traces))
        if run["runner"] != PLAIN and run["runner"] in ("eagle", "dflash", "dspark"):
            # every token after a request's first comes from a verify step, and tau counts exactly those
            assert run["emitted_in_verify"] == run["tokens"] - len(run["outputs"])
    assert {d["weights_source"] for d in report["drafters"].values()} == {"random"}
    modes = report["contracts"]["modes"]
    assert set(modes) == {"none", "off", "shapes", "full"} and report["contracts"]["same_output_in_every_mode"]
    assert modes["shapes"]["check_calls"] > 0 and 0 < modes["shapes"]["check_fraction"] < 1
    assert modes["none"]["check_fraction"] is None
    assert report["peer"]["status"] == "skipped"
    names = [t["name"] for t in report["targets"]]
    assert names[:4] == [
        "best backend >= 2.0x plain (batch 1, greedy, HumanEval)",
        "every backend >= 1.3x plain (batch 1, greedy, HumanEval)",
        "every backend >= 1.0x plain in every cell (within the noise)",
        "greedy output equals plain decoding (ties explained)",
    ]
    assert "dspark tau > dflash tau > eagle tau (batch 1, greedy, HumanEval)" in names


def test_report_renders_and_writes_plots_and_docs(tiny_report: dict[str, object], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from specdec.bench.output import write_outputs

    report = json.loads(json.dumps(tiny_report))
    written = write_outputs(report, tmp_path / "out")
    assert {p.name for p in written} == {"bench.json", "bench.md", "speedup.png", "acceptance.png"}
    for png in ("speedup.png", "acceptance.png"):
        assert (tmp_path / "out" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "out" / "bench.md").read_text()
    assert md.startswith(f"Command: `{report['command']}`")
    assert (
        "| 1 | 0 | eagle |" in md
        and "### Losslessness" in md
        and "Adaptive draft-length decisions" in md
        and "![speedup.png](./speedup.png)" in md
    )
    assert render_markdown(json.loads((tmp_path / "out" / "bench.json").read_text())) == md
    # A report saved before runs recorded their decisions renders as it did: the same tables, no decision table.
    older = json.loads(json.dumps(report))
    for s in older["summaries"]:
        del s["decisions"]
    for run in older["runs"]:
        del run["decisions"]
    assert "Adaptive draft-length decisions" not in render_markdown(older)
    assert render_markdown(older).split("\n")[:8] == md.split("\n")[:8]
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Bench\nkept\n{DOCS_BEGIN}\nstale figures\n{DOCS_END}\ntail\n")
    write_docs(report, tmp_path / "out", doc)
    text = doc.read_text()
    assert text.startswith("# Bench\nkept\n") and text.endswith(f"{DOCS_END}\ntail\n") and "stale figures" not in text
    assert "![speedup.png](benchmarks/speedup.png)" in text and (tmp_path / "benchmarks" / "speedup.png").is_file()
    with pytest.raises(ValueError, match="no generated section"):
        write_docs(report, tmp_path / "out", tmp_path / "out" / "bench.md")


# -- the command line ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backends", "plain"], "always runs as the baseline"),
        (["--suites", "gsm8k"], "unknown suite"),
        (["--batch-sizes", "1,4"], "--batch-sizes may hold 1 and the group size"),
        (["--temperatures", "hot"], "comma-separated numbers"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--contract-backend", "medusa"], "is not among --backends"),
    ],
)
def test_cli_rejects_bad_options_before_loading_anything(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *args]) == 2
    assert message in capsys.readouterr().err


def test_render_judges_a_saved_reports_targets_again_and_rewrites_its_outputs(
    tiny_report: dict[str, object], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    report: dict[str, Any] = json.loads(json.dumps(tiny_report))
    report["targets"] = [{"name": "a target of an older rule", "passed": True, "value": "1x", "note": ""}]
    out = tmp_path / "run"
    out.mkdir()
    (out / "bench.json").write_text(json.dumps(report))
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Bench\n{DOCS_BEGIN}\nstale\n{DOCS_END}\n")
    assert main(["bench", "--render", str(out), "--write-docs", str(doc)]) == 0
    printed = capsys.readouterr().out
    saved = json.loads((out / "bench.json").read_text())
    names = [t["name"] for t in saved["targets"]]
    assert "a target of an older rule" not in names and "greedy output equals plain decoding (ties explained)" in names
    assert saved["summaries"] == report["summaries"] and saved["runs"] == report["runs"]  # nothing ran again
    assert (out / "bench.md").read_text() == printed and "greedy output equals plain decoding" in printed
    assert printed.replace("](./", "](benchmarks/") in doc.read_text() and "stale" not in doc.read_text()
    assert (out / "speedup.png").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--render", "{tmp}/missing"], "no bench.json there; expected the --out folder of a bench run"),
        (["--render", "{tmp}/bad"], "bench.json is not JSON"),
        (["--render", "{tmp}/other"], "bench.json is not a bench report"),
        (["--render", "{tmp}/run", "--suites", "mtbench"], "--render runs nothing, so --suites has nothing"),
        (["--render", "{tmp}/run", "--out", "{tmp}/x"], "--render runs nothing, so --out has nothing"),
        (["--render", "{tmp}/run", "--write-docs", "{tmp}/plain.md"], "has no generated section"),
        (["--render", "{tmp}/run", "--write-docs", "{tmp}/none.md"], "cannot read"),
        (["--write-docs", "{tmp}/plain.md"], "has no generated section"),
    ],
)
def test_render_and_write_docs_mistakes_are_one_line_errors(
    args: list[str], message: str, tiny_report: dict[str, object], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, text in (("bad", "{not json"), ("other", "[1, 2]"), ("run", json.dumps(tiny_report))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench.json").write_text(text)
    (tmp_path / "plain.md").write_text("# no generated section\n")
    assert main(["bench", *(a.format(tmp=tmp_path) for a in args)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error: ") and message in err and err.count("\n") == 1
    assert json.loads((tmp_path / "run" / "bench.json").read_text()) == json.loads(json.dumps(tiny_report))


def test_the_target_loads_before_the_peer_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A first float32 load times its kernels; the peer loading beside it would make that a busy host's timing."""
    import specdec.bench.peer
    import specdec.hub
    from specdec.hub import ModelStoreError

    order: list[str] = []

    def fake_load(name: str, **kwargs: object) -> tuple[Transformer, object]:
        order.append("target")
        return Transformer(ModelConfig.tiny(), seed=0), object()

    class FakeStore:
        def source_gguf(self, name: str) -> Path:
            return tmp_path / "model.gguf"

    def fake_peer(gguf: Path, **kwargs: object) -> None:
        order.append("peer")
        raise ModelStoreError("stop here")

    monkeypatch.setattr(specdec.hub, "load", fake_load)
    monkeypatch.setattr(specdec.hub, "ModelStore", FakeStore)
    monkeypatch.setattr(specdec.bench.peer, "TransformersPeer", fake_peer)
    assert main(["bench", "--quick", "--out", str(tmp_path / "out")]) == 1
    assert order == ["target", "peer"]
    assert "stop here" in capsys.readouterr().err


def test_the_header_names_the_cpu_and_the_float32_kernel_choice(tiny_report: dict[str, object]) -> None:
    report: dict[str, Any] = json.loads(json.dumps(tiny_report))
    env = report["environment"]
    assert env["cpu"] and env["fp32_f_linear_rows"] == sorted(env["fp32_f_linear_rows"])
    assert env["onednn"] is mkldnn_available()

    def header(**changes: object) -> str:
        report["environment"] = {**env, **changes}
        return render_markdown(report).split("\n\n")[1]

    assert f"core(s) ({env['cpu']})" in header()
    assert "(every float32 product on the packed kernel)" in header(dtype="float32", fp32_f_linear_rows=[])
    assert "of 1, 2 row(s) on `F.linear`, the rest on the packed kernel" in header(
        dtype="float32", fp32_f_linear_rows=[1, 2]
    )
    assert "kernel" not in header(dtype="bfloat16", fp32_f_linear_rows=[1])  # bf16 always packs
    assert "(every float32 product on `F.linear` (this torch has no oneDNN))" in header(
        dtype="float32", fp32_f_linear_rows=[], onednn=False
    )
    older = {k: v for k, v in env.items() if k not in ("cpu", "fp32_f_linear_rows")}
    report["environment"] = older  # a report from before they were recorded
    line = render_markdown(report).split("\n\n")[1]
    assert "CPU core(s), torch" in line and "kernel" not in line


def test_the_report_names_a_lookups_longer_k(tiny_report: dict[str, object]) -> None:
    report: dict[str, Any] = json.loads(json.dumps(tiny_report))
    k = report["config"]["k"]
    assert f"; K = {k};" in render_markdown(report)
    report["config"]["backend_options"] = [["lookup", 3], ["lookup_drafts", k + 4]]
    assert f"; K = {k} for the drafters, up to {k + 4} for a prompt-lookup match;" in render_markdown(report)


def test_options_render_the_command_that_reproduces_them() -> None:
    import argparse

    from specdec.bench.options import add_arguments, options_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    quick = options_from_args(parser.parse_args(["--quick", "--backends", "eagle", "--no-peer"]))
    assert (quick.max_tokens, quick.batch_sizes, quick.backends, quick.peer) == (8, (1, 2), ("eagle",), False)
    again = options_from_args(parser.parse_args(quick.command().split()[2:]))
    assert again == quick
    exact = options_from_args(parser.parse_args(["--quick", "--dtype", "bfloat16", "--batch-invariant"]))
    assert exact.batch_invariant and "--batch-invariant" in exact.command()
    assert options_from_args(parser.parse_args(exact.command().split()[2:])) == exact
    batched = options_from_args(parser.parse_args(["--quick", "--dtype", "bfloat16", "--verify-attention", "batched"]))
    assert batched.verify_attention == "batched" and "--verify-attention batched" in batched.command()
    assert options_from_args(parser.parse_args(batched.command().split()[2:])) == batched
    assert "--verify-attention" not in exact.command()  # the default is not spelled out

    from specdec.bench.options import configure_target

    target = Transformer(ModelConfig.tiny(vocab_size=32), seed=0, dtype=torch.bfloat16)
    configure_target(target, batch_invariant=batched.batch_invariant, verify_attention=batched.verify_attention)
    assert not target.exact_verify and not target.batch_invariant
    if not mkldnn_bf16_available():  # an AVX2-only CPU: the bench turns this into a one-line usage error
        with pytest.raises(ValueError, match="batch_invariant needs oneDNN's packed bf16 matmul"):
            configure_target(target, batch_invariant=exact.batch_invariant, verify_attention=exact.verify_attention)
        return
    configure_target(target, batch_invariant=exact.batch_invariant, verify_attention=exact.verify_attention)
    assert target.exact_verify and target.batch_invariant


def test_peer_reports_a_load_failure_instead_of_hanging(tmp_path: Path) -> None:
    """The child answers with an error line (transformers missing, or a file it cannot read); the parent raises."""
    from specdec.bench.peer import PeerUnavailable, TransformersPeer

    peer = TransformersPeer(tmp_path / "missing.gguf", dtype="float32", threads=1)
    try:
        with pytest.raises(PeerUnavailable, match=r"transformers (could not load|is not installed)"):
            peer.wait_ready()
    finally:
        peer.close()


def test_peer_section_sets_transformers_prompt_lookup_against_its_own_plain_generate() -> None:
    records = [
        record(PLAIN, 0, [[1] * 10], 1.0),
        record(PEER, 0, [[1] * 10], 2.0),
        record(PROMPT_LOOKUP, 0, [[1] * 10], 1.0),  # 2x its own plain generate in round 0
        record(PLAIN, 1, [[1] * 10], 1.0),
        record(PEER, 1, [[1] * 10], 2.0),
        record(PROMPT_LOOKUP, 1, [[1] * 9 + [2]], 0.5),  # 4x, and different tokens
    ]
    section = peer_section(records, PEER, PROMPT_LOOKUP)
    assert section["engine_over_transformers"]["median"] == pytest.approx(2.0)
    lookup = section["prompt_lookup"]
    assert lookup["speedup_over_transformers"]["median"] == pytest.approx(3.0)
    assert (lookup["same_tokens"], lookup["compared"]) == (1, 2)
    assert "prompt_lookup" not in peer_section(records, PEER)


def test_the_peer_runs_plain_and_prompt_lookup_generate_on_the_real_model(smollm2: PulledModel) -> None:  # noqa: F811
    """transformers' own speculative decoding through the peer's child: greedy, so the same tokens as plain."""
    from specdec.bench.peer import PeerUnavailable, TransformersPeer
    from specdec.hub import ModelStore

    peer = TransformersPeer(ModelStore().source_gguf("smollm2-135m-instruct"), dtype="float32", threads=1)
    try:
        try:
            peer.wait_ready()
        except PeerUnavailable as exc:
            pytest.skip(f"no transformers peer here: {exc}")
        prompt = tuple(smollm2.tokenizer.encode("def fib(n):\n    if n < 2:\n        return n\n    return fib("))
        batch = Batch("humaneval", 1, 0, (BenchPrompt("humaneval/p", prompt),))
        spec = RunSpec(0.0, 12, ())
        plain = peer.run(batch, spec, 0)
        lookup = peer.prompt_lookup(4).run(batch, spec, 0)
        assert (plain.runner, lookup.runner) == (PEER, PROMPT_LOOKUP)
        assert len(plain.outputs[0]) == 12 and lookup.outputs == plain.outputs
        with pytest.raises(ValueError, match="at least 1 token"):
            peer.prompt_lookup(0)
    finally:
        peer.close()


def test_top_two_agrees_with_plain_greedy_decoding_on_the_real_model(smollm2: PulledModel) -> None:  # noqa: F811
    """The gap a mismatch is judged by comes from the same target: its top-1 is the token plain decoding chose."""
    prompt = tuple(smollm2.tokenizer.encode_chat([{"role": "user", "content": "Name a prime number."}]))
    batch = Batch("mtbench", 1, 0, (BenchPrompt("mtbench/p", prompt),))
    out = EngineRunner(PLAIN, smollm2.model).run(batch, RunSpec(0.0, 3, ()), 0).outputs[0]
    assert len(out) == 3
    for i, token in enumerate(out):
        top = top_two(smollm2.model, [*prompt, *out[:i]])
        assert top.top1 == token and top.top2 != token and top.gap >= 0.0


def test_an_interrupted_bench_reports_the_runs_that_finished() -> None:
    target, workload = tiny()
    options = BenchOptions(
        suites=("humaneval",),
        backends=("eagle",),
        max_tokens=3,
        group_size=2,
        batch_sizes=(1, 2),
        singles=2,
        repeats=2,
        peer=False,
        weights="random",  # a tiny target: the shipped SmolLM2 drafters do not fit it
    )
    seen: list[RunRecord] = []

    def interrupt_after_five(record: RunRecord) -> None:
        seen.append(record)
        if len(seen) == 5:
            raise KeyboardInterrupt

    with contracts.enforce("off"):
        report = run_bench(target, [workload], (), options, on_run=interrupt_after_five)
    assert report["interrupted"] and len(report["runs"]) == 5
    assert report["contracts"] == {"status": "skipped", "reason": "interrupted"}
    assert "**Interrupted**" in render_markdown(report)
    eagle = [s for s in report["summaries"] if s["runner"] == "eagle"]
    assert eagle[0]["speedup"]["n"] == 2, "rounds 0 and 1 of the first prompt paired; the cut round pairs nothing"


def test_warm_up_leaves_every_adaptive_policy_past_its_calibration() -> None:
    """The timed runs must see each (batch size, temperature) policy in its steady state, as after a start-up."""
    from specdec.backend_registry import create
    from specdec.bench.driver import warm_up
    from specdec.draft_length import CALIBRATION

    target, workload = tiny()
    runner = EngineRunner(
        "dflash", target, lambda: create("dflash", target, num_spec_tokens=3), draft_length="adaptive"
    )
    options = BenchOptions(
        suites=("humaneval",), group_size=2, batch_sizes=(1, 2), temperatures=(0.0, 1.0), weights="random"
    )
    with contracts.enforce("off"):
        warm_up([workload], [runner], (), options)
    assert set(runner.policies) == {(1, 0.0), (1, 1.0), (2, 0.0), (2, 1.0)}
    assert all(p.decisions > len(CALIBRATION) for p in runner.policies.values())
    assert all(p.cost.fitted is not None for p in runner.policies.values())


def test_a_runs_decisions_are_the_policys_decisions_in_that_run() -> None:
    """Each decision the policy made during the run, one character each, none from before it."""
    from specdec.backend_registry import create
    from specdec.draft_length import CALIBRATION

    target, workload = tiny()
    runner = EngineRunner(
        "dflash", target, lambda: create("dflash", target, num_spec_tokens=3), draft_length="adaptive"
    )
    spec = RunSpec.equal_work(0.0, 12, (), 0)
    seen = []
    with contracts.enforce("off"):
        for repeat in range(3):
            before = runner.policies[(2, 0.0)].decisions if runner.policies else 0
            record = runner.run(workload.groups[0], spec, repeat)
            policy = runner.policies[(2, 0.0)]
            seen.append(record.decisions)
            assert len(record.decisions) == policy.decisions - before
            assert record.decisions[-1] == policy.last_decision
    trace = "".join(seen)  # the policy carries over from run to run: it calibrates once, at its start
    assert trace.startswith("c" * len(CALIBRATION)) and trace.count("c") == len(CALIBRATION)
