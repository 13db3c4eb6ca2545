"""Every check ends in a ContractViolation or passes, whatever malformed subject it is given.

Real check points are captured from small engine runs (target, DP sync, draft
prefill/decode/block, proposal, verify, cache), then mutated (lengths, ranks,
dtypes, devices incl. meta, Python types, signs, values) and checked again in
``shapes`` and ``full``. The named crashes found by mutating captured points
are pinned by their own tests below.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import random
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from factories import block_facts, decode_facts
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

import contracts
import contracts.enforcement
from backends import create
from contracts import ContractViolation, StepKind, Subject, check
from contracts.descriptor import BatchExecutionDescriptor, CUDAGraphMode, DPSyncState
from contracts.facts import DescriptorFacts, DPFacts, ProposalFacts
from specdec.dispatch import CaptureConfig
from specdec.engine import EngineConfig
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.scheduler import SchedulerConfig
from specdec.speculator import Speculator
from specdec.testing.dp_run import DPRunSpec, RequestSpec, run_in_process

CheckPoint = tuple[Subject, Any, StepKind]


# -- capturing real check points ------------------------------------------------------------------


def _bindings() -> list[tuple[Any, str]]:
    """Every (module, attribute) where a loaded module holds ``contracts.enforcement.check``."""
    target = contracts.enforcement.check
    found = []
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "")
        if isinstance(name, str) and name.startswith(("contracts", "specdec", "backends")):
            found += [(module, attr) for attr, value in list(vars(module).items()) if value is target]
    return found


@contextmanager
def recording(points: list[CheckPoint]) -> Iterator[None]:
    real = contracts.enforcement.check
    bindings = _bindings()

    def record(subject: Subject, facts: Any, *, step_kind: StepKind, **kwargs: Any) -> None:
        points.append((subject, facts, step_kind))
        real(subject, facts, step_kind=step_kind, **kwargs)

    for module, attr in bindings:
        setattr(module, attr, record)
    try:
        yield
    finally:
        for module, attr in bindings:
            setattr(module, attr, real)


def _spec(backend: str, capture: CaptureConfig, counts: list[int]) -> DPRunSpec:
    def speculator(target: Transformer) -> Speculator:
        return create(backend, target, num_spec_tokens=2)

    requests = tuple(
        tuple(RequestSpec(f"r{rank}-{i}", (1 + (i * 7 + rank) % 90, 2 + i % 5, 3), max_tokens=4) for i in range(n))
        for rank, n in enumerate(counts)
    )
    engine = EngineConfig(
        num_blocks=64,
        block_size=4,
        capture=capture,
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64),
    )
    return DPRunSpec(ModelConfig.tiny(), 0, engine, requests, speculator)


_CAPTURED: list[CheckPoint] = []


def captured_points() -> list[CheckPoint]:
    """Check points of real runs: every subject and step kind, eager and FULL graphs, DP 1 and 2."""
    if not _CAPTURED:
        full = CaptureConfig(mode=CUDAGraphMode.FULL, capture_sizes=(1, 2, 4, 8, 16, 32))
        runs = [
            ("eagle", CaptureConfig(), [3, 1]),
            ("eagle", full, [2]),
            ("dflash", CaptureConfig(), [2, 1]),
            ("dspark", full, [2, 0]),
        ]
        points: list[CheckPoint] = []
        with contracts.enforce("full"), recording(points):
            for backend, capture, counts in runs:
                run_in_process(_spec(backend, capture, counts))
        # Keep a bounded, varied sample: every (subject, step kind) pair, a few points each.
        by_kind: dict[tuple[Subject, StepKind], list[CheckPoint]] = {}
        for p in points:
            by_kind.setdefault((p[0], p[2]), []).append(p)
        for group in by_kind.values():
            _CAPTURED.extend(group[:: max(1, len(group) // 12)][:12])
    return _CAPTURED


def test_capture_reaches_every_subject_and_forward_kind() -> None:
    kinds = {(s, k) for s, _, k in captured_points()}
    assert {s for s, _ in kinds} == set(Subject)
    forwards = {StepKind.TARGET, StepKind.DRAFT_PREFILL, StepKind.DRAFT_DECODE, StepKind.DRAFT_BLOCK}
    assert forwards <= {k for s, k in kinds if s is Subject.BATCH}
    with contracts.enforce("full"):
        for subject, facts, kind in captured_points():
            check(subject, facts, step_kind=kind, component="replay")  # the unmutated points pass


# -- mutations --------------------------------------------------------------------------------------

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _mutate_tensor(t: torch.Tensor, rng: random.Random) -> Any:
    n = t.shape[0] if t.dim() > 0 else 0
    options: list[Callable[[], Any]] = [
        lambda: t[: max(n - 1, 0)],  # one short
        lambda: torch.cat([t, t[-1:]]) if n else t.reshape(1),  # one long
        lambda: t.unsqueeze(-1),  # an extra dimension
        lambda: t.reshape(-1)[:1].reshape(()),  # a scalar
        lambda: t.to(rng.choice(_FLOATS)),
        lambda: t.to(torch.bool),
        lambda: torch.empty(t.shape, dtype=t.dtype, device="meta"),
        lambda: -t - 1 if t.dtype != torch.bool else t,
        lambda: t + 10**6 if t.dtype != torch.bool and not t.dtype.is_floating_point else t * float("nan"),
        lambda: t.tolist() if not t.is_meta else [0],
        lambda: None,
        lambda: "tensor",
    ]
    return rng.choice(options)()


def _mutate_int(v: int, rng: random.Random) -> Any:
    return rng.choice([v + 1, v - 1, -v - 1, 0, str(v), float(v) + 0.5, None, True, 10**12, torch.tensor(v)])


def _replaced(value: Any, name: str, new: Any) -> Any:
    """A copy with one field changed, past the type checks a facts class runs when built.

    Those checks (jaxtyping under the test suite) would refuse most mutations at
    construction; the point is what the checks do with a subject that got through.
    """
    clone = copy.copy(value)
    object.__setattr__(clone, name, new)
    return clone


def _with(value: Any, **changes: Any) -> Any:
    for name, new in changes.items():
        value = _replaced(value, name, new)
    return value


def mutate(value: Any, rng: random.Random, depth: int = 0) -> Any:
    """One mutation somewhere inside ``value`` (a facts object, a model, a tensor, a count, a container)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = [f.name for f in dataclasses.fields(value)]
        name = rng.choice(names)
        return _replaced(value, name, mutate(getattr(value, name), rng, depth + 1))
    if isinstance(value, BaseModel):
        data = {name: getattr(value, name) for name in type(value).model_fields}
        name = rng.choice(list(data))
        data[name] = mutate(data[name], rng, depth + 1)
        return type(value).model_construct(**data)  # bypasses the validators, as a duck-typed foreign object would
    if isinstance(value, torch.Tensor):
        return _mutate_tensor(value, rng)
    if isinstance(value, enum.Enum):
        return rng.choice([*type(value), value.value, value.name, None])
    if isinstance(value, bool):
        return rng.choice([not value, None, "yes", 1])
    if isinstance(value, int):
        return _mutate_int(value, rng)
    if isinstance(value, str):
        return rng.choice([value + "x", "", 3, None])
    if value is None:
        return rng.choice([0, -1, "x", 1.5, torch.zeros(0, dtype=torch.int64), torch.ones(3, dtype=torch.float32)])
    if isinstance(value, Mapping):
        data = dict(value)
        if data and rng.random() < 0.6:
            key = rng.choice(list(data))
            data[key] = mutate(data[key], rng, depth + 1)
        elif data and rng.random() < 0.5:
            data.pop(rng.choice(list(data)))
        else:
            data[rng.choice(["ghost", 7, None])] = rng.choice([[0], [-1], "x", 3])
        return data
    if isinstance(value, (tuple, list, frozenset)):
        items = list(value)
        choice = rng.randrange(5)
        if choice == 0 and items:
            items = items[:-1]
        elif choice == 1:
            items.append(items[-1] if items else -1)
        elif choice == 2 and items:
            i = rng.randrange(len(items))
            items[i] = mutate(items[i], rng, depth + 1)
        elif choice == 3:
            return rng.choice(["items", None, 5])
        else:
            items = [items] if items else [[]]
        return type(value)(items) if not isinstance(value, frozenset) else frozenset(map(repr, items))
    if isinstance(value, float):
        return rng.choice([float("nan"), -value, "1.0", None])
    return rng.choice([None, "x", 0])


def _outcome(subject: Subject, facts: Any, kind: StepKind, mode: str) -> str:
    """``pass``, ``violation`` or ``guarded`` (a check raised and was reported as its invariant)."""
    with contracts.enforce(mode):
        try:
            check(subject, facts, step_kind=kind, component="fuzz")
        except ContractViolation as err:
            return "guarded" if "check raised" in err.observed else "violation"
    return "pass"


MUTATIONS_PER_EXAMPLE = 60
_TALLY: dict[str, int] = {"pass": 0, "violation": 0, "guarded": 0}


@settings(max_examples=100, deadline=None, database=None, phases=(Phase.explicit, Phase.generate))
@given(rng=st.randoms(use_true_random=False), stack=st.integers(1, 3))
def test_mutated_check_points_end_in_a_violation_or_pass(rng: random.Random, stack: int) -> None:
    """Any exception other than ContractViolation fails the test (Hypothesis shows the seed that found it)."""
    points = captured_points()
    for _ in range(MUTATIONS_PER_EXAMPLE):
        subject, facts, kind = rng.choice(points)
        for _ in range(stack):
            try:
                facts = mutate(facts, rng)
            except (RuntimeError, NotImplementedError, IndexError):
                continue  # a mutation torch cannot build (a reshape of an empty tensor, a copy of a meta one)
        for mode in ("shapes", "full"):
            _TALLY[_outcome(subject, facts, kind, mode)] += 1


def test_the_fuzz_ran_at_least_ten_thousand_mutated_check_points() -> None:
    """Runs after the fuzz in file order; alone (``-k``) it runs the fuzz itself first."""
    if sum(_TALLY.values()) < 10_000:
        test_mutated_check_points_end_in_a_violation_or_pass()
    assert sum(_TALLY.values()) >= 10_000, _TALLY
    assert _TALLY["violation"] > 0 and _TALLY["pass"] > 0, _TALLY


# -- the guard: a check that raises is reported as its own invariant -------------------------------


def test_a_check_that_raises_becomes_a_violation_naming_the_invariant_and_exception(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from contracts.registry import REGISTRY

    inv = REGISTRY["AR-5"]

    def crashing(facts: Any, reader: Any) -> None:
        raise IndexError("list index out of range (planted)")

    monkeypatch.setitem(REGISTRY, "AR-5", _with(inv, check=crashing))
    monkeypatch.setattr(contracts.registry, "_INDEX", {})
    with pytest.raises(ContractViolation) as info:
        check(Subject.BATCH, decode_facts(), step_kind=StepKind.DRAFT_DECODE, component="t")
    assert info.value.invariant_id == "AR-5"
    assert info.value.observed["check raised"] == "IndexError: list index out of range (planted)"
    assert "could not inspect" in (info.value.likely_cause or "")


def test_the_guard_lets_a_keyboard_interrupt_through(monkeypatch: pytest.MonkeyPatch) -> None:
    from contracts.registry import REGISTRY

    def interrupted(facts: Any, reader: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setitem(REGISTRY, "AR-5", _with(REGISTRY["AR-5"], check=interrupted))
    monkeypatch.setattr(contracts.registry, "_INDEX", {})
    with pytest.raises(KeyboardInterrupt):
        check(Subject.BATCH, decode_facts(), step_kind=StepKind.DRAFT_DECODE, component="t")


# -- the crashes found by mutation, each now a violation of the invariant that inspects it ---------


def _violated(subject: Subject, facts: Any, kind: StepKind, mode: str = "full") -> ContractViolation:
    with contracts.enforce(mode), pytest.raises(ContractViolation) as info:
        check(subject, facts, step_kind=kind, component="t")
    return info.value


def _target_point() -> Any:
    return next(f for s, f, k in captured_points() if s is Subject.BATCH and k is StepKind.TARGET)


def test_a_host_seq_lens_one_short_is_pad_2() -> None:
    facts = _target_point()
    meta = _with(facts.meta, seq_lens_cpu=facts.meta.seq_lens_cpu[:-1])
    err = _violated(Subject.BATCH, _with(facts, meta=meta), StepKind.TARGET, "shapes")
    assert err.invariant_id == "PAD-2" and err.observed["problem"] == "a host mirror is sized wrongly"


def test_one_request_too_many_is_a_violation() -> None:
    facts = _target_point()
    err = _violated(Subject.BATCH, _with(facts, num_reqs=facts.num_reqs + 1), StepKind.TARGET)
    assert err.invariant_id.startswith("TGT-")


def test_three_dimensional_draft_ids_are_ar_9() -> None:
    facts = decode_facts()
    desc = facts.desc
    ids = torch.zeros(facts.num_reqs, 2, dtype=torch.int64)
    proposal = ProposalFacts(desc=desc, num_reqs=facts.num_reqs, num_spec_tokens=2, draft_token_ids=ids)
    proposal = _with(proposal, draft_token_ids=ids.unsqueeze(-1))
    err = _violated(Subject.PROPOSAL, proposal, StepKind.DRAFT_DECODE, "shapes")
    assert err.invariant_id == "AR-9"
    assert err.observed["draft_token_ids.shape"] == (facts.num_reqs, 2, 1)


def test_string_fields_are_dp_2_and_desc_5() -> None:
    state = DPSyncState(dp_size=2, cg_mode=CUDAGraphMode.NONE, num_tokens_across_dp=(3, 3))
    desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=3, num_reqs=3)
    dp = _with(DPFacts(state, desc, rank=0, num_tokens=3), num_tokens="3")
    assert _violated(Subject.DP, dp, StepKind.DP_SYNC).invariant_id == "DP-2"
    facts = _with(DescriptorFacts(desc, num_reqs=3, num_tokens=3), num_tokens="3")
    assert _violated(Subject.DESCRIPTOR, facts, StepKind.TARGET).invariant_id == "DESC-5"


def test_float_seq_lens_are_a_violation_not_a_type_error() -> None:
    facts = _target_point()
    meta = _with(facts.meta, seq_lens=facts.meta.seq_lens.float())
    err = _violated(Subject.BATCH, _with(facts, meta=meta), StepKind.TARGET)
    assert err.invariant_id == "IN-1"
    assert err.observed["non-integer tensors (name: dtype)"] == {"seq_lens": "torch.float32"}


# -- IN-*: dtypes, devices and signs of model inputs ------------------------------------------------


@pytest.mark.parametrize("kind", [StepKind.DRAFT_DECODE, StepKind.DRAFT_BLOCK])
def test_correct_forwards_pass_in_every_mode(kind: StepKind) -> None:
    facts = decode_facts() if kind is StepKind.DRAFT_DECODE else block_facts()
    for mode in ("shapes", "full"):
        with contracts.enforce(mode):
            check(Subject.BATCH, facts, step_kind=kind, component="t")


def test_float_input_ids_are_in_1_in_shapes_mode() -> None:
    facts = decode_facts()
    err = _violated(Subject.BATCH, _with(facts, input_ids=facts.input_ids.float()), StepKind.DRAFT_DECODE, "shapes")
    assert err.invariant_id == "IN-1" and err.observed["non-integer tensors (name: dtype)"] == {
        "input_ids": "torch.float32"
    }


def test_float_positions_are_in_1() -> None:
    facts = _target_point()
    err = _violated(Subject.BATCH, _with(facts, positions=facts.positions.double()), StepKind.TARGET, "shapes")
    assert err.invariant_id == "IN-1"


def test_a_meta_device_slot_mapping_is_in_2_in_shapes_mode() -> None:
    facts = decode_facts()
    slots = torch.empty(facts.meta.slot_mapping.shape, dtype=torch.int64, device="meta")
    bad = _with(facts, meta=_with(facts.meta, slot_mapping=slots))
    err = _violated(Subject.BATCH, bad, StepKind.DRAFT_DECODE, "shapes")
    assert err.invariant_id == "IN-2"
    assert err.observed["tensors on another device"] == {"slot_mapping": "meta"}


def test_a_host_mirror_on_the_meta_device_is_in_2() -> None:
    facts = _target_point()
    mirror = torch.empty(facts.meta.seq_lens_cpu.shape, dtype=torch.int64, device="meta")
    bad = _with(facts, meta=_with(facts.meta, seq_lens_cpu=mirror))
    err = _violated(Subject.BATCH, bad, StepKind.TARGET, "shapes")
    assert err.invariant_id == "IN-2" and err.observed["host mirrors not on the host"] == {"seq_lens_cpu": "meta"}


def test_meta_stand_ins_for_ids_and_positions_pass() -> None:
    facts = _target_point()
    stand_in = torch.empty(facts.input_ids.shape, dtype=torch.int64, device="meta")
    with contracts.enforce("full"):
        check(
            Subject.BATCH,
            _with(facts, input_ids=stand_in, positions=stand_in),
            step_kind=StepKind.TARGET,
            component="t",
        )


def test_negative_positions_are_in_3_in_full_only() -> None:
    facts = decode_facts()
    pos = facts.positions.clone()
    pos[-1] = -1
    bad = _with(facts, positions=pos)
    with contracts.enforce("shapes"):
        check(Subject.BATCH, bad, step_kind=StepKind.DRAFT_DECODE, component="t")  # a value read: full only
    err = _violated(Subject.BATCH, bad, StepKind.DRAFT_DECODE)
    assert err.invariant_id == "IN-3" and err.observed["rows with a negative position"] == [len(pos) - 1]
