"""Comma-separated option values, parsed one way everywhere.

The command line takes several values the way ``specdec.cli.argtypes.list_of``
says (an option may be repeated, each value a comma list); ``comma_list`` is the
same item rule for a value that arrives as one string (the pytest plugin's
options, the training command line).
"""

from __future__ import annotations

from typing import overload

from specdec.cli.argtypes import comma_items


@overload
def comma_list(text: str) -> list[str]: ...


@overload
def comma_list(text: None) -> None: ...


@overload
def comma_list(text: str | None) -> list[str] | None: ...


def comma_list(text: str | None) -> list[str] | None:
    """The items of ``text`` stripped of spaces, empty items dropped (``"a, ,b,"`` is ``["a", "b"]``).

    ``None`` (an option not given) stays ``None``, so a caller can tell "not
    given" from "given empty" (``""``, which is ``[]``).
    """
    if text is None:
        return None
    return comma_items(text)
