"""Acceptance length of a drafter on held-out prompts: the figure a model card reports."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from specdec.backend_registry import create
from specdec.engine import Engine, EngineConfig
from specdec.nn.transformer import Transformer
from specdec.scheduler import SchedulerConfig


@torch.no_grad()
def measure_tau(
    target: Transformer,
    prompts: Sequence[Sequence[int]],
    backend: str,
    *,
    pretrained: str | Path | None,
    k: int = 4,
    max_tokens: int = 64,
    stop_token_ids: Sequence[int] = (),
    full_vocab: bool = False,
) -> float:
    """Greedy speculative decoding of all prompts in one batch; the engine's tau (tokens per verify step).

    ``pretrained=None`` builds the backend's freshly seeded (random) drafter;
    ``full_vocab`` scores drafts over the whole LM head instead of the file's draft vocabulary.
    """
    if not prompts:
        raise ValueError("no prompts to measure on")
    options = {"full_vocab": True} if full_vocab else {}
    spec = create(backend, target, num_spec_tokens=k, pretrained=pretrained, **options)
    block = 16
    longest = max(len(p) for p in prompts) + max_tokens + k + 1
    per_req = -(-longest // block) + 1
    config = EngineConfig(
        num_blocks=len(prompts) * per_req + 1,
        block_size=block,
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max(2048, longest), max_num_seqs=len(prompts), max_model_len=longest
        ),
    )
    engine = Engine(target, config, speculator=spec)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), list(prompt), max_tokens=max_tokens, stop_token_ids=stop_token_ids)
    engine.run()
    return float(engine.metrics.acceptance_length)
