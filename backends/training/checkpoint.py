"""Resumable training: the whole optimisation state in one safetensors file, written every N steps.

A drafter run of an hour or more on a shared CPU can be cut short (a
session ends, a machine is reclaimed). The checkpoint holds everything the
loop needs to go on exactly where it stopped: the trained parameters, AdamW's
moments and step counts, the CPU generator that samples batches, anchors and
vocabulary rows, and the losses so far. Resuming therefore gives the same
weights, bit for bit, as a run that was never interrupted (on the same
machine and thread count). A checkpoint records the run it belongs to
(``identity``: the schedule, the backend, the inputs); one of another run is
refused, never silently continued. It is safetensors, never pickle, and it is
written to a temporary file and renamed, so an interruption while writing
leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT = "specdec-train-checkpoint/1"


@dataclass(frozen=True)
class Resumed:
    """Where a resumed run stands: steps done, their losses, and the wall seconds they took."""

    step: int
    losses: list[float]
    wall_s: float


class TrainCheckpoint:
    """Save the loop's state every ``every`` steps to ``path``; restore it when the file is there."""

    def __init__(self, path: Path | str, *, every: int, identity: Mapping[str, Any]) -> None:
        if every < 1:
            raise ValueError(f"a checkpoint interval must be >= 1 step, got {every}")
        self.path = Path(path)
        self.every = every
        self.identity = json.loads(json.dumps(dict(identity), sort_keys=True))
        """What makes two runs the same run (JSON-normalised, so a loaded one compares equal)."""
        self._started = time.perf_counter()
        self._earlier_wall = 0.0

    def due(self, step: int, steps: int) -> bool:
        """Whether to save after ``step`` (1-based) of ``steps``: every ``every`` steps, never after the last."""
        return step % self.every == 0 and step < steps

    def wall_s(self) -> float:
        """Wall seconds of the whole run, resumed sessions included."""
        return self._earlier_wall + time.perf_counter() - self._started

    def save(
        self,
        step: int,
        params: Sequence[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer,
        generator: torch.Generator,
        losses: Sequence[float],
    ) -> None:
        tensors = {f"param.{i}": p.detach().cpu().contiguous() for i, p in enumerate(params)}
        for i, p in enumerate(params):
            state = optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq", "step"):
                if key in state:
                    tensors[f"adamw.{i}.{key}"] = torch.as_tensor(state[key]).detach().cpu().contiguous()
        tensors["generator"] = generator.get_state()
        tensors["losses"] = torch.tensor(list(losses), dtype=torch.float64)
        metadata = {
            "format": FORMAT,
            "step": str(step),
            "num_params": str(len(params)),
            "wall_s": repr(self.wall_s()),
            "identity": json.dumps(self.identity, sort_keys=True),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        save_file(tensors, str(partial), metadata=metadata)
        os.replace(partial, self.path)

    def restore(
        self,
        params: Sequence[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer,
        generator: torch.Generator,
    ) -> Resumed | None:
        """Load the saved state into ``params``, ``optimizer`` and ``generator``; None when there is no file."""
        if not self.path.exists():
            return None
        with safe_open(str(self.path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"{self.path} is not a training checkpoint (format {meta.get('format')!r})")
            saved = json.loads(meta["identity"])
            if saved != self.identity:
                differ = sorted(k for k in set(saved) | set(self.identity) if saved.get(k) != self.identity.get(k))
                raise ValueError(
                    f"{self.path} is the checkpoint of another run (it differs in {', '.join(differ)}); "
                    "delete it or pass another --checkpoint to start this run afresh"
                )
            if int(meta["num_params"]) != len(params):
                raise ValueError(f"{self.path} holds {meta['num_params']} parameters, this network {len(params)}")
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        with torch.no_grad():
            for i, p in enumerate(params):
                saved_param = tensors[f"param.{i}"]
                if saved_param.shape != p.shape:
                    raise ValueError(
                        f"{self.path}: parameter {i} has shape {tuple(saved_param.shape)}, not {tuple(p.shape)}"
                    )
                p.copy_(saved_param)
        for i, p in enumerate(params):
            state = {
                key: tensors[f"adamw.{i}.{key}"].to(p.device)
                for key in ("exp_avg", "exp_avg_sq", "step")
                if f"adamw.{i}.{key}" in tensors
            }
            if state:
                if "step" in state:
                    state["step"] = state["step"].cpu()  # AdamW keeps its step count on the host
                optimizer.state[p] = state
        generator.set_state(tensors["generator"])
        self._earlier_wall = float(meta["wall_s"])
        self._started = time.perf_counter()
        return Resumed(int(meta["step"]), tensors["losses"].tolist(), self._earlier_wall)
