"""Free drafts checked against the target's output: acceptance outcomes that cost no verify row.

The adaptive draft length learns a source's acceptance only from drafts it
verified, so a request it leaves at 0 drafts teaches it nothing, and a new
request drafts on the pool's rates until its own outcomes outweigh them: a
batch-8 MT-Bench run after HumanEval chose a request's first prompt-lookup
drafts on HumanEval's pool alone, with no lookup outcome of the request's own.

Some drafts cost nothing to make: a prompt lookup's is a few dictionary reads.
For a request at 0 drafts the policy keeps such a would-be draft
(``FreeDraft``) and checks it against the tokens the target emits next, up to
the first that differs, as verification would have: greedy, a draft is
accepted exactly when it is the target's argmax, which is the token emitted;
sampled, a one-hot draft token is accepted with the target's probability of
it, which is the chance that the target samples it. So such a shadow outcome
has the verified outcome's distribution at any temperature, and it is recorded
under the draft's source like one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class FreeDraft:
    """Drafts a source would give a request at no model cost: they would be its tokens from ``position`` on.

    ``position`` is an index into the request's tokens, prompt then output: the
    number of tokens it had when the draft was made.
    """

    position: int
    tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.position < 1 or not self.tokens:
            raise ValueError(
                f"a free draft needs a position >= 1 (after the prompt's first token) and at least one token, "
                f"got position {self.position} and {len(self.tokens)} token(s)"
            )


@dataclass(frozen=True)
class ShadowOutcome:
    """A free draft's outcome, as a verification would count it: ``num_accepted`` of ``num_drafts``."""

    source: str
    num_drafts: int
    num_accepted: int


@dataclass
class _Shadow:
    source: str
    draft: FreeDraft
    matched: int = 0


class ShadowDrafts:
    """Each request's pending free draft (one at a time), resolved as its tokens come in."""

    def __init__(self) -> None:
        self._pending: dict[str, _Shadow] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._pending

    def start(self, req_id: str, source: str, draft: FreeDraft) -> None:
        """Keep ``draft`` for ``req_id`` unless one is pending: overlapping shadows would count its tokens twice."""
        self._pending.setdefault(req_id, _Shadow(source, draft))

    def observe(self, req_id: str, tokens: Sequence[int]) -> ShadowOutcome | None:
        """The outcome of ``req_id``'s pending draft once ``tokens`` (prompt then output) settle it, else ``None``.

        Tokens are compared by position, so a step that is undone and run again
        compares the same positions again rather than shifting the draft.
        """
        shadow = self._pending.get(req_id)
        if shadow is None:
            return None
        draft = shadow.draft
        while shadow.matched < len(draft.tokens) and draft.position + shadow.matched < len(tokens):
            if tokens[draft.position + shadow.matched] != draft.tokens[shadow.matched]:
                del self._pending[req_id]
                return ShadowOutcome(shadow.source, len(draft.tokens), shadow.matched)
            shadow.matched += 1
        if shadow.matched == len(draft.tokens):
            del self._pending[req_id]
            return ShadowOutcome(shadow.source, shadow.matched, shadow.matched)
        return None

    def drop(self, req_id: str) -> ShadowOutcome | None:
        """Forget ``req_id``'s pending draft (the request ended); the drafts it matched so far are its outcome.

        The positions its output never reached are left out, not counted as
        rejected: a request cut at ``max_tokens`` says nothing about them.
        """
        shadow = self._pending.pop(req_id, None)
        if shadow is None or not shadow.matched:
            return None
        return ShadowOutcome(shadow.source, shadow.matched, shadow.matched)
