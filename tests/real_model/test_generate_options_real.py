"""``specdec generate --model`` with --json, --stop and --prompts-file on the cached SmolLM2 (slow: a real model).

The prompts are ones the model answers in a handful of tokens ("Repeat
exactly: ..."), so the file takes seconds; it is skipped when the model is not
pulled (a failure under CI).
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from real_models import SMOLLM2, PulledModel, smollm2  # noqa: F401  (fixture)

from specdec.cli.main import main
from specdec.llm import LLM
from specdec.sampling import SamplingParams

PROMPT = "Repeat exactly: the cat sat on the mat. the cat sat on the mat."


def test_json_stop_and_a_jsonl_prompts_file_from_stdin(
    smollm2: PulledModel,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    lines = [json.dumps({"prompt": PROMPT}), json.dumps({"messages": [{"role": "user", "content": PROMPT}]})]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    argv = ["generate", "--model", SMOLLM2, "-b", "eagle", "--max-tokens", "24", "--json", "--stop", " on the"]
    assert main([*argv, "--prompts-file", "-"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]  # stdout holds JSON only
    assert len(records) == 2 and records[0]["prompt"] == PROMPT and records[1]["prompt"][0]["role"] == "user"
    # The text prompt goes through the chat template by default, so both lines ask the same thing.
    assert records[0]["token_ids"] == records[1]["token_ids"]
    for r in records:
        assert r["text"].lower().rstrip() == "the cat sat"  # stopped before " on the"
        assert (r["finish_reason"], r["stop_reason"]) == ("stop", " on the")
        m = r["metrics"]
        assert m["tokens"] == len(r["token_ids"]) and m["drafted"] >= m["accepted"] >= 0
        assert len(m["acceptance_by_position"]) == 4 and (m["tau"] is None or m["tau"] >= 1.0)


def test_the_cli_text_is_llm_generate_text(
    smollm2: PulledModel,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPT}\n", encoding="utf-8")
    argv = ["generate", "--model", SMOLLM2, "-b", "plain", "--no-chat", "--max-tokens", "12", "--stop", "mat"]
    assert main([*argv, "--prompts-file", str(prompts)]) == 0
    body, summary = capsys.readouterr().out[:-1].rsplit("\n", 1)
    llm = LLM.from_model(smollm2.model, smollm2.tokenizer)
    expected = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, stop=["mat"]))[0].outputs[0]
    assert body == expected.text
    assert summary.startswith("plain:  tokens ") and summary.endswith(
        "finish stop_string 'mat'" if expected.stop_reason == "mat" else "finish max_tokens"
    )


def test_adaptive_draft_length_keeps_the_text_and_learns_across_prompts(
    smollm2: PulledModel,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Write a Python function that reverses a string.\n" * 2, encoding="utf-8")
    argv = ["generate", "--model", SMOLLM2, "-b", "dflash", "--max-tokens", "40", "--prompts-file", str(prompts)]
    assert main([*argv, "--json"]) == 0
    fixed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main([*argv, "--json", "--draft-length", "adaptive"]) == 0
    adaptive = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["token_ids"] for r in adaptive] == [r["token_ids"] for r in fixed]  # greedy: the same text either way
    assert [r["metrics"]["decisions"] for r in fixed] == [None, None]
    first, second = (r["metrics"]["decisions"] for r in adaptive)
    # One policy for the whole command: the first answer calibrates the step cost, the second goes on from it.
    assert first.startswith("c" * 8) and second and "c" not in second
    assert main([*argv[:-2], "--draft-length", "adaptive", "Write a Python function that reverses a string."]) == 0
    summary = capsys.readouterr().out.splitlines()[-1]
    assert re.search(r"  decisions: \d+ [a-z]+(, \d+ [a-z]+)*$", summary), summary
    assert "8 calibrating" in summary
