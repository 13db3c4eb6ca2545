"""The runtime's own mutants: realistic bugs in ``specdec``'s code, each injected at run time.

Target attention metadata, the target's logits, KV rollback, the verifier and
the proposal buffers the engine hands it, the draft DP sync and the target step
handed to the drafter. The mutants run against built-in backends by
name (their ``specdec.backends`` entry points), so this module imports no
backend; the built-in drafters' own mutants live next to them
(``backends.testing.mutants``), and ``specdec.testing.corpus`` gathers both.
``expected`` is the invariant meant to catch a bug; ``specdec.testing.mutation``
measures whether it does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

import specdec.attn_metadata
import specdec.engine
import specdec.speculator
import specdec.verifier
from contracts import REJECTED_TOKEN_ID
from specdec.dp_sync import sync_dp
from specdec.nn.transformer import Transformer
from specdec.sampling import sample
from specdec.speculator import DraftContext
from specdec.testing.mutant import Apply, Mutant, constructed, wrapped

# -- target attention metadata (specdec.attn_metadata) --------------------------------------------------------------


def _qsl_pad_minus_one(kw: dict[str, Any]) -> None:
    n, rows = kw["num_reqs"], kw["num_reqs_padded"]
    if rows > n:
        for key in ("query_start_loc", "query_start_loc_cpu"):
            qsl = kw[key].clone()
            qsl[n + 1 :] = -1
            kw[key] = qsl


def _slots_real_only(kw: dict[str, Any]) -> None:
    kw["slot_mapping"] = kw["slot_mapping"][: kw["num_tokens"]]


def _pad_slots_repeat_last(kw: dict[str, Any]) -> None:
    slots, n = kw["slot_mapping"].clone(), kw["num_tokens"]
    if slots.shape[0] > n:
        slots[n:] = slots[n - 1] if n else 0
        kw["slot_mapping"] = slots


def _padded_seq_lens_one(kw: dict[str, Any]) -> None:
    n = kw["num_reqs"]
    if kw["num_reqs_padded"] > n:
        for key in ("seq_lens", "seq_lens_cpu"):
            seq = kw[key].clone()
            seq[n:] = 1
            kw[key] = seq


def _attention_rows_from_model_rows(kw: dict[str, Any]) -> None:
    kw["num_tokens_padded"] = kw["slot_mapping"].shape[0]


def _target_metadata(perturb: Callable[[dict[str, Any]], None]) -> Apply:
    return lambda: wrapped(specdec.attn_metadata, "AttentionMetadata", constructed(perturb))


def _padded_vocab_column_nan(real: Any) -> Any:
    """The lm_head row of the last (padded-vocabulary) token left uninitialised: its logit column holds NaN.

    ``torch.empty`` memory can hold anything; NaN is what makes the bug visible
    in every step (a greedy argmax picks the NaN token, sampling cannot draw).
    """

    def compute_logits(self: Any, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = real(self, hidden).clone()
        logits[:, -1] = float("nan")
        return logits

    return compute_logits


# -- KV rollback ----------------------------------------------------------------------------------------------------


def _no_rollback(real: Any) -> Any:
    """A KV cache manager whose ``truncate`` keeps the rejected positions: the rollback never happens."""

    class NoRollback(real):
        def truncate(self, req_id: str, length: int) -> list[int]:
            self.length(req_id)  # the request must still exist: only the rollback is lost
            return []

    NoRollback.__name__ = NoRollback.__qualname__ = real.__name__
    return NoRollback


# -- verifier -------------------------------------------------------------------------------------------------------


def _bonus_dropped(kw: dict[str, Any]) -> None:
    """After an accepted run the bonus slot keeps the sentinel: ``torch.where`` lost its recovered-token branch."""
    out, accepted = kw["output_token_ids"].clone(), kw["num_accepted"]
    rows = torch.nonzero(accepted > 0).flatten()
    out[rows, accepted[rows]] = REJECTED_TOKEN_ID
    kw["output_token_ids"] = out


def _drafts_trimmed_to_longest(real: Any) -> Any:
    """The engine sizes the draft ids and proposals by the step's longest draft, while still passing K.

    An optimisation gone wrong: with no draft in the step (a prefill) the buffers
    have no columns at all, and the verifier's rows no longer line up with K.
    """

    def verify(inp: Any, params: Any, **kw: Any) -> Any:
        width = max(kw["num_draft_tokens"], default=0)
        if width < inp.draft_token_ids.shape[1]:
            probs = None if inp.draft_probs is None else inp.draft_probs[:, :width]
            inp = dataclasses.replace(inp, draft_token_ids=inp.draft_token_ids[:, :width], draft_probs=probs)
            if kw.get("sampled_from") is not None:
                kw["sampled_from"] = kw["sampled_from"][:, :width]
        return real(inp, params, **kw)

    return verify


# -- draft DP sync --------------------------------------------------------------------------------------------------


def _idle_rank_skips_sync(real: Any) -> Any:
    """A rank with nothing to draft answers its draft sync locally instead of joining its peers' collective."""

    def sync(
        self: Any,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        *,
        allow_piecewise: bool,
        purpose: str,
    ) -> Any:
        if num_tokens == 0 and self.dp_group is not None:
            return sync_dp(None, 0, 0, None, self.capture, allow_piecewise=allow_piecewise, purpose=purpose)
        return real(self, num_reqs, num_tokens, uniform_token_count, allow_piecewise=allow_piecewise, purpose=purpose)

    return sync


# -- the target step handed to the drafter --------------------------------------------------------------------------


def _last_valid_one_early(kw: dict[str, Any]) -> None:
    """``last_valid`` computed as ``qsl[r] + a - 1``: the row before each request's last committed token."""
    kw["last_valid"] = tuple(v - 1 for v in kw["last_valid"])


# -- the corpus -----------------------------------------------------------------------------------------------------


def _close_keeps_finished(real: Any) -> Any:
    """The engine's draft-cache commit forgets to free the requests that finished in this step."""

    def close(name: str, cache: Any, step: Any, running: Any) -> None:
        cache.free = lambda req_id: None  # an instance attribute shadows the method for this call
        try:
            real(name, cache, step, running)
        finally:
            del cache.free

    return close


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "draft-cache-keeps-finished-requests",
        "the engine's commit of a draft cache never frees the requests that finished in the step",
        "dflash",
        "dp",
        "KV-4",
        lambda: wrapped(specdec.speculator, "close_cache", _close_keeps_finished),
    ),
    Mutant(
        "target-qsl-pad-minus-one",
        "target query_start_loc padded with -1 for padded requests instead of the real token total",
        "dflash",
        "graph",
        "PAD-1",
        _target_metadata(_qsl_pad_minus_one),
    ),
    Mutant(
        "target-slot-mapping-short",
        "target slot_mapping built for the real tokens only, shorter than the padded model rows",
        "dflash",
        "dp",
        "KV-3",
        _target_metadata(_slots_real_only),
    ),
    Mutant(
        "target-pad-slot-not-pad",
        "padded target rows repeat the last real slot instead of PAD_SLOT_ID: they would overwrite live KV",
        "dflash",
        "dp",
        "KV-3",
        _target_metadata(_pad_slots_repeat_last),
    ),
    Mutant(
        "target-padded-seq-lens",
        "padded requests given seq_len 1 (a dummy context) instead of 0",
        "dflash",
        "graph",
        "PAD-2",
        _target_metadata(_padded_seq_lens_one),
    ),
    Mutant(
        "target-attention-rows-from-desc",
        "target attention rows set to the model rows (desc.num_tokens) outside FULL: the target-side pad leak",
        "dflash",
        "dp",
        "TGT-7",
        _target_metadata(_attention_rows_from_model_rows),
    ),
    Mutant(
        "target-logits-nan-column",
        "the target's lm_head row of a padded-vocabulary token left uninitialised: its logit column is NaN",
        "dflash",
        "dp",
        "VER-5",
        lambda: wrapped(Transformer, "compute_logits", _padded_vocab_column_nan),
    ),
    Mutant(
        "engine-kv-not-rolled-back",
        "the engine's kv.truncate after verification does nothing: rejected draft positions stay cached",
        "dflash",
        "dp",
        "KV-2",
        lambda: wrapped(specdec.engine, "KVCacheManager", _no_rollback),
    ),
    Mutant(
        "eagle-draft-kv-not-rolled-back",
        "the EAGLE draft cache keeps the rejected rows of its prefill and its speculative decode positions",
        "eagle",
        "dp",
        "KV-2",
        lambda: wrapped(specdec.speculator, "KVCacheManager", _no_rollback),
    ),
    Mutant(
        "engine-last-valid-off-by-one",
        "the engine hands the drafter the row before each request's last committed token (last_valid - 1)",
        "eagle",
        "dp",
        "AR-2",
        lambda: wrapped(specdec.engine, "TargetStep", constructed(_last_valid_one_early)),
    ),
    Mutant(
        "verifier-bonus-dropped",
        "the verifier drops the bonus token after an accepted run (its slot keeps the sentinel)",
        "dflash",
        "acceptance",
        "VER-1",
        lambda: wrapped(specdec.verifier, "VerifierOutput", constructed(_bonus_dropped)),
    ),
    Mutant(
        "engine-drafts-trimmed-to-longest",
        "the engine sizes the draft ids and proposals it hands the verifier by the step's longest draft, not K",
        "eagle",
        "sampling",
        "VER-4",
        lambda: wrapped(specdec.engine, "verify", _drafts_trimmed_to_longest),
    ),
    Mutant(
        "dp-rank-skips-draft-sync",
        "a DP rank with nothing to draft skips the draft sync collective its peers run",
        "dflash",
        "dp",
        "DP-3",
        lambda: wrapped(DraftContext, "sync", _idle_rank_skips_sync),
        also_accepted=("DPCollectiveTimeout",),
        timeout_s=3.0,
    ),
)
"""In the order ``specdec mutate`` runs them, before the installed corpora (``specdec.testing.corpus``)."""


# -- model inputs of the target forward: dtypes, devices, positions (IN-2, IN-3) ------------------------------------


def _slot_mapping_on_meta(kw: dict[str, Any]) -> None:
    """The target slot mapping built by a shape-only factory and never materialised: it lives on the meta device."""
    kw["slot_mapping"] = kw["slot_mapping"].to("meta")


def _padded_positions_minus_one(real: Any) -> Any:
    """Padded target rows get position -1 (a "not a token" marker) instead of a harmless 0."""

    def build(requests: Any, desc: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        positions: torch.Tensor = real(requests, desc, *args, **kwargs).clone()
        positions[sum(r.query_len for r in requests) :] = -1
        return positions

    return build


MODEL_INPUT_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "target-slot-mapping-on-meta",
        "the target slot_mapping is left on the meta device (built by a shape-only factory, never materialised)",
        "dflash",
        "dp",
        "IN-2",
        _target_metadata(_slot_mapping_on_meta),
    ),
    Mutant(
        "target-padded-positions-minus-one",
        "padded target rows get position -1 instead of 0 (rotary embeddings and KV addressing read before the start)",
        "dflash",
        "graph",
        "IN-3",
        lambda: wrapped(specdec.engine, "build_positions", _padded_positions_minus_one),
    ),
)
"""Mutants of the model inputs (IN-*), kept in their own block; ``MUTANTS`` ends with these two blocks."""


# -- the recovered token's distribution (VER-10) --------------------------------------------------------------------


def _residual_sign_swapped(real: Any) -> Any:
    """The residual built as max(0, q - p): the recovered token is drawn from where the drafter over-proposed."""

    def verify_sampled(p: Any, drafts: Any, valid: Any, draft_probs: Any, generator: Any) -> Any:
        accepted, _, rec = real(p, drafts, valid, draft_probs, generator)
        residual = (rec.proposal - rec.target).clamp_min(0.0)
        mass = residual.sum(dim=-1, keepdim=True)
        dist = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), rec.target)
        return accepted, sample(dist, generator), dataclasses.replace(rec, distribution=dist)

    return verify_sampled


DEFINITION_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "verifier-residual-sign-swapped",
        "the verifier's residual is max(0, q - p) instead of max(0, p - q): recovered tokens follow the wrong distribution",
        "eagle",
        "sampling",
        "VER-10",
        lambda: wrapped(specdec.verifier, "_verify_sampled", _residual_sign_swapped),
    ),
)
"""Values the verifier computes that a contract restates by their definition."""

MUTANTS = MUTANTS + MODEL_INPUT_MUTANTS + DEFINITION_MUTANTS
