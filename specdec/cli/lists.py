"""Comma-separated option values (``--backends eagle,dflash``), parsed one way everywhere.

The ``specdec`` command line, ``specdec bench``, ``specdec bench-phases``, the
pytest plugin's options and the training command line all take lists this way.
"""

from __future__ import annotations

from typing import overload


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
    return [item for item in (part.strip() for part in text.split(",")) if item]
