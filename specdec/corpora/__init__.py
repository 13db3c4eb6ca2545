"""Offline corpora: fixed prompt suites for benchmarks and disjoint texts for drafter training.

See ``docs/benchmarks.md`` (suites) and ``docs/drafters.md`` (training data).
"""

from specdec.corpora.sources import CORPORA, CorpusWheel, corpus_dir
from specdec.corpora.suites import (
    SUITES,
    Prompt,
    Split,
    code_explanation_prompts,
    code_instruction_prompts,
    prompt_suite,
    training_texts,
)

__all__ = [
    "CORPORA",
    "SUITES",
    "CorpusWheel",
    "Prompt",
    "Split",
    "code_explanation_prompts",
    "code_instruction_prompts",
    "corpus_dir",
    "prompt_suite",
    "training_texts",
]
