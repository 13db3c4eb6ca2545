"""The mutation corpus: each known bug pattern is caught by the invariant meant to catch it, on a small budget.

One test per mutant (``-k <mutant name>``) runs it through the conformance
matrix exactly as ``specdec mutate`` does; the baseline runs the same families
without mutants, which must pass, or a catch would prove nothing.
"""

from __future__ import annotations

import inspect
import io
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

import pytest
from jaxtyping import config as jaxtyping_config
from rich.console import Console

import backends.testing.mutants
import specdec.testing.mutants
import specdec.verifier
from contracts import all_invariants
from specdec.testing import corpus, mutation
from specdec.testing.corpus import get
from specdec.testing.mutant import Mutant
from specdec.testing.mutation import MutantResult, is_invariant, main, render_table, run_baseline, run_mutants, summary

MUTANTS = corpus.corpus()
BY_NAME = {m.name: m for m in MUTANTS}
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
    "target-logits-nan-column": "non-finite target logits (greedy emitted token 0)",
    "engine-drafts-trimmed-to-longest": "verifier inputs not shaped (num_reqs, K)",
    "eagle-top-k-not-renormalised": "a proposal that does not sum to 1",
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


def test_the_corpus_is_the_runtimes_own_then_the_built_in_drafters_from_their_entry_point() -> None:
    own, built_in = specdec.testing.mutants.MUTANTS, backends.testing.mutants.MUTANTS
    assert own + built_in == MUTANTS
    [(source, found)] = [(s, m) for s, m in corpus.sources() if "backends.testing.mutants:MUTANTS" in s]
    assert found == built_in and corpus.GROUP in source
    # What patches a drafter lives next to it; the runtime's own mutants run against drafters only by name.
    assert all(not n.startswith(("target-", "engine-", "verifier-", "dp-")) for n in (m.name for m in built_in))
    assert {m.name for m in own} >= {"engine-kv-not-rolled-back", "verifier-bonus-dropped", "dp-rank-skips-draft-sync"}


THIRD_PARTY_APPLIED: list[str] = []


@contextmanager
def _record(name: str) -> Iterator[None]:
    THIRD_PARTY_APPLIED.append(name)
    try:
        yield
    finally:
        THIRD_PARTY_APPLIED.remove(name)


THIRD_PARTY = (Mutant("ngram-example", "a third-party bug", "ngram", "dp", "AR-9", lambda: _record("ngram-example")),)
NOT_MUTANTS = (BY_NAME["verifier-bonus-dropped"], "verifier-bonus-dropped")


def _with_entry_points(monkeypatch: pytest.MonkeyPatch, *values: str) -> None:
    """The installed ``specdec.mutants`` entry points plus ``values`` (names of objects in this module)."""
    installed = entry_points(group=corpus.GROUP)
    extra = [EntryPoint(f"extra-{i}", f"{__name__}:{v}", corpus.GROUP) for i, v in enumerate(values)]
    monkeypatch.setattr(corpus, "entry_points", lambda group: [*installed, *extra] if group == corpus.GROUP else [])


def test_a_third_party_corpus_is_found_through_its_entry_point_and_applied_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert "ngram-example" not in {m.name for m in get()}
    _with_entry_points(monkeypatch, "THIRD_PARTY")
    assert get()[-1] is THIRD_PARTY[0] and get(["ngram-example"]) == list(THIRD_PARTY)
    with corpus.injected(("ngram-example", "verifier-bonus-dropped")):
        assert THIRD_PARTY_APPLIED == ["ngram-example"]
        assert specdec.verifier.VerifierOutput is not VERIFIER_OUTPUT  # the runtime's own mutant, applied too
    assert THIRD_PARTY_APPLIED == [] and specdec.verifier.VerifierOutput is VERIFIER_OUTPUT


def test_a_mutant_name_claimed_twice_or_a_bad_entry_point_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_entry_points(monkeypatch, "THIRD_PARTY", "THIRD_PARTY_AGAIN")
    with pytest.raises(ValueError, match=r"'ngram-example' is claimed twice: by entry point extra-0 .* and by"):
        get()
    _with_entry_points(monkeypatch, "NOT_MUTANTS")
    with pytest.raises(TypeError, match=r"holds \['str'\] besides Mutant"):
        get()
    _with_entry_points(monkeypatch, "MAX_EXAMPLES_TO_CATCH")
    with pytest.raises(TypeError, match=r"names a int; expected a sequence of specdec\.testing\.mutant\.Mutant"):
        get()
    _with_entry_points(monkeypatch, "NO_SUCH_NAME")
    with pytest.raises(ImportError, match=r"loading entry point extra-0 .* failed: AttributeError"):
        get()


THIRD_PARTY_AGAIN = THIRD_PARTY
VERIFIER_OUTPUT = specdec.verifier.VerifierOutput


ANNOTATED_BUGS = frozenset({"eagle-decode-positions-float", "lookup-widens-ids-not-distributions"})
"""Mutants whose bug is one the jaxtyping annotations state (a tensor dtype, a K shared by two fields): the test
suite's import hook rejects it at the annotated dataclass before any contract runs, so these run without the hook,
as production (and ``specdec mutate``) does."""


@pytest.mark.parametrize("name", [m.name for m in MUTANTS], ids=[m.name for m in MUTANTS])
def test_each_mutant_is_caught_by_its_invariant(name: str, request: pytest.FixtureRequest) -> None:
    if name in ANNOTATED_BUGS:
        request.getfixturevalue("contracts_only")
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


def _namespaces() -> dict[str, object]:
    """Every loaded module of the three packages and every class defined in one: whatever a mutant may patch."""
    out: dict[str, object] = {}
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] not in ("contracts", "specdec", "backends") or module is None:
            continue
        out[name] = module
        for attr, value in vars(module).items():
            if inspect.isclass(value) and value.__module__ == name:
                out[f"{name}:{attr}"] = value
    return out


NAMESPACES = _namespaces()  # after the corpus was loaded: every module a mutant patches is imported by then


def _snapshot() -> dict[str, dict[str, int]]:
    return {path: {k: id(v) for k, v in vars(space).items()} for path, space in NAMESPACES.items()}


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
