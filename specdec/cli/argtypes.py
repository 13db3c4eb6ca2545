"""argparse ``type=`` callables that bound numbers where they enter, so a bad value is a usage error."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

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
