"""Prompt lookup: drafts copied from where a request's latest tokens occurred before in its own history.

Code and edits repeat their context (names, signatures, a line quoted from the
prompt), and where the last few tokens occurred earlier, what followed them
then is a good guess for what follows now, at no model cost. The index keeps,
per n-gram of the committed tokens, its latest start, and is extended only
by the tokens committed since the last step, so a lookup costs a few dict
reads however long the request is.
"""

from __future__ import annotations

from collections.abc import Sequence


def check_match_lengths(min_match: int, max_match: int) -> None:
    if not 1 <= min_match <= max_match:
        raise ValueError(f"match lengths need 1 <= min_match <= max_match, got {min_match} and {max_match}")


class SuffixIndex:
    """One request's n-grams (``min_match`` to ``max_match`` tokens) and where each last started."""

    def __init__(self, *, min_match: int, max_match: int) -> None:
        check_match_lengths(min_match, max_match)
        self.min_match = min_match
        self.max_match = max_match
        self.tokens: list[int] = []
        """The committed tokens indexed so far (a copy: the engine's view is read-only and grows in place)."""
        self._starts: dict[tuple[int, ...], int] = {}

    def extend(self, committed: Sequence[int], length: int | None = None) -> None:
        """Index the first ``length`` (all) tokens of ``committed`` past the ones indexed; a history that changed
        is indexed anew."""
        end = len(committed) if length is None else length
        known = len(self.tokens)
        if end < known or (known and committed[known - 1] != self.tokens[-1]):
            self.tokens, self._starts, known = [], {}, 0
        self.tokens.extend(int(t) for t in committed[known:end])
        tokens, starts = self.tokens, self._starts
        for stop in range(known + 1, len(tokens) + 1):
            for n in range(self.min_match, min(self.max_match, stop) + 1):
                starts[tuple(tokens[stop - n : stop])] = stop - n

    def drafts(self, next_token: int, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix of the
        committed tokens plus ``next_token``; none without a match of at least ``min_match`` tokens.

        A continuation that runs into the end of the history goes on as a copy
        would, from its own drafts, so a repeat with a short period still gives
        ``k`` drafts.
        """
        if k <= 0:
            return []
        history = self.tokens
        for n in range(min(self.max_match, len(history) + 1), self.min_match - 1, -1):
            start = self._starts.get((*history[len(history) - n + 1 :], next_token))
            if start is None:
                continue
            out: list[int] = []
            length = len(history) + 1
            for j in range(k):
                i = start + n + j
                out.append(history[i] if i < len(history) else next_token if i == len(history) else out[i - length])
            return out
        return []
