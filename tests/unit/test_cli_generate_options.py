"""``specdec generate``'s --json, --prompts-file (file and stdin), --stop and -O, on the random tiny target.

--stop matches text, so its tests drive ``LLM.stream`` (what ``generate
--model`` runs) over the tiny target with a one-letter-per-token tokenizer;
the real model's run is in tests/real_model/test_generate_real.py.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from specdec.backend_registry import create, register, unregister
from specdec.cli.backend_options import typed_value
from specdec.cli.main import main
from specdec.hub.tokenizer import Tokenizer
from specdec.llm import LLM
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.sampling import SamplingParams

TINY = ["--layers", "1", "--hidden", "32", "--max-tokens", "6"]


def json_lines(out: str) -> list[dict[str, Any]]:
    """Every stdout line parsed as JSON: --json prints nothing else."""
    return [json.loads(line) for line in out.splitlines()]


def test_json_is_one_object_per_request_and_nothing_else(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "-b", "draft-model", "--draft-is-target", "-k", "3", "--json", "--compare-plain", *TINY]
    assert main(argv) == 0
    records = json_lines(capsys.readouterr().out)
    assert [r["request_id"] for r in records] == ["req-0", "req-1", "req-2", "req-3"]
    for r in records:
        assert len(r["token_ids"]) == 6 and r["text"] == " ".join(map(str, r["token_ids"]))
        assert r["finish_reason"] == "length" and r["backend"] == "draft-model"
        m = r["metrics"]
        assert m["drafted"] == m["accepted"] > 0 and m["acceptance_by_position"] == [1.0, 1.0, 1.0]
        assert m["tau"] > 1.0 and r["plain"] == {"same_tokens": True}  # the target drafting for itself


def test_adaptive_json_carries_the_batchs_decisions_and_the_summary_counts_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["generate", "-b", "draft-model", "--draft-is-target", "-k", "3", *TINY]
    argv = [*base, "--draft-length", "adaptive"]
    assert main([*argv, "--json"]) == 0
    records = json_lines(capsys.readouterr().out)
    # One decision per step that had a request to draft for: after the prefill and each verify but the last.
    trace = records[0]["metrics"]["batch_decisions"]
    assert all(r["metrics"]["batch_decisions"] == trace for r in records)
    assert trace.startswith("c") and len(trace) == records[0]["metrics"]["verify_steps"] >= 2
    assert main(argv) == 0
    summary = capsys.readouterr().out.splitlines()[-2]
    assert summary.startswith("draft-model") and summary.endswith(f"decisions: {len(trace)} calibrating")
    assert main([*base, "--json"]) == 0  # fixed, the default
    assert all(r["metrics"]["batch_decisions"] is None for r in json_lines(capsys.readouterr().out))


def test_prompts_file_lines_are_the_requests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = tmp_path / "prompts.txt"
    plain.write_text("1 2 3\n7 8\n", encoding="utf-8")
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "1 2 3"}\n  {"prompt": "7 8"}\n', encoding="utf-8")
    runs = []
    for path in (plain, jsonl):
        assert main(["generate", "--backend", "plain", "--json", "--prompts-file", str(path), *TINY]) == 0
        runs.append(json_lines(capsys.readouterr().out))
    assert [r["prompt_token_ids"] for r in runs[0]] == [[1, 2, 3], [7, 8]]
    same = [[(r["prompt_token_ids"], r["token_ids"]) for r in run] for run in runs]
    assert same[0] == same[1]  # a JSON line holds the same prompt as a plain line
    assert "plain" not in runs[0][0]  # no comparison asked for


def test_prompts_file_from_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO('{"prompt": "4 5 6"}\n'))  # JSON, told by its first character
    assert main(["generate", "--backend", "eagle", "--prompts-file", "-", *TINY]) == 0
    out = capsys.readouterr().out
    assert out.startswith("req-0: ") and "req-1" not in out and "eagle" in out


@pytest.mark.parametrize(
    ("content", "name", "expected"),
    [
        ("1 2\n\n3 4\n", "p.txt", "line 2: empty"),
        ('{"prompt": "1 2"}\n{"prompt": 3}\n', "p.txt", 'line 2: "prompt" must be non-empty text'),
        ("1 2\n", "p.jsonl", "line 1: not JSON"),
        ('{"text": "1 2"}\n', "p.txt", 'line 1: expected {"prompt": "..."} or {"messages"'),
        ('{"messages": [{"role": "robot", "content": "x"}]}\n', "p.txt", '"messages" must be a non-empty list'),
        ('{"messages": [{"role": "user", "content": "1"}]}\n', "p.txt", "line 1: the random tiny target takes token"),
        ("1 2\nthree\n", "p.txt", "line 2: without --model the prompt is token ids"),
        ("", "p.txt", "holds no prompt"),
    ],
)
def test_a_bad_prompts_file_names_the_line(
    content: str, name: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    assert main(["generate", "--prompts-file", str(path), *TINY]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error: --prompts-file") and expected in err, err


@pytest.fixture
def recording_backend() -> Iterator[list[dict[str, Any]]]:
    """A backend whose factory takes two options of its own and records what it was given."""
    seen: list[dict[str, Any]] = []

    def factory(target: Transformer, *, num_spec_tokens: int = 4, capacity: str = "full", tau: float = 0.5) -> Any:
        seen.append({"num_spec_tokens": num_spec_tokens, "capacity": capacity, "tau": tau})
        return create("eagle", target, num_spec_tokens=num_spec_tokens)

    register("recording", factory)
    yield seen
    unregister("recording")


def test_backend_options_reach_the_factory_typed(
    recording_backend: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "-b", "recording", "-k", "2", "-O", "capacity=threshold", "-O", "tau=0.25", *TINY]
    assert main(argv) == 0
    assert recording_backend == [{"num_spec_tokens": 2, "capacity": "threshold", "tau": 0.25}]
    assert main(["generate", "-b", "recording", "-O", "rank=8", *TINY]) == 2
    assert "-O rank: not an option of backend 'recording'; its options: capacity, tau" in capsys.readouterr().err


def test_a_value_the_factory_refuses_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "-b", "dspark", "-O", "capacity=8", *TINY]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error: the backend refused its options (capacity=8): ")
    assert len(err.strip().splitlines()) == 1 and "capacity" in err.split("): ", 1)[1]


@pytest.mark.parametrize(
    ("raw", "value"),
    [("true", True), ("False", False), ("8", 8), ("-3", -3), ("0.25", 0.25), ("1e-3", 0.001), ("full", "full")],
)
def test_option_values_are_read_as_what_they_look_like(raw: str, value: object) -> None:
    assert typed_value(raw) == value and type(typed_value(raw)) is type(value)


# -- --stop, through LLM.stream --------------------------------------------------------------------------------


class LetterTokenizer(Tokenizer):
    """Token t is the letter ``a + t % 26``: text whose every prefix is a whole number of tokens."""

    def __init__(self) -> None:
        self.stop_token_ids = ()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


@pytest.fixture(scope="module")
def letters() -> LLM:
    target = Transformer(ModelConfig.tiny(num_layers=1, hidden_size=32, intermediate_size=64, head_dim=8), seed=3)
    config = {"method": "draft_model", "num_speculative_tokens": 3, "draft": target}
    return LLM.from_model(target, LetterTokenizer(), speculative_config=config, max_num_seqs=1)


def test_stream_stops_before_the_stop_string_and_never_shows_part_of_it(letters: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12)
    full = letters.stream("abc", params).output.outputs[0]
    assert len(full.text) == 12 and full.finish_reason == "length"
    stop = full.text[3:7]  # spans two verify steps (1 + 4 + 4 ... tokens): its start arrives before its end
    at = full.text.find(stop)
    pieces: list[str] = []
    streamed = letters.stream("abc", params.model_copy(update={"stop": (stop,)}), on_text=pieces.append)
    out = streamed.output.outputs[0]
    assert out.text == full.text[:at] == "".join(pieces) and streamed.chunks == len(pieces)
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) >= at + len(stop)
    batch = letters.generate([[0, 1, 2]], params.model_copy(update={"stop": (stop,)}))[0].outputs[0]
    assert (batch.text, batch.stop_reason) == (out.text, stop)  # the streamed and the batch call agree


def test_stream_without_stop_writes_every_step(letters: LLM) -> None:
    pieces: list[str] = []
    streamed = letters.stream([0, 1, 2], SamplingParams(temperature=0.0, max_tokens=10), on_text=pieces.append)
    assert "".join(pieces) == streamed.output.outputs[0].text and len(pieces) == streamed.chunks >= 3
    assert streamed.run_metrics.accepted == streamed.run_metrics.drafted > 0


def test_an_adaptive_llm_keeps_one_policy_across_calls(letters: LLM) -> None:
    target, tokenizer = letters.model, letters.tokenizer
    config = {"method": "draft_model", "num_speculative_tokens": 3, "draft": target}
    llm = LLM.from_model(target, tokenizer, speculative_config=config, max_num_seqs=1, draft_length="adaptive")
    params = SamplingParams(temperature=0.0, max_tokens=40)
    first = llm.stream("abc", params)
    second = llm.stream("abc", params)
    assert (
        first.output.outputs[0].text
        == second.output.outputs[0].text
        == letters.stream("abc", params).output.outputs[0].text
    )
    # The first call calibrates the step cost; the second goes on from what it measured, as a server would.
    assert first.run_metrics.decisions.startswith("c" * 8) and "c" not in second.run_metrics.decisions
    assert llm.draft_policy is not None and llm.draft_policy.decisions == len(first.run_metrics.decisions) + len(
        second.run_metrics.decisions
    )
    assert letters.draft_policy is None and letters.stream("abc", params).run_metrics.decisions == ""


def test_llm_draft_length_mistakes_are_named(letters: LLM) -> None:
    target, tokenizer = letters.model, letters.tokenizer
    with pytest.raises(ValueError, match="draft_length must be one of 'fixed', 'adaptive', got 'sometimes'"):
        LLM.from_model(target, tokenizer, speculative_config={"method": "dflash"}, draft_length="sometimes")
    with pytest.raises(ValueError, match="it needs a speculative_config"):
        LLM.from_model(target, tokenizer, draft_length="adaptive")


def test_bench_gives_each_backend_the_options_it_takes_and_renders_them_back() -> None:
    import argparse

    from specdec.bench.options import add_arguments, options_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["-b", "eagle,dspark", "-O", "capacity=threshold", "-O", "tau=0.25", "-O", "full_vocab=true"]
    options = options_from_args(parser.parse_args(argv))
    assert options.options_for("dspark") == {"capacity": "threshold", "tau": 0.25, "full_vocab": True}
    assert options.options_for("eagle") == {"full_vocab": True}
    assert "-O capacity=threshold -O tau=0.25 -O full_vocab=true" in options.command()
    assert options_from_args(parser.parse_args(options.command().split()[2:])) == options


def test_bench_runs_build_each_drafter_with_its_options(recording_backend: list[dict[str, Any]]) -> None:
    import contracts
    from specdec.bench.driver import run_bench
    from specdec.bench.options import BenchOptions
    from specdec.bench.suites import Batch, BenchPrompt, Workload

    target = Transformer(ModelConfig.tiny(num_layers=1, hidden_size=32, intermediate_size=64, head_dim=8), seed=0)
    prompt = BenchPrompt("humaneval/p0", (3, 4, 5, 6))
    workload = Workload("humaneval", (Batch("humaneval", 1, 0, (prompt,)),), (), 0)
    options = BenchOptions(
        suites=("humaneval",),
        backends=("recording",),
        backend_options=(("capacity", "threshold"), ("tau", 0.25)),
        max_tokens=3,
        singles=1,
        batch_sizes=(1,),
        temperatures=(0.0,),
        repeats=1,
        weights="random",
        contract_prompts=0,
        peer=False,
    )
    with contracts.enforce("off"):
        run_bench(target, [workload], (), options)
    assert recording_backend and all(
        seen["capacity"] == "threshold" and seen["tau"] == 0.25 for seen in recording_backend
    )
