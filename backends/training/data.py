"""Training data for drafters: target-generated continuations and the frozen target's per-position features."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from jaxtyping import Float, Int
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from backends.training.checkpoint import TrainCheckpoint
from specdec.nn.transformer import Transformer


@torch.no_grad()
def generate_sequences(
    target: Transformer, num: int, *, prompt_len: int, gen_len: int, seed: int
) -> Int[Tensor, "num seq_len"]:
    """Random prompts continued greedily by the target itself.

    Self-distillation data: a drafter trained on the target's own greedy
    continuations learns exactly what greedy verification accepts.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    vocab = target.config.vocab_size
    out = torch.randint(0, vocab, (num, prompt_len), generator=g).to(target.device)
    rows = []
    for i in range(num):
        seq = out[i]
        for _ in range(gen_len):
            logits = target.compute_logits(target.forward_dense(seq).hidden_states[-1:])
            seq = torch.cat([seq, logits.argmax(-1)])
        rows.append(seq)
    return torch.stack(rows)


class StackedRows:
    """Tensors of equal trailing shape read as one along dim 0, without the copy ``torch.cat`` would make."""

    def __init__(self, parts: Sequence[Tensor | StackedRows]) -> None:
        flat: list[Tensor] = [t for p in parts for t in (p.parts if isinstance(p, StackedRows) else [p])]
        if not flat or len({(tuple(t.shape[1:]), t.dtype, t.device) for t in flat}) != 1:
            raise ValueError("StackedRows needs one or more tensors of one trailing shape, dtype and device")
        self.parts: list[Tensor] = flat
        self.starts = torch.tensor([0, *torch.tensor([len(t) for t in flat]).cumsum(0).tolist()])
        self.shape = torch.Size((int(self.starts[-1]), *flat[0].shape[1:]))
        self.dtype = flat[0].dtype
        self.device = flat[0].device

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Int[Tensor, " n"]) -> Tensor:
        """The rows at ``index`` (a 1-D integer tensor, any order, repeats allowed), gathered part by part."""
        index = torch.as_tensor(index, dtype=torch.long).flatten()
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= len(self)):
            raise IndexError(f"row index out of range for {len(self)} rows")
        part = torch.searchsorted(self.starts, index, right=True) - 1
        out = torch.empty((len(index), *self.shape[1:]), dtype=self.dtype, device=self.device)
        for p in part.unique().tolist():
            at = (part == p).nonzero().flatten()
            out[at] = self.parts[p][index[at] - self.starts[p]]
        return out

    def contiguous(self) -> Tensor:
        """Every row as one tensor (a copy)."""
        return torch.cat(self.parts)


@dataclass(frozen=True, eq=False)
class TargetFeatures:
    """Per-position frozen target outputs of a batch of equal-length sequences, computed once before training.

    Only what the losses read is kept: full logits (``num x seq_len x vocab``)
    do not fit in memory at a real vocabulary, so the target's distribution is
    kept as its top-``k`` tokens and probabilities.
    """

    tokens: Int[Tensor, "num seq_len"]
    aux_layers: tuple[int, ...]
    aux: tuple[Float[Tensor, "num seq_len hidden"] | StackedRows, ...]
    """Outputs of ``aux_layers`` (what inference injects), possibly stored in a narrower dtype; read as ``aux[i][index]``."""
    greedy_next: Int[Tensor, "num seq_len"]
    """The target's own argmax next token at each position (the self-distillation label)."""
    top_ids: Int[Tensor, "num seq_len top"]
    """The target's ``top`` most likely next tokens at each position, most likely first."""
    top_probs: Float[Tensor, "num seq_len top"]
    """Their probabilities (summing to at most 1; the rest of the mass is spread over other tokens)."""

    def __post_init__(self) -> None:
        if len(self.aux) != len(self.aux_layers):
            raise ValueError(f"{len(self.aux)} aux tensors for aux_layers {self.aux_layers}")
        shape = tuple(self.tokens.shape)
        for name, t in [("greedy_next", self.greedy_next), *(("aux", a) for a in self.aux)]:
            if tuple(t.shape[:2]) != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, tokens {shape}")

    def select(self, aux_layers: Sequence[int]) -> TargetFeatures:
        """The same features with only ``aux_layers`` (in that order): one feature file serves every drafter."""
        missing = [layer for layer in aux_layers if layer not in self.aux_layers]
        if missing:
            raise ValueError(f"the features hold target layers {self.aux_layers}; a drafter asks for {missing}")
        aux = tuple(self.aux[self.aux_layers.index(layer)] for layer in aux_layers)
        return TargetFeatures(self.tokens, tuple(aux_layers), aux, self.greedy_next, self.top_ids, self.top_probs)

    @property
    def kind(self) -> tuple[tuple[int, ...], int, int, torch.dtype | None]:
        """What windows must share to be trained on as one set: aux layers, window length, top-k, aux dtype."""
        return (self.aux_layers, self.tokens.shape[1], self.top_ids.shape[2], self.aux[0].dtype if self.aux else None)

    @classmethod
    def concat(cls, parts: Sequence[TargetFeatures]) -> TargetFeatures:
        """Several feature files as one (a stage's new data next to the old), checked to be of one kind.

        The small tensors are concatenated; the hidden states (GBs) stay in
        their files' memory maps (``StackedRows``), which trainers running at
        once share through the page cache instead of copying each.
        """
        if not parts:
            raise ValueError("no features to concatenate")
        first = parts[0]
        for i, part in enumerate(parts[1:], start=1):
            if part.kind != first.kind:
                raise ValueError(
                    f"features {i} has (aux layers, window length, top-k, aux dtype) {part.kind}; the first has "
                    f"{first.kind}"
                )
        if len(parts) == 1:
            return first
        return cls(
            tokens=torch.cat([p.tokens for p in parts]),
            aux_layers=first.aux_layers,
            aux=tuple(StackedRows([p.aux[i] for p in parts]) for i in range(len(first.aux))),
            greedy_next=torch.cat([p.greedy_next for p in parts]),
            top_ids=torch.cat([p.top_ids for p in parts]),
            top_probs=torch.cat([p.top_probs for p in parts]),
        )

    def save(self, path: Path, metadata: Mapping[str, str]) -> None:
        """A safetensors file (never a pickle): the tensors, plus ``aux_layers`` and the caller's metadata."""
        tensors = {
            "tokens": self.tokens,
            "greedy_next": self.greedy_next,
            "top_ids": self.top_ids,
            "top_probs": self.top_probs,
        } | {f"aux.{i}": a if isinstance(a, Tensor) else a.contiguous() for i, a in enumerate(self.aux)}
        meta = dict(metadata) | {"aux_layers": json.dumps(list(self.aux_layers))}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: Path) -> tuple[TargetFeatures, dict[str, str]]:
        """The features and the file's metadata; a clear error for a file that is not a features file."""
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            names = set(f.keys())
            missing = {"tokens", "greedy_next", "top_ids", "top_probs"} - names
            if missing or "aux_layers" not in meta:
                raise ValueError(f"{path} is not a TargetFeatures file: missing {sorted(missing) or ['aux_layers']}")
            layers = tuple(int(layer) for layer in json.loads(meta["aux_layers"]))
            feats = cls(
                tokens=f.get_tensor("tokens"),
                aux_layers=layers,
                aux=tuple(f.get_tensor(f"aux.{i}") for i in range(len(layers))),
                greedy_next=f.get_tensor("greedy_next"),
                top_ids=f.get_tensor("top_ids"),
                top_probs=f.get_tensor("top_probs"),
            )
        return feats, meta


def as_features(
    target: Transformer, data: Int[Tensor, "num seq_len"] | TargetFeatures, aux_layers: Sequence[int]
) -> TargetFeatures:
    """Features for a trainer: computed from token sequences, or precomputed ones narrowed to ``aux_layers``."""
    if isinstance(data, TargetFeatures):
        return data.select(aux_layers)
    return target_features(target, data.to(target.device), aux_layers)


@torch.no_grad()
def target_features(
    target: Transformer,
    tokens: Int[Tensor, "num seq_len"],
    aux_layers: Sequence[int],
    *,
    top_k: int = 8,
    aux_dtype: torch.dtype | None = None,
    autocast: torch.dtype | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> TargetFeatures:
    """Run the frozen target densely over each sequence (no cache), keeping aux hidden states and the top-k.

    ``aux_dtype`` stores the hidden states narrower (bf16 halves a real
    model's feature memory); ``autocast`` runs the target's matmuls in that
    dtype (bf16 is ~3x faster on a CPU with AMX).
    """
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    k = min(top_k, target.config.vocab_size)
    num, seq_len = tokens.shape
    device = target.device
    # Outputs are allocated once and filled in place: appending per-sequence pieces between the large
    # per-sequence temporaries (logits) fragments the heap until the process holds many times the data.
    aux = [
        torch.empty(num, seq_len, target.config.hidden_size, dtype=aux_dtype or target.dtype, device=device)
        for _ in aux_layers
    ]
    top_ids = torch.empty(num, seq_len, k, dtype=torch.long, device=device)
    top_probs = torch.empty(num, seq_len, k, dtype=torch.float32, device=device)
    context = torch.autocast(device.type, dtype=autocast) if autocast is not None else nullcontext()
    for i, seq in enumerate(tokens):
        with context:
            out = target.forward_dense(seq.to(device), aux_layers=aux_layers)
            logits = target.compute_logits(out.hidden_states)
        for j, h in enumerate(out.aux_hidden_states):
            aux[j][i] = h
        probs, ids = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
        top_ids[i] = ids
        top_probs[i] = probs
        del out, logits, probs, ids
        if progress is not None:
            progress(i + 1, num)
    return TargetFeatures(tokens, tuple(aux_layers), tuple(aux), top_ids[:, :, 0].clone(), top_ids, top_probs)


@dataclass(frozen=True, kw_only=True)
class TrainSchedule:
    """How a drafter is optimised: the settings every trainer shares, checked once.

    The EAGLE, DFlash and DSpark trainers differ in their networks and losses
    but not in how they are optimised, so these settings live here instead of
    in three repeated keyword lists; ``run_adamw`` reads them. ``seed`` drives
    the batch, anchor and vocabulary sampling (not the weights' initialisation).
    With ``warmup > 0`` the learning rate ramps up linearly for ``warmup``
    steps and then decays on a cosine to 10% (``lr_factor``); without, it is
    constant. ``autocast`` runs the forward in that dtype (weights and
    optimizer stay fp32); ``clip`` caps the gradient norm. ``keep_top`` and
    ``negatives`` score against a vocabulary subset (``head_sampler``):
    ``keep_top=None`` is the whole vocabulary.
    """

    steps: int
    lr: float = 3e-3
    seed: int = 0
    batch_size: int = 8
    warmup: int = 0
    clip: float | None = None
    autocast: torch.dtype | None = None
    keep_top: int | None = None
    negatives: int = 0

    def __post_init__(self) -> None:
        problems = [
            f"{name} must be {rule}, got {value!r}"
            for name, value, ok, rule in [
                ("steps", self.steps, self.steps >= 1, ">= 1"),
                ("lr", self.lr, 0 < self.lr < math.inf, "> 0 and finite"),
                ("batch_size", self.batch_size, self.batch_size >= 1, ">= 1"),
                ("warmup", self.warmup, self.warmup >= 0, ">= 0"),
                ("clip", self.clip, self.clip is None or 0 < self.clip < math.inf, "None or > 0 and finite"),
                ("keep_top", self.keep_top, self.keep_top is None or self.keep_top >= 1, "None or >= 1"),
                ("negatives", self.negatives, self.negatives >= 0, ">= 0"),
            ]
            if not ok
        ]
        if problems:
            raise ValueError("invalid TrainSchedule: " + "; ".join(problems))


def run_adamw(
    params: Sequence[torch.nn.Parameter],
    schedule: TrainSchedule,
    *,
    num_sequences: int,
    batch_loss: Callable[[Int[Tensor, " batch"], torch.Generator], Tensor],
    name: str,
    on_step: Callable[[int, float], None] | None = None,
    checkpoint: TrainCheckpoint | None = None,
) -> list[float]:
    """The optimisation loop every drafter trainer shares: sample sequences, step AdamW, stop on divergence.

    ``batch_loss`` gets the sampled sequence indices and the CPU generator (for
    anchors), so a run is reproducible from ``schedule.seed`` on any device.
    ``on_step(step, loss)`` is called after each step (1-based), for progress logs.
    ``schedule.keep_top``/``negatives`` are the trainer's to apply (they shape ``batch_loss``).
    ``checkpoint`` saves the loop's whole state every few steps and, when its
    file exists, resumes from it (the returned losses then include the earlier ones).
    """
    device = params[0].device if params else torch.device("cpu")
    g = torch.Generator(device="cpu").manual_seed(schedule.seed)
    losses: list[float] = []
    opt = torch.optim.AdamW(params, lr=schedule.lr, weight_decay=0.0)
    first = 0
    if checkpoint is not None:
        resumed = checkpoint.restore(params, opt, g)
        if resumed is not None:
            first, losses = resumed.step, resumed.losses
    for step in range(first, schedule.steps):
        if schedule.warmup:
            for group in opt.param_groups:
                group["lr"] = schedule.lr * lr_factor(step, schedule.steps, schedule.warmup)
        index = torch.randint(0, num_sequences, (min(schedule.batch_size, num_sequences),), generator=g).to(device)
        with torch.autocast(device.type, dtype=schedule.autocast) if schedule.autocast is not None else nullcontext():
            loss = batch_loss(index, g)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if schedule.clip is not None:
            torch.nn.utils.clip_grad_norm_(params, schedule.clip)
        opt.step()
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"{name} training diverged at step {len(losses)}: loss {losses[-1]}")
        if checkpoint is not None and checkpoint.due(step + 1, schedule.steps):
            checkpoint.save(step + 1, params, opt, g, losses)
        if on_step is not None:
            on_step(step + 1, losses[-1])
    return losses


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Learning-rate factor: linear warmup, then cosine decay to 0.1 at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    done = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * done))
