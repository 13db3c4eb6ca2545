"""The bench's workloads: fixed prompt suites, tokenized once, cut into batches of 1 and of 8.

Prompts come from ``specdec.corpora`` (the held-out ``bench`` split: HumanEval
prompts, MT-Bench first turns, Shakespeare passages to continue), always in the
suite's own order, so two runs of the bench time the same token ids. Prompts
longer than ``max_prompt_tokens`` are skipped (and counted) rather than cut: a
truncated chat prompt would lose its template.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from specdec.corpora import SUITES

__all__ = ["SUITES", "Batch", "BenchPrompt", "Workload", "build_workload", "corpus_prompts", "encode"]


@runtime_checkable
class PromptLike(Protocol):
    """What the bench reads of a ``specdec.corpora.Prompt``."""

    @property
    def id(self) -> str: ...
    @property
    def text(self) -> str: ...
    @property
    def chat(self) -> bool: ...


@runtime_checkable
class Encoder(Protocol):
    """What the bench needs of a tokenizer."""

    def encode(self, text: str) -> list[int]: ...
    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]: ...


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt as token ids, named by its corpus id (``humaneval/HumanEval_4``)."""

    id: str
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Batch:
    """Prompts run together in one engine; ``index`` orders the batches of a suite and size."""

    suite: str
    size: int
    index: int
    prompts: tuple[BenchPrompt, ...]

    @property
    def key(self) -> str:
        return f"{self.suite}/b{self.size}/{self.index}"


@dataclass(frozen=True)
class Workload:
    """A suite's batches: ``singles`` (batch 1, one prompt each) and ``groups`` (batch ``group_size``)."""

    suite: str
    singles: tuple[Batch, ...]
    groups: tuple[Batch, ...]
    skipped_long: int

    def batches(self, size: int) -> tuple[Batch, ...]:
        return self.singles if size == 1 else self.groups


def corpus_prompts(suite: str) -> Sequence[PromptLike]:
    """The ``bench`` split of ``suite`` from ``specdec.corpora`` (downloaded and verified on first use)."""
    from specdec.corpora import prompt_suite

    return prompt_suite(suite, split="bench")


def encode(tokenizer: Encoder, prompt: PromptLike) -> tuple[int, ...]:
    """Chat prompts get the model's chat template as one user message; raw text is continued as is."""
    if prompt.chat:
        return tuple(tokenizer.encode_chat([{"role": "user", "content": prompt.text}]))
    return tuple(tokenizer.encode(prompt.text))


def build_workload(
    suite: str,
    tokenizer: Encoder,
    *,
    singles: int,
    group_size: int = 8,
    groups: int = 1,
    max_prompt_tokens: int = 512,
    source: Callable[[str], Sequence[PromptLike]] = corpus_prompts,
) -> Workload:
    """The first ``singles`` prompts as batches of 1 and the first ``groups * group_size`` as batches of 8.

    The two sets overlap on purpose: the first prompts run both alone and in a
    batch, which shows whether batching changes greedy output (float reduction
    order) for the same prompt.
    """
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; known suites: {', '.join(SUITES)}")
    if singles < 0 or groups < 0 or group_size < 1 or max_prompt_tokens < 1:
        raise ValueError(
            f"need singles >= 0, groups >= 0, group_size >= 1, max_prompt_tokens >= 1; got {singles}, {groups}, "
            f"{group_size}, {max_prompt_tokens}"
        )
    wanted = max(singles, groups * group_size)
    chosen: list[BenchPrompt] = []
    skipped = 0
    for prompt in source(suite):
        if len(chosen) == wanted:
            break
        ids = encode(tokenizer, prompt)
        if not ids or len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        chosen.append(BenchPrompt(prompt.id, ids))
    if len(chosen) < wanted:
        raise ValueError(
            f"suite {suite!r} has only {len(chosen)} prompts of at most {max_prompt_tokens} tokens "
            f"({skipped} longer ones skipped); {wanted} are needed"
        )
    one = tuple(Batch(suite, 1, i, (p,)) for i, p in enumerate(chosen[:singles]))
    many = tuple(
        Batch(suite, group_size, g, tuple(chosen[g * group_size : (g + 1) * group_size])) for g in range(groups)
    )
    return Workload(suite, one, many, skipped)
