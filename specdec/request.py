"""A generation request: what was asked, how far it got, and its speculation metrics."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

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
