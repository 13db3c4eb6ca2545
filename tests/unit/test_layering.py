"""The package layering: ``contracts`` imports neither other package, ``specdec`` never imports ``backends``.

Read from the source with ``ast`` rather than by importing, so a lazy import
inside a function (the kind that crept into ``specdec generate`` before the
entry-point registry) is caught as well. An import can also be spelled as a
string resolved later (``pkgutil.resolve_name``, ``mock.patch``, a dotted path
kept in a constant), so the scan flags every string naming a forbidden
package's module too; and a subprocess imports every module of the two
packages to show that none pulls a ``backends`` module in at import time.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = [("contracts", ("specdec", "backends")), ("specdec", ("backends",))]

_STRING_IMPORTERS = ("import_module", "__import__", "resolve_name", "patch")
"""Calls whose first argument is a module path imported by name: ``importlib.import_module``, ``__import__``,
``pkgutil.resolve_name`` and ``mock.patch`` (``"pkg.module.attr"``)."""


def _called_name(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (a module's, class's or function's first statement)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every absolute module an ``import``, ``from ... import`` or a by-name import call names.

    By-name calls are ``importlib.import_module("...")``, ``__import__("...")``,
    ``pkgutil.resolve_name("...")`` and ``mock.patch("...")`` with a literal
    first argument; ``resolve_name``'s ``module:attr`` form is cut at the colon.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif (
            isinstance(node, ast.Call)
            and _called_name(node) in _STRING_IMPORTERS
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value.partition(":")[0]))
    return found


def module_path_strings(path: Path, packages: tuple[str, ...]) -> list[tuple[int, str]]:
    """String constants (f-string parts included, docstrings not) that name a module of one of ``packages``.

    A dotted path kept in a constant and resolved later (``"pkg.module:Class"``)
    is an import the statement scan cannot see.
    """
    pattern = re.compile(rf"(?<![\w.])(?:{'|'.join(map(re.escape, packages))})(?:[.:][A-Za-z_]\w*)+")
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    skip = _docstrings(tree)
    return [
        (node.lineno, match.group(0))
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
        for match in pattern.finditer(node.value)
    ]


def violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        where = path.relative_to(ROOT)
        for line, module in imported_modules(path):
            if module.split(".")[0] in forbidden:
                out.append(f"{where}:{line} imports {module}")
        out.extend(f"{where}:{line} names {text!r} in a string" for line, text in module_path_strings(path, forbidden))
    return out


@pytest.mark.parametrize(("package", "forbidden"), LAYERS)
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


def test_the_scan_sees_imports_spelled_as_strings(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        '"""A docstring may mention backends.dflash.metadata."""\n'
        "import pkgutil\nfrom unittest import mock\n"
        "SPEC = 'backends.autoregressive.speculator'\n"
        "def f():\n"
        "    '''So may a function's: backends.registry:create.'''\n"
        "    pkgutil.resolve_name('backends.dspark.speculator:DSparkSpeculator')\n"
        "    mock.patch('backends.dflash.metadata.block_attention_rows')\n"
        "    return f'{SPEC}:AutoregressiveSpeculator', 'torch.backends.cuda', 'specdec.backends'\n"
    )
    assert [m for _, m in imported_modules(source)][-2:] == [
        "backends.dspark.speculator",
        "backends.dflash.metadata.block_attention_rows",
    ]
    assert [text for _, text in module_path_strings(source, ("backends",))] == [
        "backends.autoregressive.speculator",
        "backends.dspark.speculator:DSparkSpeculator",
        "backends.dflash.metadata.block_attention_rows",
    ]


_IMPORT_EVERYTHING = """
import importlib, json, pkgutil, sys
failed = {}
for package in sys.argv[1:]:
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        try:
            importlib.import_module(info.name)
        except ImportError as e:  # an optional extra that is not installed: not a layering question
            failed[info.name] = repr(e)
print(json.dumps({"loaded": sorted(m for m in sys.modules if m.split(".")[0] in sys.argv[1:]),
                  "backends": sorted(m for m in sys.modules if m == "backends" or m.startswith("backends.")),
                  "failed": failed}))
"""


def imported_at_run_time(packages: tuple[str, ...]) -> dict[str, list[str]]:
    """Import every module of ``packages`` in a fresh interpreter; what got loaded, and any ``backends`` module."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EVERYTHING, *packages],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    result: dict[str, list[str]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_importing_every_specdec_and_contracts_module_loads_no_backend() -> None:
    modules = sorted(str(p.relative_to(ROOT).with_suffix("")).replace("/", ".") for p in ROOT.glob("specdec/**/*.py"))
    result = imported_at_run_time(("contracts", "specdec"))
    assert result["failed"] == {}, result["failed"]
    loaded = set(result["loaded"])
    assert {m.removesuffix(".__init__") for m in modules} <= loaded  # every module really was imported
    assert result["backends"] == []


def test_the_run_time_check_sees_a_backend_import() -> None:
    """The same check on a package that does import a backend (``backends`` itself) reports it."""
    assert "backends.registry" in imported_at_run_time(("backends",))["backends"]
