"""Several values on the command line: repeatable options, each value a comma list, parsed one way everywhere."""

from __future__ import annotations

import pytest

from specdec.cli.lists import comma_list


@pytest.mark.parametrize(
    ("text", "items"),
    [
        ("eagle,dflash", ["eagle", "dflash"]),
        (" eagle , dflash ", ["eagle", "dflash"]),  # spaces around items
        ("eagle,,dflash,", ["eagle", "dflash"]),  # empty items and a trailing comma
        (", ,", []),
        ("", []),  # given but empty
        ("eagle", ["eagle"]),
        ("1,8", ["1", "8"]),  # numbers stay text; the caller converts and reports bad ones
        ("a b,c", ["a b", "c"]),  # only commas separate
    ],
)
def test_comma_list(text: str, items: list[str]) -> None:
    assert comma_list(text) == items


def test_an_option_not_given_stays_none() -> None:
    assert comma_list(None) is None


def test_the_callers_parse_alike() -> None:
    import argparse

    from specdec.bench.options import add_arguments, options_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = options_from_args(parser.parse_args(["--suites", " humaneval, ,", "--backends", "eagle,,dspark "]))
    assert options.suites == ("humaneval",) and options.backends == ("eagle", "dspark")


# -- the one multi-value convention: repeatable options, each value a comma list --------------------------------

LIST_OPTIONS = {
    "generate": {"--backend"},
    "bench": {"--backend", "--suites", "--batch-sizes", "--temperatures"},
    "bench-phases": {"--backend", "--draft-length"},
    "bench-decode": {"--dtypes"},
    "matrix": {"--backend", "--families", "--tensor-modes"},
    "mutate": {"--mutants"},
    "vllm-check": {"--methods"},
}
"""Every option of the built-in commands that takes several values."""


def test_every_multi_value_option_is_repeatable_and_comma_separated() -> None:
    import argparse

    from specdec.cli.main import COMMANDS, build_parser

    for command, options in LIST_OPTIONS.items():
        parser = build_parser(command, every=False)
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
        found = {a.option_strings[0]: a for a in sub._actions if getattr(a.type, "__name__", None) == "list"}
        assert set(found) == options, command
        for action in found.values():
            assert isinstance(action, argparse._ExtendAction) and action.default is None, (command, action)
        if "--backend" in found:  # spelled alike everywhere
            assert found["--backend"].option_strings == ["--backend", "-b", "--backends"]
    assert set(LIST_OPTIONS) <= set(COMMANDS)


@pytest.mark.parametrize("command", ["bench", "bench-phases", "matrix"])
def test_repeated_and_comma_separated_values_add_up(command: str) -> None:
    from specdec.cli.main import build_parser

    args = build_parser(command, every=False).parse_args([command, "-b", "eagle", "--backends", " dflash,,dspark"])
    assert args.backends == ["eagle", "dflash", "dspark"]
    assert build_parser(command, every=False).parse_args([command]).backends is None  # not given: the default


def test_list_items_are_checked_one_by_one() -> None:
    import argparse

    from specdec.cli.argtypes import list_of, positive_int

    assert list_of(positive_int)("1, 8") == [1, 8]
    with pytest.raises(argparse.ArgumentTypeError, match="0 is out of range"):
        list_of(positive_int)("1,0")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown 'fp16'; expected some of float32, bfloat16"):
        list_of(choices=("float32", "bfloat16"))("float32,fp16")
