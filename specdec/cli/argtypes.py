"""argparse ``type=`` callables that bound numbers where they enter, so a bad value is a usage error."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

MAX_SEED = 2**63 - 1
"""torch.Generator seeds are 64-bit: larger values overflow inside torch."""


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer in ``[low, high]`` (no upper bound when ``high`` is None), written as an integer."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"{value} is out of range; expected an integer {bound}")
        return value

    parse.__name__ = "integer"
    return parse


def float_in(low: float, high: float | None = None, *, low_open: bool = False) -> Callable[[str], float]:
    """A finite number in ``[low, high]`` (``(low, high]`` when ``low_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        too_low = value <= low if low_open else value < low
        if not math.isfinite(value) or too_low or (high is not None and value > high):
            left = "(" if low_open else "["
            right = f"{high}]" if high is not None else "inf)"
            raise argparse.ArgumentTypeError(f"{text} is out of range; expected a number in {left}{low}, {right}")
        return value

    parse.__name__ = "number"
    return parse


positive_int = int_in(1)
non_negative_int = int_in(0)
seed = int_in(0, MAX_SEED)


def list_of(
    item: Callable[[str], T] | None = None, *, choices: Sequence[str] | None = None
) -> Callable[[str], list[T]]:
    """The one multi-value convention: an option that may be repeated, each value a comma list.

    Used with ``action="extend"`` and ``default=None``, so ``-b eagle -b dflash,dspark`` gives
    ``["eagle", "dflash", "dspark"]`` and an option not given stays ``None``. Spaces around
    items and empty items are dropped (``"a, ,b,"`` is ``a, b``). Each item is checked by
    ``item`` (e.g. ``positive_int``) or against ``choices``; a bad one names itself and what
    was expected.
    """

    def parse(text: str) -> list[T]:
        values: list[T] = []
        for word in comma_items(text):
            if choices is not None and word not in choices:
                raise argparse.ArgumentTypeError(f"unknown {word!r}; expected some of {', '.join(choices)}")
            values.append(word if item is None else item(word))  # type: ignore[arg-type]
        return values

    parse.__name__ = "list"
    return parse


def comma_items(text: str) -> list[str]:
    """The items of one comma list, stripped, empty ones dropped."""
    return [word for word in (part.strip() for part in text.split(",")) if word]


LIST_HELP = "(repeatable, each a comma list)"
BACKENDS_HELP = f"backends: installed names or module:factory specs {LIST_HELP}"


def add_backends_option(p: argparse.ArgumentParser, help: str) -> None:
    """``--backend/-b`` (``--backends`` is the same option), spelled alike in every command that takes several."""
    p.add_argument(
        "--backend", "-b", "--backends", dest="backends", action="extend", type=list_of(), metavar="NAMES", help=help
    )
