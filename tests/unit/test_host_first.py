"""The cheapest check first: what the engine already holds on the host is checked there, in every mode.

The engine copies each verification result to the host to commit it; VER-1 and
VER-2 read that copy (``specdec.verifier.check_verified``), so a bad id is
named before it reaches the output, the drafter or the next step's embedding,
and in ``shapes`` as well as ``full``. With contracts ``off`` the same checks
raise ``MalformedVerifierOutputError``. VER-1 and VER-2 do not overlap, so one
fault is always reported by the one whose likely cause is specific.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import contracts
import specdec.engine
from backends import create
from contracts import REJECTED_TOKEN_ID, ContractViolation, VerifierInput, VerifierOutput
from specdec.engine import Engine, EngineConfig
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.sampling import SamplingParams
from specdec.scheduler import SchedulerConfig
from specdec.verifier import MalformedVerifierOutputError, check_verified

K = 3
VOCAB = 5


def _input() -> tuple[VerifierInput, list[int]]:
    counts = [2, 1]
    ids = torch.tensor([[1, 2, REJECTED_TOKEN_ID], [3, REJECTED_TOKEN_ID, REJECTED_TOKEN_ID]])
    return VerifierInput(ids, torch.tensor(counts), torch.randn(5, VOCAB)), counts


def _raised(rows: list[list[int]], accepted: list[int], mode: str) -> Exception:
    inp, counts = _input()
    out = VerifierOutput(torch.tensor(rows), torch.tensor(accepted))
    with contracts.enforce(mode), pytest.raises((ContractViolation, MalformedVerifierOutputError)) as info:
        check_verified(inp, out, rows, accepted, num_spec_tokens=K, num_draft_tokens=counts)
    return info.value


@pytest.mark.parametrize("mode", ["off", "shapes", "full"])
def test_a_sentinel_accepted_is_ver_2_not_a_dropped_bonus(mode: str) -> None:
    # Request 1 has one draft; the verifier accepted its sentinel slot too, so the slot after it is the bonus.
    rows = [[1, 2, 4, REJECTED_TOKEN_ID], [3, REJECTED_TOKEN_ID, REJECTED_TOKEN_ID, REJECTED_TOKEN_ID]]
    err = _raised(rows, [2, 2], mode)
    assert getattr(err, "invariant_id", None) == "VER-2"
    assert isinstance(err, MalformedVerifierOutputError if mode == "off" else ContractViolation)


@pytest.mark.parametrize("mode", ["off", "shapes", "full"])
def test_an_emitted_id_outside_the_vocabulary_is_ver_1_on_the_host(mode: str) -> None:
    rows = [
        [1, VOCAB, REJECTED_TOKEN_ID, REJECTED_TOKEN_ID],
        [0, REJECTED_TOKEN_ID, REJECTED_TOKEN_ID, REJECTED_TOKEN_ID],
    ]
    err = _raised(rows, [1, 0], mode)
    assert getattr(err, "invariant_id", None) == "VER-1" and "vocab" in str(err)


@pytest.mark.parametrize("mode", ["off", "shapes", "full"])
def test_an_accepted_draft_outside_the_vocabulary_is_ver_2(mode: str) -> None:
    rows = [[1, 7, 2, REJECTED_TOKEN_ID], [0, REJECTED_TOKEN_ID, REJECTED_TOKEN_ID, REJECTED_TOKEN_ID]]
    assert getattr(_raised(rows, [2, 0], mode), "invariant_id", None) == "VER-2"


@pytest.mark.parametrize("mode", ["off", "shapes", "full"])
def test_correct_results_pass_and_a_row_with_no_token_is_left_to_the_engine(mode: str) -> None:
    inp, counts = _input()
    ok = [[1, 2, 4, REJECTED_TOKEN_ID], [REJECTED_TOKEN_ID] * 4]  # request 1: non-finite logits, no token drawn
    with contracts.enforce(mode):
        check_verified(
            inp,
            VerifierOutput(torch.tensor(ok), torch.tensor([2, 0])),
            ok,
            [2, 0],
            num_spec_tokens=K,
            num_draft_tokens=counts,
        )


# -- through the engine ------------------------------------------------------------------------------------------------


def _sentinel_accepted(real: Any) -> Any:
    """A verifier that also accepts the first sentinel slot of every request with fewer than K drafts."""

    def verify(inp: VerifierInput, params: Any, **kw: Any) -> VerifierOutput:
        out = real(inp, params, **kw)
        rows, accepted = out.output_token_ids.clone(), out.num_accepted.clone()
        for r, d in enumerate(kw["num_draft_tokens"]):
            if int(accepted[r]) == d and d < K:
                rows[r, d], rows[r, d + 1] = REJECTED_TOKEN_ID, rows[r, d]
                accepted[r] = d + 1
        return VerifierOutput(rows, accepted)

    return verify


@pytest.mark.parametrize("mode", ["off", "shapes", "full"])
def test_the_engine_names_an_accepted_sentinel_before_it_reaches_the_output(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(specdec.engine, "verify", _sentinel_accepted(specdec.engine.verify))
    target = Transformer(ModelConfig.tiny(), seed=0)
    config = EngineConfig(num_blocks=64, block_size=4, scheduler=SchedulerConfig(max_num_batched_tokens=64))
    engine = Engine(target, config, speculator=create("eagle", target, num_spec_tokens=K))
    engine.add_request("a", [3, 4, 5, 6], max_tokens=8)
    with contracts.enforce(mode), pytest.raises((ContractViolation, MalformedVerifierOutputError)) as info:
        engine.run(max_steps=50)
    assert getattr(info.value, "invariant_id", None) == "VER-2"
    assert all(t != REJECTED_TOKEN_ID for t in engine.requests["a"].output), "the sentinel never reached the output"


@pytest.mark.parametrize("mode", ["off", "shapes", "full"])
def test_a_correct_sampled_run_passes_the_host_checks(mode: str) -> None:
    """Sampled requests carry a proposal: the host check reads only the result, never re-judges the proposal."""
    target = Transformer(ModelConfig.tiny(), seed=0)
    engine = Engine(
        target, EngineConfig(num_blocks=64, block_size=4), speculator=create("eagle", target, num_spec_tokens=K)
    )
    engine.add_request("a", [3, 4, 5, 6], params=SamplingParams(temperature=1.0), max_tokens=8, seed=1)
    engine.add_request("b", [7, 8, 9], max_tokens=8)
    with contracts.enforce(mode):
        out = engine.run(max_steps=50)
    assert len(out["a"]) == 8 and len(out["b"]) == 8
