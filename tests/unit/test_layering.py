"""The package layering: ``contracts`` imports neither other package, ``specdec`` never imports ``backends``.

Read from the source with ``ast`` rather than by importing, so a lazy import
inside a function (the kind that crept into ``specdec generate`` before the
entry-point registry) is caught as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every absolute module an ``import``, ``from ... import`` or ``importlib.import_module("...")`` names."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, module in imported_modules(path):
            if module.split(".")[0] in forbidden:
                out.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return out


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [("contracts", ("specdec", "backends")), ("specdec", ("backends",))],
)
def test_package_layering(package: str, forbidden: tuple[str, ...]) -> None:
    assert (ROOT / package / "__init__.py").exists()
    assert violations(package, forbidden) == [], f"{package} must not import {forbidden}"


def test_the_scan_sees_imports_inside_functions(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "def f():\n    from backends import create\n    import backends.registry\n"
        "    importlib.import_module('backends.dflash')\nfrom . import x\n"
    )
    assert [m for _, m in imported_modules(source)] == ["backends", "backends.registry", "backends.dflash"]
