"""Sampling parameters and the one logits → probabilities transform.

Lossless verification compares the target's distribution ``p`` with the
proposal ``q`` a draft token was drawn from, so both must be processed by the
same transform: drafters build their proposals with :func:`probabilities` and
the verifier builds ``p`` with it too. Any difference (say, top-p applied to the
target but not the draft) changes what "lossless" is measured against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Float, Int
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

__all__ = [
    "MAX_TEMPERATURE",
    "MIN_TEMPERATURE",
    "SEARCH_BLOCK",
    "InvalidDistributionError",
    "SamplingParams",
    "probabilities",
    "sample",
    "tokens_at",
]

MIN_TEMPERATURE = float(torch.finfo(torch.float32).tiny)
"""Smallest positive temperature accepted: the smallest normal float32 (about 1.18e-38).

Logits are divided by the temperature in float32: a smaller value rounds to 0
there (1e-50 does), or is a subnormal that GPUs flush to 0, and a division by 0
turns every row into NaN. Down to this bound the division is exact enough: the
row maximum maps to 0 and everything else to a large negative value or -inf,
which softmax turns into (nearly) one-hot, as a temperature near 0 should.
"""
MAX_TEMPERATURE = float(torch.finfo(torch.float32).max)
"""Largest temperature accepted (about 3.4e38): a larger one is +inf in float32, and -inf / inf is NaN."""


class SamplingParams(BaseModel):
    """Per-request settings in vLLM's terms; ``temperature == 0`` means greedy (argmax).

    The sampling fields shape each token's distribution; ``max_tokens``,
    ``stop_token_ids`` and ``seed`` are what ``Engine.add_request`` uses when
    it is not given them itself, and ``stop`` (strings) and ``ignore_eos`` are
    read by ``specdec.LLM``, which detokenizes. Strict validation: ``top_k=True``
    or ``temperature="1"`` are errors rather than silently coerced values; lists
    are accepted where tuples are stored, and vLLM's ``top_k=-1`` (or 0) means all.
    """

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=1)
    """Keep the k most likely tokens (ties at the k-th value are all kept); None keeps all."""
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    """Keep the smallest set of most likely tokens whose mass is >= top_p; None keeps all."""
    max_tokens: int = Field(default=16, ge=1)
    """Tokens to generate at most (vLLM's default, 16)."""
    stop: tuple[str, ...] = ()
    """Text that ends the output when generated; the output stops before it (``specdec.LLM``)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the output, besides the model's own stop tokens; the stop token is kept."""
    ignore_eos: bool = False
    """Generate past the model's own stop tokens (``specdec.LLM``); ``stop_token_ids`` still apply."""
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    """Seed of this request's own generator. The verifier draws from it in steps where this is the only sampled
    request; a step that samples several requests draws from the engine's stream (``EngineConfig.seed``), so a
    run is reproducible as a whole, not each request independently of the others in its batch."""

    @field_validator("top_k", mode="before")
    @classmethod
    def _vllm_all(cls, top_k: object) -> object:
        return None if type(top_k) is int and top_k in (-1, 0) else top_k

    @field_validator("stop", "stop_token_ids", mode="before")
    @classmethod
    def _sequence(cls, value: object) -> object:
        if isinstance(value, str):
            return (value,)
        return tuple(value) if isinstance(value, list) else value

    @field_validator("stop")
    @classmethod
    def _non_empty(cls, stop: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in stop):
            raise ValueError("an empty stop string would end every output at once; remove it")
        return stop

    @field_validator("temperature")
    @classmethod
    def _representable_in_float32(cls, temperature: float) -> float:
        if temperature != 0.0 and temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature {temperature!r} is below {MIN_TEMPERATURE!r}, the smallest accepted positive temperature "
                "(the smallest normal float32: logits are divided by it in float32, where a smaller value is 0); "
                "use 0 for greedy decoding"
            )
        if temperature > MAX_TEMPERATURE:
            raise ValueError(
                f"temperature {temperature!r} is above {MAX_TEMPERATURE!r}, the largest float32 (logits are divided "
                "by it in float32, where a larger value is inf)"
            )
        return temperature

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _per_row(params: SamplingParams | Sequence[SamplingParams], rows: int) -> Sequence[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * rows
    if len(params) != rows:
        raise ValueError(f"got {len(params)} SamplingParams for {rows} logits rows; pass one per row or one for all")
    return params


def probabilities(
    logits: Float[Tensor, "rows vocab"],
    params: SamplingParams | Sequence[SamplingParams],
) -> Float[Tensor, "rows vocab"]:
    """Temperature, then top-k, then top-p, then softmax; greedy rows become one-hot argmax.

    Returns float32 whatever the logits dtype, so the target's ``p`` and a
    drafter's ``q`` are compared at the same precision. Vectorised over rows and
    vocabulary; the only per-row Python work is reading the parameters.
    """
    rows, vocab = logits.shape
    per_row = _per_row(params, rows)
    device = logits.device
    x = logits.float()
    greedy_rows = [p.greedy for p in per_row]
    if all(greedy_rows):
        return torch.nn.functional.one_hot(x.argmax(dim=-1), vocab).to(torch.float32)

    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in per_row], dtype=torch.float32, device=device)
    # Shifting by the row max changes neither softmax nor top-k/top-p and keeps a
    # tiny temperature from overflowing to inf (inf - inf would be NaN).
    scaled = (x - x.amax(dim=-1, keepdim=True)) / temps[:, None]

    use_top_k = any(p.top_k is not None and p.top_k < vocab for p in per_row)
    use_top_p = any(p.top_p is not None and p.top_p < 1.0 for p in per_row)
    if use_top_k or use_top_p:
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
        keep = torch.ones_like(sorted_logits, dtype=torch.bool)
        if use_top_k:
            k = torch.tensor([min(p.top_k or vocab, vocab) for p in per_row], dtype=torch.long, device=device)
            kth = sorted_logits.gather(-1, (k - 1)[:, None])
            keep &= sorted_logits >= kth
        if use_top_p:
            top_p = torch.tensor([p.top_p if p.top_p is not None else 1.0 for p in per_row], device=device)
            probs_sorted = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
            mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
            # A token is kept while the mass strictly before it is still short of top_p:
            # that is the smallest prefix whose mass reaches top_p. top_p == 1 keeps all.
            keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
        keep[:, 0] = True
        keep_vocab = torch.empty_like(keep).scatter_(-1, order, keep)
        scaled = scaled.masked_fill(~keep_vocab, float("-inf"))

    out = scaled.softmax(dim=-1)
    if any(greedy_rows):
        greedy = torch.tensor(greedy_rows, device=device)
        one_hot = torch.nn.functional.one_hot(x.argmax(dim=-1), vocab).to(torch.float32)
        out = torch.where(greedy[:, None], one_hot, out)
    return out


class InvalidDistributionError(RuntimeError):
    """A row handed to :func:`sample` is not a probability distribution."""


SEARCH_BLOCK = 256
"""Tokens per block of the two-level search in ``tokens_at``."""


def tokens_at(probs: Float[Tensor, "rows vocab"], u: Float[Tensor, " rows"]) -> Int[Tensor, " rows"]:
    """Each row's token whose interval of the cumulative distribution holds ``u`` (in [0, 1], a share of the row's mass).

    Token i's interval is [c(i-1), c(i)) with c the running sum, so a token of
    probability 0 has an empty one and is never returned, and ``u = 1`` (or a
    product that rounds up to the mass) returns the last token with mass. The
    sums run in float64: each interval is then its float32 probability to within
    ~1e-12 of the row's mass, where float32 sums would give a token of 2e-8 after
    0.75 of the mass none at all.
    """
    return _tokens_and_mass(probs, u)[0]


def _tokens_and_mass(
    probs: Float[Tensor, "rows vocab"], u: Float[Tensor, " rows"]
) -> tuple[Int[Tensor, " rows"], Float[Tensor, " rows"]]:
    """``tokens_at``, and each row's mass (NaN or inf where the row holds one).

    Two levels: the block of ``SEARCH_BLOCK`` tokens holding ``u``, then the
    token inside it. Running sums over the whole row would write 8 bytes per
    vocabulary entry, a fresh multi-megabyte buffer that the allocator maps
    anew on every call (1.8 ms for 8 rows of 49k, against 0.2 ms when it
    happens to reuse one); the blocks keep every buffer small.
    """
    rows, vocab = probs.shape
    size = SEARCH_BLOCK
    full = vocab // size * size
    sums = [probs[:, :full].reshape(rows, -1, size).sum(dim=-1, dtype=torch.float64)] if full else []
    if full < vocab:
        sums.append(probs[:, full:].sum(dim=-1, keepdim=True, dtype=torch.float64))
    ends = torch.cat(sums, dim=-1).cumsum(dim=-1)
    mass = ends[:, -1:]
    target = torch.minimum(u.to(torch.float64)[:, None] * mass, torch.nextafter(mass, torch.zeros_like(mass)))
    block = torch.searchsorted(ends, target, right=True).clamp_max(ends.shape[1] - 1)
    start = torch.where(block > 0, ends.gather(-1, (block - 1).clamp_min(0)), 0.0)
    ids = block * size + torch.arange(size, device=probs.device)
    inside = torch.where(ids < vocab, probs.gather(-1, ids.clamp_max(vocab - 1)), 0.0).to(torch.float64)
    # Rounding can put the target past the block's own running sum (its sum was taken in another order):
    # the last slot is then returned, and ``sample`` redraws it should it have no mass.
    slot = torch.searchsorted(inside.cumsum(dim=-1), target - start, right=True).clamp_max(size - 1)
    return (block * size + slot).squeeze(-1).clamp_max(vocab - 1), mass.squeeze(-1)


def sample(probs: Float[Tensor, "rows vocab"], generator: torch.Generator | None = None) -> Int[Tensor, " rows"]:
    """One token per row (by inverse CDF, ``tokens_at``); raises :class:`InvalidDistributionError` on a row that is
    not a distribution (rows need not sum to 1).

    ``torch.multinomial`` draws an exponential variate per vocabulary entry on
    the CPU, about 0.8 ms a row at 49k tokens (6.8 ms for a batch of 8, a tenth
    of its step); this draws one uniform per row (0.36 ms for the 8). Should
    rounding ever land a draw on a token of probability 0 (a block's sum and
    its running sum are taken in different orders, and a GPU sums in parallel),
    the check below sees it and that row is drawn again by ``torch.multinomial``.
    The checks share one host read, as ``torch.multinomial``'s own did; fake
    and meta tensors have no values to check.
    """
    rows = probs.shape[0]
    u = torch.rand(rows, generator=generator, dtype=torch.float64, device=probs.device)
    tokens, mass = _tokens_and_mass(probs, u)
    if rows == 0 or probs.device.type == "meta" or is_fake(probs):
        return tokens
    # A NaN anywhere makes the mass NaN, which fails both comparisons; the minimum is 10x cheaper than probs < 0.
    proper = (mass > 0) & (mass < float("inf")) & (probs.amin(dim=-1) >= 0)
    drawn = probs.gather(-1, tokens[:, None]).squeeze(-1) > 0
    if bool((proper & drawn).all()):
        return tokens
    bad = _not_distributions(probs)
    if bad:
        shown = ", ".join(f"row {r}: {fault}" for r, fault in bad[:8])
        more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
        raise InvalidDistributionError(
            f"sample(): {len(bad)} of {rows} rows are not probability distributions ({shown}{more}); "
            "non-finite values usually come from non-finite logits, e.g. a NaN weight or a half-precision overflow"
        )
    redraw = (~drawn).nonzero().squeeze(-1)
    tokens[redraw] = torch.multinomial(probs[redraw], 1, generator=generator).squeeze(-1)
    return tokens


def _not_distributions(probs: Float[Tensor, "rows vocab"]) -> list[tuple[int, str]]:
    """Each row that is not a distribution, with what is wrong with it (read on the host: an error path)."""
    rows = probs.detach().float().cpu()
    found: list[tuple[int, str]] = []
    for r, row in enumerate(rows):
        if bool(row.isnan().any()):
            found.append((r, f"{int(row.isnan().sum())} NaN entries"))
        elif bool(row.isinf().any()):
            found.append((r, f"{int(row.isinf().sum())} infinite entries"))
        elif bool((row < 0).any()):
            found.append((r, f"negative entries (min {float(row.min()):.3g})"))
        elif float(row.sum()) <= 0:
            found.append((r, "no mass (all zero)"))
    return found
