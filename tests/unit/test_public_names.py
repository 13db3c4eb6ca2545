"""Every name docs/backend-authors.md lists as public is importable from the module it names.

A backend author writes against that list; a name that moved, or was never
exported, would send them into internal modules (or fail their import).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "backend-authors.md"


def listed_names() -> dict[str, list[str]]:
    """The backticked names of each ``- `module`:`` bullet of "The public names a drafter uses"."""
    text = DOC.read_text()
    section = text.split("### The public names a drafter uses", 1)[1].split("\n#", 1)[0]
    found: dict[str, list[str]] = {}
    for bullet in re.split(r"\n- (?=`)", section)[1:]:
        module, _, body = bullet.partition(":")
        while re.search(r"\([^()]*\)", body):  # attributes and call examples sit in parentheses
            body = re.sub(r"\([^()]*\)", "", body)
        body = body.split("\n\n", 1)[0]
        found[module.strip("`")] = re.findall(r"`([A-Za-z_]\w*)`", body)
    return found


def test_the_section_lists_both_modules() -> None:
    names = listed_names()
    assert set(names) == {"specdec", "contracts"}
    assert {"DraftContext", "sync_draft_step", "pad_model_rows", "DraftHeads", "DPGroup"} <= set(names["specdec"])
    assert {"StepKind", "BatchFacts", "REJECTED_TOKEN_ID"} <= set(names["contracts"])


@pytest.mark.parametrize(("module", "name"), [(m, n) for m, ns in listed_names().items() for n in ns])
def test_each_listed_name_is_exported(module: str, name: str) -> None:
    mod = importlib.import_module(module)
    assert hasattr(mod, name), f"docs/backend-authors.md lists {name!r} as public in {module!r}, which lacks it"
    assert name in mod.__all__, f"{module}.{name} is importable but not in {module}.__all__"
