"""A drafter's output vocabulary: the rows of the target's LM head it scores (EAGLE-3's draft-to-target map).

On a small target the shared LM head outweighs a drafter's own layer: SmolLM2's
49,152 x 576 head is five times the weights of the drafter's layer and is read in
full for every draft row. The tokens a target actually emits are far fewer, so a
drafter scores only the most frequent ones (chosen from the target's own greedy
labels in the training data). On SmolLM2 (9,881 tokens) tau was unchanged and a
proposal got 0.5-3 ms cheaper (docs/drafters.md). The result stays a full-vocabulary logit row
(``-inf`` off the draft vocabulary), so sampling, the DSpark Markov bias and
the verifier see the shapes they always do: a token the drafter cannot score
gets probability zero, which keeps verification lossless.
"""

from __future__ import annotations

import weakref

import torch
from jaxtyping import Float, Int
from torch import Tensor

from specdec.nn.packed_linear import PackedLinear
from specdec.nn.transformer import Transformer


class DraftVocab:
    """Sorted, unique target token ids a drafter scores; the sub-head is cut from the target's LM head on demand."""

    def __init__(self, ids: Int[Tensor, " draft_vocab"], vocab_size: int) -> None:
        ids = ids.to(torch.long).flatten()
        if ids.numel() == 0:
            raise ValueError("a draft vocabulary needs at least one token id")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(
                f"draft vocabulary ids must lie in [0, {vocab_size}) (the target's vocabulary), "
                f"got [{int(ids.min())}, {int(ids.max())}]"
            )
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("draft vocabulary ids must be sorted and unique")
        self.ids = ids
        self.vocab_size = vocab_size
        self._cuts: dict[int, tuple[weakref.ref[Tensor], tuple[int, int, torch.device], Tensor]] = {}
        """Per weight (by ``id``, held weakly): the source it was cut from (storage, version, device) and its rows."""
        self._packed = PackedLinear()

    def rows(self, weight: Float[Tensor, "vocab width"]) -> Float[Tensor, "draft_vocab width"]:
        """``weight``'s rows for this vocabulary (a vocabulary-indexed matrix: the LM head, DSpark's Markov ``W2``),
        cut once and again when the weight is replaced or modified in place."""
        source = (weight.data_ptr(), weight._version, weight.device)
        cut = self._cuts.get(id(weight))
        if cut is None or cut[0]() is not weight or cut[1] != source:
            with torch.inference_mode(False):  # a normal tensor: a packed copy of it tracks its version
                rows = weight.detach()[self.ids.to(weight.device)].contiguous()
            # Tensors compare elementwise, so weights are keyed by id; entries of weights since freed are dropped.
            self._cuts = {k: c for k, c in self._cuts.items() if c[0]() is not None}
            cut = self._cuts[id(weight)] = (weakref.ref(weight), source, rows)
        return cut[2]

    def head(self, target: Transformer) -> Float[Tensor, "draft_vocab hidden"]:
        """The target LM head's rows for this vocabulary, cut again when the target's head weight changes."""
        return self.rows(target.lm_head_weight)

    def prepare(self, target: Transformer) -> None:
        """Cut and pack the sub-head at load time: ~20 ms on a CPU that the first draft step would pay otherwise."""
        self._packed.prepare((self.head(target),))

    def logits(self, target: Transformer, normed: Float[Tensor, "rows hidden"]) -> Float[Tensor, "rows vocab"]:
        """Float32 logits over the whole vocabulary: the target head's values on the draft ids, ``-inf`` elsewhere.

        Inference only (the sub-head is detached); training scores through
        ``backends.training.vocab`` instead.
        """
        if self.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"this draft vocabulary indexes a vocabulary of {self.vocab_size}, "
                f"the target has {target.config.vocab_size}"
            )
        sub = self._packed.run(normed, (self.head(target),))[0].float()
        out = torch.full((normed.shape[0], self.vocab_size), float("-inf"), device=normed.device)
        if self.ids.device != normed.device:  # once: no host-to-device copy per draft step afterwards
            self.ids = self.ids.to(normed.device)
        out.index_copy_(1, self.ids, sub)
        return out


def most_frequent(labels: Int[Tensor, "*shape"], size: int, vocab_size: int) -> Int[Tensor, " size"]:
    """The ``size`` most frequent ids of ``labels`` (ties to the lower id), sorted; fewer if fewer occur."""
    if size < 1:
        raise ValueError(f"a draft vocabulary needs at least one token, got size {size}")
    counts = torch.bincount(labels.flatten().to(torch.long), minlength=vocab_size)
    occurring = int((counts > 0).sum())
    order = torch.argsort(-counts, stable=True)[: min(size, occurring)]
    return order.sort().values


def coverage(ids: Int[Tensor, " draft_vocab"], labels: Int[Tensor, "*shape"], vocab_size: int) -> float:
    """Share of ``labels`` that fall inside the draft vocabulary ``ids``."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[ids.to(torch.long)] = True
    flat = labels.flatten().to(torch.long)
    return float(inside[flat].float().mean()) if flat.numel() else 1.0


def head_logits(
    target: Transformer, vocab: DraftVocab | None, normed: Float[Tensor, "rows hidden"]
) -> Float[Tensor, "rows vocab"]:
    """A drafter's logits: through its draft vocabulary when it has one, else the target's full LM head."""
    return target.compute_logits(normed) if vocab is None else vocab.logits(target, normed)
