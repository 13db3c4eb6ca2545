"""Draft vocabularies: the sub-head scores exactly what the full head does, drafts stay inside it, output is lossless.

A drafter with a draft vocabulary scores only some rows of the target's LM head
(``-inf`` elsewhere). Its greedy output must equal plain decoding for every
backend even when the vocabulary leaves out tokens the target emits (the
verifier then recovers them), it must never draft a token outside the
vocabulary, and the file format must carry the vocabulary and refuse one that
does not fit the target. The sampled case is in ``test_lossless_sampling``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import contracts
from backends.draft_vocab import DraftVocab, coverage, most_frequent
from backends.pretrained import save_drafter
from specdec.backend_registry import create
from specdec.engine import Engine, EngineConfig
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.sampling import SamplingParams, probabilities
from specdec.scheduler import SchedulerConfig
from specdec.speculator import Speculator

VOCAB = 32
BACKENDS = ("eagle", "dflash", "dspark")


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    return Transformer(ModelConfig.tiny(vocab_size=VOCAB), seed=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_are_the_target_heads_on_the_vocabulary_and_minus_inf_elsewhere(dtype: torch.dtype) -> None:
    target = Transformer(ModelConfig.tiny(vocab_size=VOCAB), seed=1, dtype=dtype)
    ids = torch.tensor([0, 3, 4, 17, 31])
    vocab = DraftVocab(ids, VOCAB)
    hidden = torch.randn(5, target.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.inference_mode():
        got = vocab.logits(target, hidden)
        want = target.compute_logits(hidden)
    assert got.dtype == torch.float32 and got.shape == (5, VOCAB)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[:, ids], want[:, ids], atol=tol, rtol=tol)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert bool(torch.isneginf(got[:, outside]).all())


def test_the_sub_head_follows_a_changed_target_head() -> None:
    target = Transformer(ModelConfig.tiny(vocab_size=VOCAB), seed=1)
    vocab = DraftVocab(torch.tensor([1, 2]), VOCAB)
    hidden = torch.randn(1, target.config.hidden_size)
    before = vocab.logits(target, hidden)
    with torch.no_grad():
        target.lm_head_weight.mul_(2.0)
    torch.testing.assert_close(vocab.logits(target, hidden)[:, [1, 2]], 2 * before[:, [1, 2]])


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([], "at least one"),
        ([3, 1], "sorted and unique"),
        ([1, 1], "sorted and unique"),
        ([0, VOCAB], r"\[0, 32\)"),
        ([-1, 2], r"\[0, 32\)"),
    ],
)
def test_bad_vocabularies_are_refused(ids: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DraftVocab(torch.tensor(ids, dtype=torch.long), VOCAB)


def test_a_vocabulary_for_another_target_is_refused(tiny: Transformer) -> None:
    with pytest.raises(ValueError, match="vocabulary of 64"):
        DraftVocab(torch.tensor([1]), 64).logits(tiny, torch.zeros(1, tiny.config.hidden_size))


@settings(max_examples=60, deadline=None)
@given(
    labels=st.lists(st.integers(0, 15), min_size=1, max_size=200),
    size=st.integers(1, 20),
)
def test_most_frequent_keeps_the_commonest_labels(labels: list[int], size: int) -> None:
    t = torch.tensor(labels)
    ids = most_frequent(t, size, 16)
    counts = Counter(labels)
    assert ids.tolist() == sorted(set(ids.tolist()))
    assert len(ids) == min(size, len(counts))
    kept = set(ids.tolist())
    assert min(counts[i] for i in kept) >= max((c for i, c in counts.items() if i not in kept), default=0)
    assert coverage(ids, t, 16) == pytest.approx(sum(counts[i] for i in kept) / len(labels))


def decode(target: Transformer, speculator: Speculator | None, params: SamplingParams) -> tuple[list[list[int]], int]:
    config = EngineConfig(
        num_blocks=64, block_size=4, seed=5, scheduler=SchedulerConfig(max_num_seqs=3, max_model_len=64)
    )
    engine = Engine(target, config, speculator=speculator)
    for i, prompt in enumerate([[5, 9, 2, 30], [1, 2, 3], [7, 7, 7, 7, 7]]):
        engine.add_request(str(i), prompt, params=params, max_tokens=20, seed=i)
    with torch.inference_mode():
        out = engine.run()
    return [out[str(i)] for i in range(3)], engine.metrics.drafted


def drafts_seen(speculator: Speculator) -> list[int]:
    """Every token the speculator proposes from now on (wraps ``propose``)."""
    seen: list[int] = []
    propose = speculator.propose

    def recording(step, ctx):  # type: ignore[no-untyped-def]
        proposal = propose(step, ctx)
        for row, n in enumerate(proposal.num_drafts):
            seen.extend(int(t) for t in proposal.draft_token_ids[row, :n])
        return proposal

    speculator.propose = recording  # type: ignore[method-assign]
    return seen


@pytest.mark.slow  # six engine runs: not in the quick subset
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_stay_in_the_vocabulary_and_output_is_unchanged(
    backend: str, temperature: float, tiny: Transformer
) -> None:
    params = SamplingParams(temperature=temperature)
    plain, _ = decode(tiny, None, params)
    spec = create(backend, tiny, num_spec_tokens=3, seed=4)
    allowed = torch.tensor([0, 2, 5, 9, 11, 20, 30])
    spec.network.draft_vocab = DraftVocab(allowed, VOCAB)  # type: ignore[attr-defined]
    seen = drafts_seen(spec)
    with contracts.enforce("full"):  # VER-3 compares the proposal handed over with the one drafts came from
        got, drafted = decode(tiny, spec, params)
    assert drafted > 0 and seen
    assert set(seen) <= set(allowed.tolist())
    if temperature == 0.0:
        assert got == plain
    else:
        assert [len(o) for o in got] == [len(o) for o in plain]


@pytest.mark.parametrize("backend", BACKENDS)
def test_files_carry_the_vocabulary_and_full_vocab_turns_it_off(
    backend: str, tiny: Transformer, tmp_path: Path
) -> None:
    spec = create(backend, tiny, num_spec_tokens=3, seed=7)
    modules = {"head": spec.network} if backend == "eagle" else {"network": spec.network}  # type: ignore[attr-defined]
    network_meta: dict[str, object] = {"aux_layers": list(spec.aux_layers), "num_layers": 1}  # type: ignore[attr-defined]
    if backend == "dspark":
        modules["heads"] = spec.heads  # type: ignore[attr-defined]
        network_meta["rank"] = spec.heads.rank  # type: ignore[attr-defined]
    meta = {"backend": backend, "model": "tiny", "network": network_meta}
    path = tmp_path / f"{backend}.safetensors"
    save_drafter(path, modules, meta, dtype=torch.float32, draft_vocab=torch.tensor([1, 4, 8]))
    loaded = create(backend, tiny, num_spec_tokens=3, pretrained=path)
    vocab = loaded.network.draft_vocab  # type: ignore[attr-defined]
    assert vocab is not None and vocab.ids.tolist() == [1, 4, 8]
    assert create(backend, tiny, num_spec_tokens=3, pretrained=path, full_vocab=True).network.draft_vocab is None  # type: ignore[attr-defined]

    bad = tmp_path / f"{backend}-bad.safetensors"
    save_drafter(bad, modules, meta, dtype=torch.float32, draft_vocab=torch.tensor([1, VOCAB + 3]))
    with pytest.raises(ValueError, match=r"bad\.safetensors.*draft vocabulary ids must lie in"):
        create(backend, tiny, num_spec_tokens=3, pretrained=bad)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    size=st.integers(1, VOCAB),
    rows=st.integers(0, 4),
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    top_k=st.sampled_from([None, 1, 3, 40]),
    top_p=st.sampled_from([None, 0.6, 1.0]),
)
def test_dspark_markov_step_on_the_draft_ids_equals_the_full_width_step(
    tiny: Transformer, seed: int, size: int, rows: int, temperature: float, top_k: int | None, top_p: float | None
) -> None:
    """The bias, transform and draw run on the draft ids only: the same argmax (ties too) and the same proposal."""
    g = torch.Generator().manual_seed(seed)
    spec = create("dspark", tiny, num_spec_tokens=3, seed=4)
    ids = torch.randperm(VOCAB, generator=g)[:size].sort().values
    spec.network.draft_vocab = DraftVocab(ids, VOCAB)  # type: ignore[attr-defined]
    # Small integers: ties within a row are common, so the argmax's tie-break is exercised.
    backbone = torch.full((rows, VOCAB), float("-inf"))
    backbone[:, ids] = torch.randint(-2, 3, (rows, size), generator=g).float()
    prev = torch.randint(0, VOCAB, (rows,), generator=g)
    with torch.no_grad():
        spec.heads.w2.copy_(torch.randint(-1, 2, spec.heads.w2.shape, generator=g).float())  # type: ignore[attr-defined]
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * rows
    full = backbone + spec.heads.markov_bias(prev)  # type: ignore[attr-defined]
    with torch.inference_mode():
        drafts, probs = spec._markov_step(backbone, prev, params)  # type: ignore[attr-defined]
    assert set(drafts.tolist()) <= set(ids.tolist())
    if rows == 0:  # a rank whose block forward ran for its DP peers only: nothing drawn, an empty proposal
        assert drafts.shape == (0,) and (probs is None or probs.shape == (0, VOCAB))
    elif temperature == 0.0:
        assert probs is None
        assert drafts.tolist() == full.argmax(-1).tolist()
    else:
        assert probs is not None and probs.shape == (rows, VOCAB)
        torch.testing.assert_close(probs, probabilities(full, params), atol=1e-6, rtol=1e-5)
        assert bool((probs[torch.arange(rows), drafts] > 0).all())


def test_dspark_markov_step_follows_changed_heads(tiny: Transformer) -> None:
    """The bias's columns for the draft ids are cut once: a change to the heads' weights must cut them again."""
    spec = create("dspark", tiny, num_spec_tokens=3, seed=4)
    ids = torch.tensor([1, 5, 9])
    spec.network.draft_vocab = DraftVocab(ids, VOCAB)  # type: ignore[attr-defined]
    backbone = torch.full((1, VOCAB), float("-inf"))
    backbone[:, ids] = 0.0
    prev = torch.tensor([3])
    heads = spec.heads  # type: ignore[attr-defined]
    greedy = [SamplingParams(temperature=0.0)]
    for winner in (1, 9, 5):
        with torch.no_grad():
            heads.w2.zero_()
            heads.w2[winner] = heads.w1[3].sign()  # only the winner's column gets a positive bias
        drafts, _ = spec._markov_step(backbone, prev, greedy)  # type: ignore[attr-defined]
        assert drafts.tolist() == [winner]
