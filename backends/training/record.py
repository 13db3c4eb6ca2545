"""The command a written drafter file records: exact, but naming its files without machine paths.

Files ship with the package, so their metadata must not carry the folder a
run happened to use on the machine that trained them. The recorded command
names every file it read or wrote relative to the folder it ran in; where
some lay outside that folder, relative to the folder that held them all
(run it from there); where they share no folder below the root, by file name.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from pathlib import Path

PATH_OPTIONS = frozenset({"--features", "--out", "--init", "--losses", "--file", "--weights"})
"""Options of ``specdec train`` whose value is a file (``--weights`` may also be ``random``)."""

NOT_A_PATH = frozenset({"random"})


def recorded_argv(argv: Sequence[str], cwd: Path) -> list[str]:
    """``argv`` with the file arguments rewritten as the docstring of this module says; other arguments unchanged."""
    spots: list[tuple[int, str, str]] = []  # (index in argv, "--opt=" or "", value)
    for i, token in enumerate(argv):
        option, eq, value = token.partition("=")
        if eq and option in PATH_OPTIONS:
            spots.append((i, option + "=", value))
        elif token in PATH_OPTIONS and i + 1 < len(argv):
            spots.append((i + 1, "", argv[i + 1]))
    files = {i: Path(os.path.abspath(cwd / value)) for i, _, value in spots if value not in NOT_A_PATH}
    if not files:
        return list(argv)
    base = cwd if all(p.is_relative_to(cwd) for p in files.values()) else Path(os.path.commonpath(files.values()))
    if base in files.values():  # one file alone: its folder
        base = base.parent
    out = list(argv)
    for i, prefix, _ in spots:
        if i in files:
            path = files[i]
            shown = path.name if base == Path(base.anchor) else path.relative_to(base).as_posix()
            out[i] = prefix + shown
    return out


def command_line(prog: str, argv: Sequence[str], cwd: Path | None = None) -> str:
    """The command that ran, for a file's record: ``prog`` and its arguments, files named by ``recorded_argv``."""
    return f"{prog} " + shlex.join(recorded_argv(argv, Path.cwd() if cwd is None else cwd))
