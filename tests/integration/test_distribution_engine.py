"""Wrong proposals and non-finite logits through the whole engine: caught in ``full``, never a silent token.

- A drafter that halves the proposal it reports (its drafts still come from the
  right distribution) ran to completion in ``full`` before VER-6; now it is a
  ContractViolation naming VER-6.
- Target logits that are NaN used to emit token 0 under greedy decoding: now
  VER-5 in ``full``, and in every other mode an error naming the request.
- A NaN in a drafter's weights under sampling: an error that names the rows and
  the fault, not torch's "probability tensor contains either inf, nan or element < 0".
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import contracts
from backends.autoregressive import AutoregressiveSpeculator
from contracts import ContractViolation
from specdec.backend_registry import create
from specdec.engine import Engine, EngineConfig
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.sampling import InvalidDistributionError, SamplingParams
from specdec.scheduler import SchedulerConfig
from specdec.speculator import Proposal
from specdec.verifier import NonFiniteLogitsError

TARGET = Transformer(ModelConfig.tiny(vocab_size=32), seed=5)
SAMPLED = SamplingParams(temperature=1.0, top_k=6)
GREEDY = SamplingParams(temperature=0.0)


def _engine(speculator: AutoregressiveSpeculator | None, target: Transformer = TARGET) -> Engine:
    config = EngineConfig(
        num_blocks=64,
        block_size=4,
        seed=3,
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=32),
    )
    return Engine(target, config, speculator=speculator)


def _run(engine: Engine, params: SamplingParams, n: int = 2) -> dict[str, list[int]]:
    for i in range(n):
        engine.add_request(f"req-{i}", [1 + i, 7, 3, 9], params=params, max_tokens=6)
    return engine.run(max_steps=200)


def _halving(spec: AutoregressiveSpeculator) -> AutoregressiveSpeculator:
    """The drafter reports half of the distribution it drew from, as both draft_probs and sampled_from."""
    propose = spec.propose

    def halved(step: Any, ctx: Any) -> Proposal:
        proposal = propose(step, ctx)
        if proposal.draft_probs is None:
            return proposal
        half = proposal.draft_probs / 2
        return Proposal(proposal.draft_token_ids, proposal.num_drafts, half, half, proposal.evidence)

    spec.propose = halved  # type: ignore[method-assign]
    return spec


def _eagle(**options: Any) -> AutoregressiveSpeculator:
    spec = create("eagle", TARGET, num_spec_tokens=3, seed=4, **options)
    assert isinstance(spec, AutoregressiveSpeculator)
    return spec


def test_a_drafter_that_halves_its_proposal_is_caught_in_full() -> None:
    with contracts.enforce("full"):
        assert _run(_engine(_eagle()), SAMPLED)  # the same drafter unmodified passes
        with pytest.raises(ContractViolation) as info:
            _run(_engine(_halving(_eagle())), SAMPLED)
    assert info.value.invariant_id == "VER-6"
    assert info.value.observed["tensor"] == "draft_probs"
    assert info.value.observed[next(k for k in info.value.observed if k.startswith("draft_probs["))]["sum"] == 0.5
    with contracts.enforce("shapes"):  # [D]: shapes mode reads no values, so the run completes
        assert _run(_engine(_halving(_eagle())), SAMPLED)


class _NaNLogits(Transformer):
    """A target whose logits turn NaN once ``poisoned`` (as with an uninitialised lm_head)."""

    poisoned = False

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        return torch.full_like(logits, float("nan")) if self.poisoned else logits


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_non_finite_target_logits_never_become_a_token(params: SamplingParams) -> None:
    target = _NaNLogits(ModelConfig.tiny(vocab_size=32), seed=5)
    target.load_state_dict(TARGET.state_dict())
    target.poisoned = True
    for mode in ("off", "shapes"):
        engine = _engine(None, target)
        engine.add_request("nan-req", [1, 7, 3, 9], params=params, max_tokens=4)
        with contracts.enforce(mode), pytest.raises(NonFiniteLogitsError, match="request 'nan-req'"):
            engine.run(max_steps=20)
        assert engine.requests["nan-req"].output == []  # greedy used to emit token 0 here
    with contracts.enforce("full"), pytest.raises(ContractViolation) as info:
        engine = _engine(None, target)
        engine.add_request("nan-req", [1, 7, 3, 9], params=params, max_tokens=4)
        engine.run(max_steps=20)
    assert info.value.invariant_id == "VER-5"


def test_a_nan_drafter_weight_under_sampling_is_named() -> None:
    spec = _eagle()
    with torch.no_grad():
        dict(spec.network.named_parameters())["layer.mlp.down_proj.weight"][0, 0] = float("nan")
    # In full, VER-8 names it at the draft forward, before the drafter samples; off, sampling refuses the rows.
    with contracts.enforce("full"), pytest.raises(ContractViolation, match=r"\[VER-8\]") as caught:
        _run(_engine(spec), SAMPLED)
    assert caught.value.invariant_id == "VER-8" and "backend eagle" in str(caught.value)
    with contracts.enforce("off"), pytest.raises(InvalidDistributionError, match="rows are not probability"):
        _run(_engine(spec), SAMPLED)
