"""Running the bench's batches: plain decoding and each backend on the same prompts, interleaved.

Every run is one fresh engine holding one batch (1 or 8 requests) that runs
to completion; its wall time covers the engine steps only (prefill included,
building the engine and the drafter excluded). Runs of the same batch
alternate their order between repetitions, so a slow stretch of a shared
machine hits plain decoding and the backends alike, and a speedup is a ratio
within one such interleaved round, never across rounds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from specdec.bench.suites import Batch
from specdec.draft_length import DraftLengthPolicy
from specdec.engine import Engine, EngineConfig
from specdec.metrics import SpeculationCounters
from specdec.nn.transformer import Transformer
from specdec.sampling import SamplingParams
from specdec.scheduler import SchedulerConfig
from specdec.speculator import Speculator

PLAIN = "plain"


@dataclass(frozen=True)
class RunSpec:
    """How every request of a run decodes: the same for plain decoding and each backend."""

    temperature: float
    max_tokens: int
    stop_token_ids: tuple[int, ...]
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def equal_work(cls, temperature: float, max_tokens: int, stop_token_ids: tuple[int, ...], seed: int) -> RunSpec:
        """A timed run's spec: sampled runs decode all ``max_tokens``, greedy ones stop as ``specdec generate`` does.

        Greedy outputs are the same for every runner (losslessness), stops
        included. Sampled ones follow each runner's own random draws, so a
        request may stop early under one runner and not another; in a batch
        with nobody waiting, its slot then stays empty for the rest of the run:
        fewer tokens in as many steps. A bench run at batch 8 and T = 1 had
        DSpark emit 995-997 tokens where plain decoding emitted 1,012-1,018,
        each in 64 steps a batch, which read as 0.96x plain though its steps
        cost the same. Without stop tokens every runner does the same work.
        """
        return cls(temperature, max_tokens, stop_token_ids if temperature == 0.0 else (), seed)


@dataclass
class RunRecord:
    """One run of one batch by one runner: outputs (cut at the stop token), wall time and speculation totals."""

    runner: str
    suite: str
    batch_size: int
    batch_key: str
    temperature: float
    repeat: int
    prompt_ids: list[str]
    outputs: list[list[int]]
    wall_s: float
    steps: int = 0
    speculation: SpeculationCounters = field(default_factory=SpeculationCounters)
    decisions: str = ""
    """The adaptive draft-length policy's decisions in this run, one character each (``specdec.draft_decisions``);
    empty without a policy (plain decoding, fixed draft length, the peer)."""

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def round_key(self) -> tuple[str, float, int]:
        """Runs with the same key ran back to back on the same prompts: their ratios are the speedup samples."""
        return (self.batch_key, self.temperature, self.repeat)

    def as_dict(self) -> dict[str, Any]:
        return {
            "runner": self.runner,
            "suite": self.suite,
            "batch_size": self.batch_size,
            "batch": self.batch_key,
            "temperature": self.temperature,
            "repeat": self.repeat,
            "prompts": self.prompt_ids,
            "tokens": self.tokens,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
            "steps": self.steps,
            **self.speculation.counts(),
            "decisions": self.decisions,
            "outputs": self.outputs,
        }


@runtime_checkable
class Runner(Protocol):
    """Something that decodes a batch: the engine (plain or with a drafter) or the transformers peer."""

    name: str

    def supports(self, batch_size: int, spec: RunSpec) -> bool: ...

    def run(self, batch: Batch, spec: RunSpec, repeat: int) -> RunRecord: ...


def batch_engine(
    target: Transformer,
    prompt_lens: Sequence[int],
    max_tokens: int,
    speculator: Speculator | None,
    seed: int,
    draft_policy: DraftLengthPolicy | None = None,
) -> Engine:
    """An engine with KV room for every request of the batch at once (no preemption) and a one-step prefill."""
    block_size = 16
    limit = target.config.max_model_len
    too_long = [n for n in prompt_lens if n >= limit]
    if too_long:
        raise ValueError(f"prompts of {too_long} tokens do not fit the model's context of {limit}")
    headroom = (speculator.num_spec_tokens if speculator is not None else 0) + 1
    blocks = sum(-(-min(n + max_tokens + headroom, limit) // block_size) + 1 for n in prompt_lens)
    budget = max(2048, sum(prompt_lens) + len(prompt_lens) * headroom)
    scheduler = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=len(prompt_lens), max_model_len=limit)
    adaptive = draft_policy is not None and speculator is not None
    config = EngineConfig(
        num_blocks=blocks + 1,
        block_size=block_size,
        seed=seed,
        scheduler=scheduler,
        draft_length="adaptive" if adaptive else "fixed",
    )
    return Engine(target, config, speculator=speculator, draft_policy=draft_policy if adaptive else None)


class EngineRunner:
    """The project's engine; ``make_speculator`` builds a fresh drafter per run (``None``: plain decoding)."""

    def __init__(
        self,
        name: str,
        target: Transformer,
        make_speculator: Callable[[], Speculator | None] = lambda: None,
        *,
        draft_length: str = "fixed",
    ) -> None:
        self.name = name
        self.target = target
        self.make_speculator = make_speculator
        self.draft_length = draft_length
        self.policies: dict[tuple[int, float], DraftLengthPolicy] = {}
        """``adaptive``: one policy per (batch size, temperature), kept across this runner's runs as a server
        keeps it across requests; each run's fresh engine continues it."""

    def supports(self, batch_size: int, spec: RunSpec) -> bool:
        del batch_size, spec
        return True

    def run(self, batch: Batch, spec: RunSpec, repeat: int) -> RunRecord:
        speculator = self.make_speculator()
        policy = None
        if self.draft_length == "adaptive" and speculator is not None:
            key = (len(batch.prompts), spec.temperature)
            policy = self.policies.setdefault(key, DraftLengthPolicy(speculator.num_spec_tokens))
        engine = batch_engine(
            self.target, [len(p.ids) for p in batch.prompts], spec.max_tokens, speculator, spec.seed, policy
        )
        params = SamplingParams(temperature=spec.temperature)
        requests = [
            engine.add_request(
                str(i),
                prompt.ids,
                params=params,
                max_tokens=spec.max_tokens,
                stop_token_ids=spec.stop_token_ids,
                seed=spec.seed + i,
            )
            for i, prompt in enumerate(batch.prompts)
        ]
        with torch.inference_mode():
            start = time.perf_counter()
            while engine.has_work:
                engine.step()
            wall = time.perf_counter() - start
        m = engine.metrics
        return RunRecord(
            runner=self.name,
            suite=batch.suite,
            batch_size=batch.size,
            batch_key=batch.key,
            temperature=spec.temperature,
            repeat=repeat,
            prompt_ids=[p.id for p in batch.prompts],
            outputs=[list(r.output) for r in requests],
            wall_s=wall,
            steps=m.steps,
            speculation=m.snapshot(),
            decisions=m.decisions,
        )


def round_order(runners: Sequence[Runner], batch_index: int, repeat: int) -> list[Runner]:
    """Plain first in even rounds, last in odd ones (rounds counted over batches and repeats)."""
    return list(runners) if (batch_index + repeat) % 2 == 0 else list(runners)[::-1]


def interleave(
    batches: Iterable[Batch],
    runners: Sequence[Runner],
    spec: RunSpec,
    *,
    repeats: int,
    on_run: Callable[[RunRecord], None] = lambda _: None,
) -> list[RunRecord]:
    """Every supporting runner on every batch, ``repeats`` rounds per batch, order alternating by round."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    records: list[RunRecord] = []
    for batch in batches:
        active = [r for r in runners if r.supports(batch.size, spec)]
        for repeat in range(repeats):
            for runner in round_order(active, batch.index, repeat):
                record = runner.run(batch, spec, repeat)
                records.append(record)
                on_run(record)
    return records


def pair_ratios(records: Iterable[RunRecord], baseline: str = PLAIN) -> dict[str, list[float]]:
    """Per runner, tokens/s over the baseline's tokens/s in the same round (one sample per round).

    With greedy decoding both sides emit the same tokens, so this equals
    baseline wall / runner wall; with sampling the outputs differ in length and
    the rate is the fair comparison.
    """
    by_round: dict[tuple[str, float, int], dict[str, RunRecord]] = {}
    for r in records:
        by_round.setdefault(r.round_key, {})[r.runner] = r
    ratios: dict[str, list[float]] = {}
    for runs in by_round.values():
        base = runs.get(baseline)
        if base is None or base.tokens_per_s <= 0:
            continue
        for name, r in runs.items():
            if name != baseline:
                ratios.setdefault(name, []).append(r.tokens_per_s / base.tokens_per_s)
    return ratios
