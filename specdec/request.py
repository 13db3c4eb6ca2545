"""A generation request: what was asked, how far it got, and its speculation metrics."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

import torch
from jaxtyping import Float
from torch import Tensor

from specdec.metrics import RequestMetrics
from specdec.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    MAX_TOKENS = "max_tokens"
    STOP_TOKEN = "stop_token"
    MAX_MODEL_LEN = "max_model_len"
    ABORTED = "aborted"
    """The caller stopped it (``Engine.abort``) before any other reason applied."""


class TokenHistory(Sequence[int]):
    """A read-only view of a request's first ``length`` tokens, prompt then output, without copying them.

    Tokens are only ever appended to a request, so a view taken after a step
    keeps showing exactly that step's tokens however long the request grows.
    """

    __slots__ = ("_length", "_output", "_prompt")

    def __init__(self, prompt: list[int], output: list[int], length: int) -> None:
        if not 0 <= length <= len(prompt) + len(output):
            raise ValueError(f"a history of {length} tokens does not fit a request of {len(prompt) + len(output)}")
        self._prompt = prompt
        self._output = output
        self._length = length

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._length))]
        i = index + self._length if index < 0 else index
        if not 0 <= i < self._length:
            raise IndexError(f"token index {index} is outside a history of {self._length} tokens")
        n = len(self._prompt)
        return self._prompt[i] if i < n else self._output[i - n]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(itertools.chain(self._prompt, self._output), self._length)

    def __repr__(self) -> str:
        return f"TokenHistory({list(self)!r})"


@dataclass(eq=False)
class Request:
    """What a user asked for and how far it got (compared by identity: one object per request).

    ``num_computed`` counts tokens whose target KV is committed; the next query
    of a decoding request is ``[last token] + drafts``. Drafts and the proposal
    they were drawn from are kept until the next verification.
    """

    req_id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    drafts: list[int] = field(default_factory=list)
    draft_probs: Float[Tensor, "num_drafts vocab"] | None = None
    draft_sampled_from: Float[Tensor, "num_drafts vocab"] | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"request {self.req_id!r} has an empty prompt; at least one token is needed")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.req_id!r}: max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def history(self, length: int) -> TokenHistory:
        """Its first ``length`` tokens as a view (no copy)."""
        return TokenHistory(self.prompt, self.output, length)

    @property
    def in_prefill(self) -> bool:
        """True while more than the last token is missing from the KV cache (prompt or recompute)."""
        return self.num_computed < self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def clear_drafts(self) -> None:
        self.drafts = []
        self.draft_probs = None
        self.draft_sampled_from = None
