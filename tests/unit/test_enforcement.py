"""Enforcement modes: what each mode checks, what it may read, and how it is selected."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from factories import block_facts, decode_facts
from torch._subclasses.fake_tensor import FakeTensorMode

import contracts
from contracts import ContractViolation, Mode, StepKind, Subject, check
from contracts.registry import ValueReader


def _bad_positions():  # type: ignore[no-untyped-def]
    """Breaks only AR-8, a [D] invariant."""
    f = decode_facts()
    pos = f.positions.clone()
    pos[:12] += 3
    return dataclasses.replace(f, positions=pos)


def _bad_attention_rows():  # type: ignore[no-untyped-def]
    """Breaks AR-5, an [S] invariant."""
    f = decode_facts()
    return dataclasses.replace(f, meta=dataclasses.replace(f.meta, num_tokens_padded=13))


def test_off_checks_nothing_even_when_broken() -> None:
    with contracts.enforce("off"):
        check(Subject.BATCH, _bad_attention_rows(), step_kind=StepKind.DRAFT_DECODE, component="t")


def test_off_never_consults_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(contracts.enforcement, "invariants_for", lambda *a: calls.append(a) or ())
    with contracts.enforce("off"):
        check(Subject.BATCH, object(), step_kind=StepKind.TARGET, component="t")
    assert calls == []


def test_shapes_skips_device_value_invariants_full_runs_them() -> None:
    with contracts.enforce("shapes"):
        check(Subject.BATCH, _bad_positions(), step_kind=StepKind.DRAFT_DECODE, component="t")
        with pytest.raises(ContractViolation, match=r"\[AR-5\]"):
            check(Subject.BATCH, _bad_attention_rows(), step_kind=StepKind.DRAFT_DECODE, component="t")
    with contracts.enforce("full"), pytest.raises(ContractViolation) as info:
        check(Subject.BATCH, _bad_positions(), step_kind=StepKind.DRAFT_DECODE, component="t")
    assert info.value.invariant_id == "AR-8"


def test_full_skips_device_reads_while_a_graph_is_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(contracts.enforcement, "_capturing", lambda: True)
    with contracts.enforce("full"):
        check(Subject.BATCH, _bad_positions(), step_kind=StepKind.DRAFT_DECODE, component="t")


def test_shapes_mode_never_reads_fake_cuda_tensors() -> None:
    """On fake ``cuda`` tensors any value read raises; shape invariants still fire."""
    facts = decode_facts()
    with FakeTensorMode(allow_non_fake_inputs=True):
        moved = dataclasses.replace(
            facts,
            positions=torch.empty(13, dtype=torch.int64, device="cuda"),
            input_ids=torch.empty(13, dtype=torch.int64, device="cuda"),
            hidden_states=torch.empty((13, 8), device="cuda"),
            meta=dataclasses.replace(
                facts.meta,
                seq_lens=torch.empty(12, dtype=torch.int32, device="cuda"),
                query_start_loc=torch.empty(13, dtype=torch.int32, device="cuda"),
                slot_mapping=torch.empty(13, dtype=torch.int64, device="cuda"),
                block_table=torch.empty((12, 4), dtype=torch.int32, device="cuda"),
                query_start_loc_cpu=None,
                seq_lens_cpu=None,
            ),
            base_positions=torch.empty(12, dtype=torch.int64, device="cuda"),
        )
        assert moved.positions.device.type == "cuda"
        for mode in ("shapes", "full"):
            with contracts.enforce(mode):
                check(Subject.BATCH, moved, step_kind=StepKind.DRAFT_DECODE, component="fake")
                broken = dataclasses.replace(moved, meta=dataclasses.replace(moved.meta, num_tokens_padded=13))
                with pytest.raises(ContractViolation, match=r"\[AR-5\]"):
                    check(Subject.BATCH, broken, step_kind=StepKind.DRAFT_DECODE, component="fake")


def test_value_reader_rules() -> None:
    host, device = ValueReader(allow_device=False), ValueReader(allow_device=True)
    t = torch.tensor([1, 2])
    assert host.host(t) == [1, 2] and device.device(t) == [1, 2]
    meta = torch.empty(2, device="meta")
    assert host.host(meta) is None and device.device(meta) is None
    assert host.host(None) is None


def test_mode_from_environment_and_errors() -> None:
    code = "import contracts; print(contracts.current_mode().value)"
    env = {**os.environ, "SPECDEC_CONTRACTS": "FULL"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "full"
    env["SPECDEC_CONTRACTS"] = "loud"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "SPECDEC_CONTRACTS='loud' is not a contract mode" in bad.stderr


def test_context_manager_restores_previous_mode_after_errors() -> None:
    before = contracts.current_mode()
    with pytest.raises(RuntimeError), contracts.enforce(Mode.FULL):
        assert contracts.current_mode() is Mode.FULL
        raise RuntimeError
    assert contracts.current_mode() is before


def test_block_facts_pass_under_fake_tensors_in_shapes_mode() -> None:
    facts = block_facts()
    with FakeTensorMode(allow_non_fake_inputs=True):
        meta = facts.meta
        on_device = {
            name: torch.empty(getattr(meta, name).shape, dtype=torch.int64, device="cuda")
            for name in ("seq_lens", "query_start_loc", "block_table", "slot_mapping")
        }
        cuda = dataclasses.replace(
            facts,
            positions=torch.empty(48, dtype=torch.int64, device="cuda"),
            input_ids=torch.empty(48, dtype=torch.int64, device="cuda"),
            meta=dataclasses.replace(meta, **on_device),  # host mirrors stay on the host (IN-2)
        )
        with contracts.enforce("shapes"):
            check(Subject.BATCH, cuda, step_kind=StepKind.DRAFT_BLOCK, component="fake")
