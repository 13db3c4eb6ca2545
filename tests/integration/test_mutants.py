"""The mutation corpus: each known bug pattern is caught by the invariant meant to catch it, on a small budget.

One test per mutant (``-k <mutant name>``) runs it through the conformance
matrix exactly as ``specdec mutate`` does; the baseline runs the same families
without mutants, which must pass, or a catch would prove nothing.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jaxtyping import config as jaxtyping_config
from rich.console import Console

from contracts import all_invariants
from specdec import faults
from specdec.testing import mutation
from specdec.testing.mutants import BY_NAME, MUTANTS, PATCHED_NAMESPACES, Mutant, get, resolve
from specdec.testing.mutation import MutantResult, is_invariant, main, render_table, run_baseline, run_mutants, summary

EXAMPLES = 8
"""Generated configurations per family: the budget of every mutant here and of the baseline."""
MAX_EXAMPLES_TO_CATCH = 6

REQUIRED = {
    "eagle-dp-pad-decode-attention": "DP padding leaked into AR decode attention",
    "dflash-dp-pad-block-attention": "the same in DFlash",
    "dspark-dp-pad-block-attention": "the same in DSpark",
    "target-qsl-pad-minus-one": "query_start_loc padded with -1",
    "target-slot-mapping-short": "slot mapping shorter than the padded tokens",
    "target-pad-slot-not-pad": "padded rows not written to PAD_SLOT_ID",
    "dflash-rejected-context-rows": "rejected draft rows written into the draft KV cache",
    "engine-kv-not-rolled-back": "KV not rolled back after rejection (engine kv.truncate)",
    "dspark-markov-start-wrong-token": "Markov chain started from the wrong token",
    "dspark-backbone-proposal": "backbone distribution handed to the verifier",
    "dspark-capacity-not-prefix": "capacities that are not a prefix",
    "draft-model-decode-positions-off-by-one": "positions off by one in an AR draft decode step",
    "verifier-bonus-dropped": "bonus token dropped",
    "dp-rank-skips-draft-sync": "a rank skipping a collective",
    "dspark-block-qsl-padded-requests": "block query_start_loc not zero-length for padded requests",
    "engine-last-valid-off-by-one": "AR prefill last-token index off by one",
}


@pytest.fixture
def contracts_only() -> Iterator[None]:
    """Mutant runs measure the contracts, as ``specdec mutate`` does: without the import hook's annotation checks,
    which repeat the shape contracts on every call and make a whole engine run about five times slower."""
    previous = jaxtyping_config.jaxtyping_disable
    jaxtyping_config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping_config.update("jaxtyping_disable", previous)


def test_the_corpus_covers_the_known_bug_patterns() -> None:
    assert len(MUTANTS) >= 15
    assert set(REQUIRED) <= set(BY_NAME), sorted(set(REQUIRED) - set(BY_NAME))
    ids = {inv.id for inv in all_invariants()}
    for m in MUTANTS:
        assert m.expected in ids, f"{m.name}: expected {m.expected!r} is not a registered invariant"
        assert m.backend in ("eagle", "draft-model", "dflash", "dspark"), m.name
    assert {m.backend for m in MUTANTS} == {"eagle", "draft-model", "dflash", "dspark"}
    assert BY_NAME["dp-rank-skips-draft-sync"].accepts("DPCollectiveTimeout")
    assert BY_NAME["dp-rank-skips-draft-sync"].timeout_s <= 5.0  # a skipped collective must not look like a hang
    with pytest.raises(ValueError, match="unknown mutant"):
        get(["no-such-mutant"])


@pytest.mark.parametrize("name", [m.name for m in MUTANTS], ids=[m.name for m in MUTANTS])
def test_each_mutant_is_caught_by_its_invariant(name: str) -> None:
    [result] = run_mutants([name], examples=EXAMPLES, seed=0)
    assert result.caught, f"{name} was not caught in {EXAMPLES} examples"
    assert result.as_expected and result.by_contract, f"{name}: caught by {result.caught_by}\n{result.message}"
    assert result.examples <= MAX_EXAMPLES_TO_CATCH, f"{name}: needed {result.examples} examples"


@pytest.mark.usefixtures("contracts_only")
def test_the_same_families_without_mutants_pass() -> None:
    baseline = run_baseline(examples=EXAMPLES, seed=0)
    used = {(m.backend, m.family, json.dumps(dict(m.options))) for m in MUTANTS}
    assert {(b.backend, b.family, json.dumps(b.options)) for b in baseline} == used
    failed = [f"{b.backend}/{b.family}: {b.caught_by}\n{b.message}" for b in baseline if not b.passed]
    assert not failed, "\n".join(failed)
    assert all(b.examples == EXAMPLES for b in baseline)


def _snapshot() -> tuple[dict[str, dict[str, int]], set[str]]:
    spaces = {path: {k: id(v) for k, v in vars(resolve(path)).items()} for path in PATCHED_NAMESPACES}
    return spaces, {n for n in faults.KNOWN_FAULTS if faults.active(n)}


@pytest.mark.parametrize("name", [m.name for m in MUTANTS], ids=[m.name for m in MUTANTS])
def test_applying_and_leaving_a_mutant_restores_the_code(name: str) -> None:
    before = _snapshot()
    with BY_NAME[name].apply():
        during = _snapshot()
    assert during != before, f"{name} changed nothing it is known to patch"
    assert _snapshot() == before


def test_leaving_a_mutant_on_an_exception_restores_the_code() -> None:
    before = _snapshot()
    with pytest.raises(RuntimeError, match="boom"), BY_NAME["verifier-bonus-dropped"].apply():
        raise RuntimeError("boom")
    assert _snapshot() == before


def test_a_family_the_backend_cannot_run_is_neither_a_catch_nor_a_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """EAGLE takes no ``capacity`` option, so the capacity family is skipped: that must not score."""
    unrunnable = Mutant("unrunnable", "", "eagle", "capacity", "BLK-8", BY_NAME["verifier-bonus-dropped"].apply)
    monkeypatch.setattr(mutation, "get", lambda names: [unrunnable])
    [result] = run_mutants(examples=2)
    assert not result.caught and result.caught_by is None and result.message.startswith("skipped")
    [base] = run_baseline(examples=2)
    assert not base.passed and base.caught_by == "skipped"


def _result(name: str, caught_by: str | None, examples: int, expected: str = "BLK-6") -> MutantResult:
    return MutantResult(
        name,
        "dflash",
        "dp",
        expected,
        caught_by is not None,
        caught_by,
        examples,
        0.5,
        as_expected=caught_by == expected,
    )


def test_summary_counts_contract_catches_apart_from_crashes_and_mismatches() -> None:
    results = [
        _result("a", "BLK-6", 1),
        _result("b", "mismatch", 3),
        _result("c", "IndexError", 5),
        _result("d", None, 8),
        _result("e", "AR-5", 2),
    ]
    stats = summary(results)
    assert (stats["total"], stats["caught"], stats["caught_by_contract"]) == (5, 4, 2)
    assert stats["caught_only_by_crash_or_mismatch"] == 2 and stats["caught_as_expected"] == 1
    assert stats["score"] == 0.8 and stats["missed"] == ["d"] and stats["median_examples_to_catch"] == 2.5
    assert is_invariant("DP-3") and not is_invariant("DPCollectiveTimeout") and not is_invariant(None)
    out = io.StringIO()
    Console(file=out, width=200).print(render_table(results))
    assert "missed" in out.getvalue() and "crash/mismatch only" in out.getvalue()


def test_main_writes_json_and_fails_only_on_a_miss_or_a_failing_baseline(tmp_path: Path) -> None:
    path = tmp_path / "mutate.json"
    assert main(["dflash-rejected-context-rows"], 3, 0, path) == 0
    data: dict[str, Any] = json.loads(path.read_text())
    assert data["baseline_ok"] and data["summary"]["score"] == 1.0
    [row] = data["results"]
    assert row["caught_by"] == "BLK-6" and row["by_contract"] and row["examples"] >= 1
