"""The one parser of comma-separated option values (CLI, bench, bench-phases, pytest plugin, training CLI)."""

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
