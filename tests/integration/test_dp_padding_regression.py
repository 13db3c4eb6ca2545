"""The motivating bug: DP padding leaked into autoregressive draft-decode attention metadata.

DP=8, one rank with 12 decode requests while the others have 13; eager steps,
so each rank's draft model inputs are padded to 13 rows for the MTP layer's
expert-parallel all-gather. The pre-fix drafter (injected with the mutant
``eagle-dp-pad-decode-attention``, which patches ``decode_attention_rows``) built
its decode metadata for 13 queries; DeepSeek-V3.2's sparse indexer then failed on the 12-request rank.
"""

from __future__ import annotations

import re

import pytest

import contracts
from backends.autoregressive import AutoregressiveSpeculator, EagleHead
from backends.registry import spread_layers
from contracts import ContractViolation
from specdec.dispatch import CaptureConfig
from specdec.engine import EngineConfig
from specdec.nn.config import IndexerConfig, ModelConfig, MoEConfig
from specdec.nn.transformer import Transformer
from specdec.scheduler import SchedulerConfig
from specdec.speculator import Speculator
from specdec.testing.distributed import DistributedRunError, run_gloo
from specdec.testing.dp_run import DPRunSpec, RequestSpec, merged, plain_outputs, run_gloo_rank, run_in_process

PRE_FIX = ("eagle-dp-pad-decode-attention",)
"""The mutation corpus's pre-fix behaviour, applied in every rank's process (threads or gloo)."""
TARGET = ModelConfig.tiny()


def mtp_speculator(target: Transformer) -> Speculator:
    """An MTP-style head: one decoder layer with DeepSeek-V3.2's 64x128 indexer and an expert-parallel MoE."""
    layer = target.config.model_copy(
        update={
            "num_layers": 1,
            "indexer": IndexerConfig(num_heads=64, head_dim=128, topk=4096),
            "moe": MoEConfig(num_experts=8, top_k=2),
        }
    )
    aux = spread_layers(target.config.num_layers)
    head = EagleHead(target, num_aux=len(aux), seed=7, layer_config=layer)
    return AutoregressiveSpeculator(head, num_spec_tokens=3, aux_layers=aux, name="mtp")


def spec_for(counts: list[int], mutants: tuple[str, ...] = ()) -> DPRunSpec:
    requests = tuple(
        tuple(RequestSpec(f"r{rank}-{i}", (1 + (i * 7 + rank) % 90, 2 + i % 5), max_tokens=4) for i in range(n))
        for rank, n in enumerate(counts)
    )
    engine = EngineConfig(
        num_blocks=256,
        block_size=8,
        capture=CaptureConfig(),  # eager: DP ranks keep their own counts; the drafter pads model rows
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=128),
    )
    return DPRunSpec(TARGET, 0, engine, requests, mtp_speculator, mutants=mutants)


MOTIVATING = [13, 13, 13, 12, 13, 13, 13, 13]


def test_pre_fix_drafter_crashes_in_the_sparse_indexer_without_contracts() -> None:
    with contracts.enforce("off"), pytest.raises(RuntimeError) as info:
        run_in_process(spec_for(MOTIVATING, PRE_FIX))
    assert "shape '[12, -1, 64, 128]' is invalid for input of size 106496" in str(info.value)
    assert 106496 == 13 * 64 * 128


def test_shape_contracts_name_ar_5_before_attention_runs() -> None:
    with contracts.enforce("shapes"), pytest.raises(ContractViolation) as info:
        run_in_process(spec_for(MOTIVATING, PRE_FIX))
    err = info.value
    assert err.invariant_id == "AR-5"
    assert err.step_kind == "draft_decode" and "mtp" in (err.component or "")
    assert "DP padding leaked into draft attention metadata" in str(err)
    assert err.observed["meta.num_tokens_padded"] == 13 and err.observed["expected attention tokens"] == 12


@pytest.mark.parametrize("mode", ["off", "shapes", "full"])
def test_fixed_drafter_completes_on_every_rank_and_matches_plain_decoding(mode: str) -> None:
    spec = spec_for(MOTIVATING)
    with contracts.enforce(mode):
        results = run_in_process(spec)
    assert merged(results) == plain_outputs(spec)
    assert len({r.collectives for r in results}) == 1, "every rank must run the same number of collectives"
    assert all(r.metrics.drafted > 0 for r in results)


@pytest.mark.slow
def test_same_scenario_over_gloo_processes() -> None:
    counts = [4, 3, 4]
    with pytest.raises(DistributedRunError) as info:
        run_gloo(3, run_gloo_rank, spec_for(counts, PRE_FIX), timeout_s=4.0, contract_mode="off")
    assert re.search(r"shape '\[3, -1, 64, 128\]' is invalid for input of size 32768", str(info.value.errors[1]))

    with pytest.raises(DistributedRunError) as info:
        run_gloo(3, run_gloo_rank, spec_for(counts, PRE_FIX), timeout_s=4.0, contract_mode="shapes")
    violation = info.value.errors[1]
    assert isinstance(violation, ContractViolation) and violation.invariant_id == "AR-5"

    spec = spec_for(counts)
    results = run_gloo(3, run_gloo_rank, spec, timeout_s=20.0, contract_mode="shapes")
    assert merged(results) == plain_outputs(spec)
