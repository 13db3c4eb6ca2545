"""User mistakes on the command line: one line, ``specdec: error: ...``, exit status 2, never a traceback.

Each command validates what the user typed where it enters (argument types,
names that must exist, flags that do not combine) and raises ``UsageError``;
``specdec.cli.main`` reports it. A traceback is left for bugs.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

EXIT_USAGE = 2
CONTRACT_MODES = ("off", "shapes", "full")
"""The values ``SPECDEC_CONTRACTS`` and ``--contracts`` take (``contracts.Mode``; a test keeps the two equal)."""


class UsageError(Exception):
    """What the user typed is wrong; the message says what was wrong and what is expected."""


class Parser(argparse.ArgumentParser):
    """argparse's parser, reporting a parsing mistake the same one-line way as ``UsageError``."""

    def error(self, message: str) -> NoReturn:
        report(f"{message} (see `{self.prog} --help`)")
        sys.exit(EXIT_USAGE)


def report(message: str) -> None:
    print(f"specdec: error: {message}", file=sys.stderr)


def check_contract_env(environ: dict[str, str]) -> None:
    """``SPECDEC_CONTRACTS`` holds a mode; checked before any command imports ``contracts`` (which refuses it)."""
    value = environ.get("SPECDEC_CONTRACTS")
    if value is not None and value.strip().lower() not in CONTRACT_MODES:
        raise UsageError(
            f"SPECDEC_CONTRACTS={value!r} is not a contract mode; expected one of {', '.join(CONTRACT_MODES)}"
        )


def check_backend(name: str) -> None:
    """A backend name or ``module:factory`` spec that resolves to a factory (imported now, not at first use)."""
    from specdec.backend_registry import factory_for

    try:
        factory_for(name)
    except (ValueError, ImportError, TypeError) as exc:
        raise UsageError(str(exc)) from None


def check_text(text: str, what: str) -> str:
    """Text that is valid Unicode: bytes that are not UTF-8 reach Python as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UsageError(
            f"{what} is not valid UTF-8 (byte {exc.object[exc.start : exc.end]!r} at {exc.start}); pass UTF-8 text"
        ) from None
    return text


def check_model(name: str) -> None:
    """A catalog model name, or a path that exists (``specdec.hub.load`` takes both)."""
    from pathlib import Path

    from specdec.hub.catalog import KNOWN_MODELS
    from specdec.hub.local import is_path

    if is_path(name):
        if not Path(name).expanduser().exists():
            raise UsageError(f"model {name}: no such file or directory")
    elif name not in KNOWN_MODELS:
        raise UsageError(f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))}, or a path")
