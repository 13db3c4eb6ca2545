"""The catalog is generated from the registry, complete, and every invariant is triggered by a test."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from contracts import REGISTRY, all_invariants
from contracts.catalog import render_markdown
from specdec.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def test_committed_catalog_is_fresh() -> None:
    committed = (ROOT / "docs" / "contracts.md").read_text(encoding="utf-8")
    assert committed == render_markdown(), (
        "docs/contracts.md is stale: run `specdec contracts --write docs/contracts.md`"
    )


def test_catalog_lists_at_least_25_invariants_with_ids_statements_and_tags() -> None:
    invs = list(all_invariants())
    assert len(invs) >= 25
    text = render_markdown()
    for inv in invs:
        assert re.search(
            rf"\| {re.escape(inv.id)} \| {re.escape(inv.tag.value)} \| {re.escape(inv.statement)} \|", text
        )
        assert inv.statement.endswith(".") and inv.step_kinds


def test_every_registered_invariant_is_triggered_on_purpose_by_some_test() -> None:
    """A trigger test names the ID and asserts it on the raised ContractViolation."""
    sources = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "tests").rglob("test_*.py"))
    assert "invariant_id" in sources
    untriggered = [i for i in REGISTRY if f'"{i}"' not in sources]
    assert untriggered == [], f"invariants with no trigger test: {untriggered}"


def test_cli_prints_and_checks_the_catalog(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["contracts", "--format", "text"]) == 0
    out = capsys.readouterr().out
    assert f"{len(REGISTRY)} invariants" in out and "AR-5" in out
    stale = tmp_path / "contracts.md"
    stale.write_text("old\n")
    assert main(["contracts", "--check", str(stale)]) == 1
    assert main(["contracts", "--write", str(stale)]) == 0
    assert main(["contracts", "--check", str(stale)]) == 0
