"""The prompt-lookup index: its drafts equal a brute-force search however the history arrives."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.prompt_lookup import SuffixIndex


def reference(history: list[int], next_token: int, k: int, min_match: int, max_match: int) -> list[int]:
    """The latest earlier occurrence of the longest suffix of history + [next] (min..max tokens), copied on."""
    tokens = [*history, next_token]
    if k <= 0:
        return []
    for n in range(max_match, min_match - 1, -1):
        if n > len(tokens) - 1:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                extended = list(tokens)
                for j in range(k):
                    extended.append(extended[start + n + j])
                return extended[len(tokens) :]
    return []


@settings(max_examples=300)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=6),
    min_match=st.integers(1, 3),
    extra=st.integers(0, 2),
    k=st.integers(0, 5),
)
def test_drafts_equal_a_brute_force_search_at_every_prefix(
    tokens: list[int], cuts: list[int], min_match: int, extra: int, k: int
) -> None:
    index = SuffixIndex(min_match=min_match, max_match=min_match + extra)
    # The history arrives in chunks (a step commits several tokens), and is asked about after each one.
    for end in sorted({*(c for c in cuts if c < len(tokens)), max(len(tokens) - 1, 0)}):
        history = tokens[:end]
        index.extend(history)
        nxt = tokens[end] if end < len(tokens) else 0
        assert index.drafts(nxt, k) == reference(history, nxt, k, min_match, min_match + extra)


def test_a_continuation_past_the_history_copies_its_own_drafts() -> None:
    index = SuffixIndex(min_match=2, max_match=3)
    index.extend([7, 1, 2, 1])
    assert index.drafts(2, 5) == [1, 2, 1, 2, 1]  # "1 2" at 1 is followed by 1, then the period repeats
    assert index.drafts(9, 4) == []  # "1 9" never occurred
    index.extend([7, 1, 2, 1, 2, 5, 6])
    assert index.drafts(1, 3) == []  # "6 1" never occurred, and a single "1" is shorter than min_match
    index.extend([7, 1, 2, 1, 2, 5, 6, 1])
    assert index.drafts(2, 3) == [5, 6, 1]  # "1 2" last at 3 (not the suffix itself), followed by "5 6 1"
    assert SuffixIndex(min_match=1, max_match=1).drafts(3, 2) == []  # nothing indexed


def test_the_longest_match_wins_over_a_later_shorter_one() -> None:
    index = SuffixIndex(min_match=1, max_match=3)
    index.extend([1, 2, 3, 9, 8, 3, 4, 1, 2])
    assert index.drafts(3, 1) == [9]  # "1 2 3" at 0, though "3" occurred later at 5 (followed by 4)


def test_a_history_that_changed_is_indexed_anew() -> None:
    index = SuffixIndex(min_match=2, max_match=2)
    index.extend([1, 2, 3, 1])
    assert index.drafts(2, 1) == [3]
    index.extend([4, 5])  # shorter: a preempted request started over
    assert index.tokens == [4, 5] and index.drafts(2, 1) == []
    index.extend([4, 6, 4])  # as long as before and then some, but its last known token differs
    assert index.tokens == [4, 6, 4] and index.drafts(6, 1) == [4]


@pytest.mark.parametrize(("min_match", "max_match"), [(0, 2), (3, 2)])
def test_bad_match_lengths_are_refused(min_match: int, max_match: int) -> None:
    with pytest.raises(ValueError, match="1 <= min_match <= max_match"):
        SuffixIndex(min_match=min_match, max_match=max_match)


def test_a_prefix_of_the_given_tokens_can_be_indexed() -> None:
    """``length``: the engine's tokens end with the next token, which is not committed yet."""
    whole, prefix = SuffixIndex(min_match=1, max_match=2), SuffixIndex(min_match=1, max_match=2)
    whole.extend([4, 5, 4, 6])
    prefix.extend([4, 5, 4, 6, 4], 4)
    assert prefix.tokens == whole.tokens and prefix.drafts(4, 2) == whole.drafts(4, 2) == [6, 4]
