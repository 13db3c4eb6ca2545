"""Lossless sampling through the whole engine: a fixed-seed chi-square goodness-of-fit test.

On a 6-token vocabulary, the first three tokens emitted for a fixed prompt under
speculative decoding (K=2, so the second and third tokens come out of rejection
sampling: an accepted draft, a recovered token or the bonus) are compared with
the target's exact joint distribution, computed from the dense model. Cells
with an expected count below 5 are pooled. Significance level alpha = 0.001,
fixed seeds; a deliberately biased engine (drafts always accepted) must fail
the same test, so the test has power.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from scipy.stats import chisquare
from tests_support import perturbed_copy

from backends.autoregressive import AutoregressiveSpeculator, ModelDrafter
from backends.draft_vocab import DraftVocab
from backends.lookup_first import LookupFirst
from specdec.backend_registry import create
from specdec.engine import Engine, EngineConfig
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.sampling import SamplingParams, probabilities
from specdec.scheduler import SchedulerConfig
from specdec.speculator import Speculator

ALPHA = 1e-3
VOCAB = 6
PROMPT = [1, 4, 2]
N = 1600
TARGET = Transformer(ModelConfig.tiny(vocab_size=VOCAB), seed=11)


def exact_joint(params: SamplingParams, length: int = 3) -> dict[tuple[int, ...], float]:
    """P(t1..t_length | prompt) from the dense target, with the sampling transform applied per position."""
    joint: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(VOCAB), repeat=length):
        tokens = torch.tensor(PROMPT + list(seq[:-1]))
        logits = TARGET.compute_logits(TARGET.forward_dense(tokens).hidden_states[len(PROMPT) - 1 :])
        p = probabilities(logits, params)
        joint[seq] = float(torch.prod(p[torch.arange(length), torch.tensor(seq)]))
    return joint


def sample_engine(
    speculator: Callable[[], Speculator | None], params: SamplingParams, seed: int
) -> Counter[tuple[int, ...]]:
    engine = Engine(
        TARGET,
        EngineConfig(
            num_blocks=N * 2 + 64,
            block_size=4,
            seed=seed,
            scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=N, max_model_len=16),
        ),
        speculator=speculator(),
    )
    for i in range(N):
        engine.add_request(f"s{i}", PROMPT, params=params, max_tokens=3)
    outputs = engine.run()
    return Counter(tuple(o[:3]) for o in outputs.values())


def p_value(counts: Counter[tuple[int, ...]], joint: dict[tuple[int, ...], float]) -> float:
    observed, expected, pooled_o, pooled_e = [], [], 0, 0.0
    for cell, prob in joint.items():
        if prob * N >= 5:
            observed.append(counts[cell])
            expected.append(prob * N)
        else:
            pooled_o += counts[cell]
            pooled_e += prob * N
    observed.append(pooled_o)
    expected.append(pooled_e)
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def probabilistic() -> AutoregressiveSpeculator:
    return AutoregressiveSpeculator(ModelDrafter(perturbed_copy(TARGET, 0.5, 5)), num_spec_tokens=2, seed=3)


def argmax_drafts() -> AutoregressiveSpeculator:
    return AutoregressiveSpeculator(
        ModelDrafter(perturbed_copy(TARGET, 0.5, 5)), num_spec_tokens=2, seed=3, argmax_drafts=True
    )


def eagle_with_draft_vocabulary() -> AutoregressiveSpeculator:
    """Drafts only ever among tokens 0, 2 and 3: the verifier must recover 1, 4 and 5 at their target rates."""
    spec = create("eagle", TARGET, num_spec_tokens=2, seed=3)
    assert isinstance(spec, AutoregressiveSpeculator)
    spec.network.draft_vocab = DraftVocab(torch.tensor([0, 2, 3]), VOCAB)  # type: ignore[union-attr]
    return spec


def lookup_first() -> LookupFirst:
    """One-token matches: after the prompt 1 4 2, any 1, 4 or 2 is looked up, any other token drafted by the model,
    so a batch's proposals mix one-hot lookup rows into the model's distributions."""
    return LookupFirst(probabilistic(), min_match=1)


def lookup_past_k() -> LookupFirst:
    """As ``lookup_first``, with a match drafting up to 4 where the model drafts 2: its proposals are widened."""
    return LookupFirst(probabilistic(), min_match=1, lookup_drafts=4)


CASES = {
    "probabilistic drafts, temperature 1": (probabilistic, SamplingParams(temperature=1.0)),
    "argmax drafts, temperature 1": (argmax_drafts, SamplingParams(temperature=1.0)),
    "draft vocabulary of 3 of 6 tokens, temperature 1": (eagle_with_draft_vocabulary, SamplingParams(temperature=1.0)),
    "prompt lookup first, then probabilistic drafts, temperature 1": (lookup_first, SamplingParams(temperature=1.0)),
    "prompt lookup drafting past the model's K, temperature 1": (lookup_past_k, SamplingParams(temperature=1.0)),
    "probabilistic drafts, t=0.8 top-k 4 top-p 0.9": (
        probabilistic,
        SamplingParams(temperature=0.8, top_k=4, top_p=0.9),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_first_three_tokens_follow_the_target_distribution(case: str) -> None:
    make, params = CASES[case]
    counts = sample_engine(make, params, seed=1234)
    assert sum(counts.values()) == N
    assert p_value(counts, exact_joint(params)) > ALPHA


def test_plain_sampling_passes_and_a_biased_verifier_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(temperature=1.0)
    joint = exact_joint(params)
    assert p_value(sample_engine(lambda: None, params, seed=99), joint) > ALPHA

    import specdec.verifier as verifier

    real = verifier._verify_sampled

    def always_accept(*args, **kwargs):  # type: ignore[no-untyped-def]
        _, recovered, recovery = real(*args, **kwargs)
        valid = args[2]
        return valid.long().sum(dim=1), recovered, recovery

    monkeypatch.setattr(verifier, "_verify_sampled", always_accept)
    assert p_value(sample_engine(probabilistic, params, seed=1234), joint) < ALPHA
