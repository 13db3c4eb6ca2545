"""``--backend-option/-O KEY=VALUE``: a backend factory's own options (DSpark's capacity, thresholds) from the CLI.

VALUE is read as what it looks like: ``true``/``false`` a bool, then an
integer, then a number, else text. The keys are checked against the factory's
signature the way ``specdec.LLM`` checks a ``speculative_config``, so a key the
backend does not take is a usage error listing the ones it does.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from specdec.cli.errors import UsageError

OptionValue = bool | int | float | str


def backend_option(text: str) -> tuple[str, OptionValue]:
    """An argparse type: ``KEY=VALUE`` with VALUE typed."""
    key, eq, raw = text.partition("=")
    key = key.strip()
    if not eq or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (e.g. capacity=8, fused=true)")
    return key, typed_value(raw.strip())


backend_option.__name__ = "KEY=VALUE"


def add_backend_option(p: argparse.ArgumentParser, help: str) -> None:
    """``--backend-option/-O KEY=VALUE`` (repeatable), collected into ``args.backend_option``."""
    p.add_argument(
        "--backend-option",
        "-O",
        dest="backend_option",
        action="append",
        type=backend_option,
        metavar="KEY=VALUE",
        help=help,
    )


def typed_value(raw: str) -> OptionValue:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def collect(pairs: Sequence[tuple[str, OptionValue]] | None) -> dict[str, OptionValue]:
    """The options as a dict; a key given twice is a mistake rather than the last one silently winning."""
    options: dict[str, OptionValue] = {}
    for key, value in pairs or ():
        if key in options:
            raise UsageError(f"-O {key} is given twice ({options[key]!r} and {value!r}); give it once")
        options[key] = value
    return options


def checked(backend: str, k: int, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` for ``backend``'s factory, validated by ``specdec.LLM``'s ``speculative_config`` rules."""
    from specdec.backend_registry import factory_for
    from specdec.llm import SpeculativeConfig, factory_options

    valid = factory_options(factory_for(backend))
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise UsageError(
            f"-O {', '.join(unknown)}: not an option of backend {backend!r}; its options: {', '.join(valid) or 'none'}"
        )
    try:
        return SpeculativeConfig.parse({"method": backend, "num_speculative_tokens": k, **options}).options
    except (TypeError, ValueError) as exc:
        raise UsageError(f"-O: {exc}") from None


def refused(options: Mapping[str, Any], exc: BaseException, backend: str | None = None) -> UsageError:
    """A factory's refusal of its ``-O`` values (a wrong type, out of range) as the user's mistake, on one line."""
    given = ", ".join(f"{k}={v!r}" for k, v in options.items())
    reason = " ".join(str(exc).split())  # one line, whatever the factory (or a type checker) wrote
    who = "the backend" if backend is None else f"backend {backend!r}"
    return UsageError(f"{who} refused its options ({given}): {reason}")


def shared_among(
    pairs: Sequence[tuple[str, OptionValue]] | None, backends: Sequence[str], k: int
) -> dict[str, dict[str, Any]]:
    """``-O`` options given once for several backends: each backend's share (the keys its factory takes), validated.

    A key that none of ``backends`` takes is refused, since it would change nothing.
    """
    from specdec.backend_registry import factory_for
    from specdec.llm import factory_options

    options = collect(pairs)
    takes = {b: list(factory_options(factory_for(b))) for b in backends}
    for key in options:
        if not any(key in names for names in takes.values()):
            listed = "; ".join(f"{b}: {', '.join(names) or 'none'}" for b, names in takes.items())
            raise UsageError(f"-O {key}: no compared backend takes it ({listed or 'no backend compared'})")
    return {b: checked(b, k, {key: v for key, v in options.items() if key in names}) for b, names in takes.items()}
