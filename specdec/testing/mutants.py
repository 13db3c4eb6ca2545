"""The mutation corpus: realistic bugs in this project's own code, each injected at run time.

A mutant wraps the real function (or the real class a builder constructs) and
perturbs its result the way the bug would, so everything around it runs as
shipped; three use the named fault points of ``specdec.faults``. Applying a
mutant is a context manager that restores the original attribute on exit.

Backend code is named by dotted path and resolved when a mutant is applied,
the way the entry-point registry reaches backends, so ``specdec`` keeps its
layering (it never imports ``backends``). ``expected`` is the invariant meant
to catch the bug; ``specdec.testing.mutation`` measures whether it does.
"""

from __future__ import annotations

import dataclasses
import pkgutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch import Tensor

from contracts import REJECTED_TOKEN_ID
from specdec import faults
from specdec.dp_sync import sync_dp
from specdec.sampling import SamplingParams, probabilities, sample

Apply = Callable[[], AbstractContextManager[None]]

AR_SPEC = "backends.autoregressive.speculator"
AR_CLASS = f"{AR_SPEC}:AutoregressiveSpeculator"
DFLASH_SPEC = "backends.dflash.speculator"
DFLASH_CLASS = f"{DFLASH_SPEC}:DFlashSpeculator"
DSPARK_SPEC = "backends.dspark.speculator"
DSPARK_CLASS = f"{DSPARK_SPEC}:DSparkSpeculator"
DRAFT_CONTEXT = "specdec.speculator:DraftContext"


@dataclass(frozen=True)
class Mutant:
    """One bug pattern, the backend and configuration family it is run against, and what should catch it."""

    name: str
    description: str
    backend: str
    family: str
    expected: str
    """An invariant ID, or ``mismatch`` / an exception type where no contract can see the bug."""
    apply: Apply
    also_accepted: tuple[str, ...] = ()
    """Other outcomes that count as the expected catch (a skipped collective: DP-3 or the timeout it causes)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Backend options fixed for the whole run (on top of the family's own)."""
    timeout_s: float = 20.0
    """DP collective timeout: short where the bug makes ranks wait on each other."""

    def accepts(self, caught_by: str | None) -> bool:
        return caught_by is not None and (caught_by == self.expected or caught_by in self.also_accepted)


# -- injection helpers -------------------------------------------------------------------------------------------


def resolve(path: str) -> Any:
    """``package.module:Attr`` (or a module) by name, imported now."""
    return pkgutil.resolve_name(path)


@contextmanager
def wrapped(owner_path: str, attr: str, wrap: Callable[[Any], Any]) -> Iterator[None]:
    """Replace ``owner.attr`` by ``wrap(real)`` for the block; ``mock`` restores it (or its absence) on exit."""
    owner = resolve(owner_path)
    with mock.patch.object(owner, attr, wrap(getattr(owner, attr))):
        yield


def _constructed(perturb: Callable[[dict[str, Any]], None]) -> Callable[[Any], Any]:
    """A subclass of the real (data)class whose constructor perturbs its keyword arguments first.

    Patched in as the name a builder constructs, it lets the builder's own
    contract check (which runs on the object it built) see the bug.
    """

    def wrap(real: Any) -> Any:
        class Mutated(real):
            def __init__(self, **kw: Any) -> None:
                perturb(kw)
                super().__init__(**kw)

        Mutated.__name__ = Mutated.__qualname__ = real.__name__
        return Mutated

    return wrap


# -- target attention metadata (specdec.attn_metadata) -----------------------------------------------------------


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
    return lambda: wrapped("specdec.attn_metadata", "AttentionMetadata", _constructed(perturb))


# -- KV rollback -------------------------------------------------------------------------------------------------


def _no_rollback(real: Any) -> Any:
    """A KV cache manager whose ``truncate`` keeps the rejected positions: the rollback never happens."""

    class NoRollback(real):
        def truncate(self, req_id: str, length: int) -> list[int]:
            self.length(req_id)  # the request must still exist: only the rollback is lost
            return []

    NoRollback.__name__ = NoRollback.__qualname__ = real.__name__
    return NoRollback


# -- verifier ----------------------------------------------------------------------------------------------------


def _bonus_dropped(kw: dict[str, Any]) -> None:
    """After an accepted run the bonus slot keeps the sentinel: ``torch.where`` lost its recovered-token branch."""
    out, accepted = kw["output_token_ids"].clone(), kw["num_accepted"]
    rows = torch.nonzero(accepted > 0).flatten()
    out[rows, accepted[rows]] = REJECTED_TOKEN_ID
    kw["output_token_ids"] = out


# -- draft DP sync -----------------------------------------------------------------------------------------------


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


def _decode_sync_without_uniform(real: Any) -> Any:
    """The draft decode sync does not say its batch is uniform (one query per request), as a target step would."""

    def sync(
        self: Any,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        *,
        allow_piecewise: bool,
        purpose: str,
    ) -> Any:
        if purpose == "draft_decode":
            uniform_token_count = None
        return real(self, num_reqs, num_tokens, uniform_token_count, allow_piecewise=allow_piecewise, purpose=purpose)

    return sync


# -- autoregressive drafter --------------------------------------------------------------------------------------


def _decode_metadata_one_behind(real: Any) -> Any:
    """Step k's metadata built before its position was advanced: seq_lens and the KV slot one behind the query."""

    def build(desc: Any, req_ids: Any, positions: list[int], kv: Any, max_model_len: int, device: torch.device) -> Any:
        return real(desc, req_ids, [p - 1 for p in positions], kv, max_model_len, device)

    return build


def _prefill_on_real_rows(real: Any) -> Any:
    """The draft prefill runs on the target step cut to its real tokens: ids, positions and hidden states."""

    def prefill(self: Any, step: Any, ctx: Any) -> Any:
        n, out = step.num_tokens, step.output
        cut = dataclasses.replace(
            out, hidden_states=out.hidden_states[:n], aux_hidden_states=tuple(a[:n] for a in out.aux_hidden_states)
        )
        return real(
            self, dataclasses.replace(step, input_ids=step.input_ids[:n], positions=step.positions[:n], output=cut), ctx
        )

    return prefill


def _rows_own_length(real: Any) -> Any:
    """Padding helpers that pad to their own length: decode inputs stay at the request count, not the DP rows."""

    def pad(values: Any, rows: int, *args: Any) -> Tensor:
        out: Tensor = real(values, len(values), *args)
        return out

    return pad


@contextmanager
def _all(*applies: Apply) -> Iterator[None]:
    """One bug spread over several helpers, applied (and restored) together."""
    with ExitStack() as stack:
        for apply in applies:
            stack.enter_context(apply())
        yield


def _drawn_before_transform(real: Any) -> Any:
    """Drafts sampled from the raw softmax while the temperature/top-k/top-p proposal is reported."""

    def draw(self: Any, logits: Tensor, params: list[SamplingParams]) -> tuple[Tensor, Tensor]:
        drawn, q = real(self, logits, params)
        if not params or self.argmax_drafts:
            return drawn, q
        return sample(logits.float().softmax(-1), self.generator), q

    return draw


def _last_valid_one_early(kw: dict[str, Any]) -> None:
    """``last_valid`` computed as ``qsl[r] + a - 1``: the row before each request's last committed token."""
    kw["last_valid"] = tuple(v - 1 for v in kw["last_valid"])


# -- block drafters ----------------------------------------------------------------------------------------------


def _context_every_row(real: Any) -> Any:
    """Context slots for every target row, rejected drafts and finished requests included (no ``p < end``)."""

    def slots(self: Any, step: Any) -> list[int]:
        out: list[int] = real(self, step)
        self.kv.ensure_capacities({s.req_id: s.seq_len for s in step.scheduled})
        row = 0
        for s in step.scheduled:
            out[row : row + s.query_len] = self.kv.slot_mapping(s.req_id, range(s.num_computed_tokens, s.seq_len))
            row += s.query_len
        return out

    return slots


def _block_qsl_padded_requests(real: Any) -> Any:
    """``query_start_loc = r * q`` for every row: padded requests get q queries instead of none."""

    def build(
        desc: Any,
        req_ids: Any,
        base_positions: Any,
        q: int,
        kv: Any,
        max_model_len: int,
        device: torch.device,
    ) -> Any:
        meta = real(desc, req_ids, base_positions, q, kv, max_model_len, device)
        qsl = [r * q for r in range(meta.num_reqs_padded + 1)]
        return dataclasses.replace(
            meta,
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=meta.query_start_loc.device),
            query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
        )

    return build


def _block_at_last_verified(real: Any) -> Any:
    """Block positions ``P + j`` instead of ``P + 1 + j``: the block starts on the last verified token."""

    def inputs(self: Any, step: Any, drafting: list[int], rows: int, max_model_len: int) -> tuple[Tensor, Tensor]:
        ids, positions = real(self, step, drafting, rows, max_model_len)
        n = len(drafting) * self.query_width
        positions = positions.clone()
        positions[:n] -= 1
        return ids, positions

    return inputs


def _markov_from_zero(real: Any) -> Any:
    """The chain state is initialised to token 0 instead of the anchor."""

    def start(self: Any, anchors: Tensor) -> Tensor:
        return torch.zeros_like(real(self, anchors))

    return start


def _backbone_proposal(real: Any) -> Any:
    """The verifier gets ``softmax(U_k)`` (through the sampling transform), not the Markov-corrected q."""

    def proposal(self: Any, corrected: Tensor, backbone: Tensor, params: list[SamplingParams]) -> Tensor:
        real(self, corrected, backbone, params)
        m, k, vocab = backbone.shape
        per_row = [p for p in params for _ in range(k)]
        return probabilities(backbone.float().reshape(m * k, vocab), per_row).view(m, k, vocab)

    return proposal


def _right_aligned_mask(real: Any) -> Any:
    """The capacity mask right-aligned (a left-padding convention): the last ``c`` slots instead of the first."""

    def mask(capacity: Tensor, k: int) -> Tensor:
        out: Tensor = real(capacity, k).flip(-1)
        return out

    return mask


# -- the corpus --------------------------------------------------------------------------------------------------

MUTANTS: tuple[Mutant, ...] = (
    # The DP-padding leak into draft attention metadata, in each drafter family.
    Mutant(
        "eagle-dp-pad-decode-attention",
        "AR draft decode attention rows from desc.num_tokens, which includes the DP pad (the motivating vLLM bug)",
        "eagle",
        "dp",
        "AR-5",
        lambda: faults.inject("ar_decode_attention_rows_from_desc"),
    ),
    Mutant(
        "dflash-dp-pad-block-attention",
        "DFlash block attention rows from desc.num_tokens outside FULL, DP pad included (the follow-up vLLM bug)",
        "dflash",
        "dp",
        "BLK-3",
        lambda: faults.inject("block_attention_rows_from_desc"),
    ),
    Mutant(
        "dspark-dp-pad-block-attention",
        "the same DP-padding leak through DSpark's anchor-first block metadata",
        "dspark",
        "dp",
        "BLK-3",
        lambda: faults.inject("block_attention_rows_from_desc"),
    ),
    # The target's metadata builder (specdec.attn_metadata).
    Mutant(
        "target-qsl-pad-minus-one",
        "target query_start_loc padded with -1 for padded requests instead of the real token total",
        "dflash",
        "graph",
        "TGT-2",
        _target_metadata(_qsl_pad_minus_one),
    ),
    Mutant(
        "target-slot-mapping-short",
        "target slot_mapping built for the real tokens only, shorter than the padded model rows",
        "dflash",
        "dp",
        "TGT-4",
        _target_metadata(_slots_real_only),
    ),
    Mutant(
        "target-pad-slot-not-pad",
        "padded target rows repeat the last real slot instead of PAD_SLOT_ID: they would overwrite live KV",
        "dflash",
        "dp",
        "TGT-4",
        _target_metadata(_pad_slots_repeat_last),
    ),
    Mutant(
        "target-padded-seq-lens",
        "padded requests given seq_len 1 (a dummy context) instead of 0",
        "dflash",
        "graph",
        "TGT-3",
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
    # KV caches.
    Mutant(
        "dflash-rejected-context-rows",
        "DFlash writes the context K/V of rejected draft rows (and finished requests) into the draft cache",
        "dflash",
        "dp",
        "BLK-6",
        lambda: wrapped(DFLASH_CLASS, "_context_slots", _context_every_row),
    ),
    Mutant(
        "engine-kv-not-rolled-back",
        "the engine's kv.truncate after verification does nothing: rejected draft positions stay cached",
        "dflash",
        "dp",
        "KV-2",
        lambda: wrapped("specdec.engine", "KVCacheManager", _no_rollback),
    ),
    Mutant(
        "eagle-draft-kv-not-rolled-back",
        "the EAGLE draft cache keeps the rejected rows of its prefill and its speculative decode positions",
        "eagle",
        "dp",
        "KV-2",
        lambda: wrapped("specdec.speculator", "KVCacheManager", _no_rollback),
    ),
    # DSpark.
    Mutant(
        "dspark-markov-start-wrong-token",
        "DSpark's Markov chain starts from token 0 instead of the anchor (the bonus just sampled)",
        "dspark",
        "dp",
        "BLK-8",
        lambda: wrapped(DSPARK_CLASS, "_markov_start", _markov_from_zero),
    ),
    Mutant(
        "dspark-backbone-proposal",
        "DSpark hands the verifier the backbone softmax(U_k) instead of the Markov-corrected q it drew from",
        "dspark",
        "sampling",
        "VER-3",
        lambda: wrapped(DSPARK_CLASS, "_verifier_proposal", _backbone_proposal),
    ),
    Mutant(
        "dspark-capacity-not-prefix",
        "DSpark's capacity mask right-aligned: the last c slots are proposed, not a prefix",
        "dspark",
        "draft-length",
        "BLK-8",
        lambda: wrapped(DSPARK_SPEC, "prefix_mask", _right_aligned_mask),
        # Truncating capacities on every example; the capacity family draws "full" (no truncation) a third of the time.
        options={"capacity": "threshold", "tau": 0.5},
    ),
    # Autoregressive drafters.
    Mutant(
        "draft-model-decode-positions-off-by-one",
        "AR draft decode step k builds its metadata (seq_lens, KV slot) for position P+k-1, one behind its query",
        "draft-model",
        "acceptance",
        "AR-8",
        lambda: wrapped(AR_SPEC, "build_decode_metadata", _decode_metadata_one_behind),
    ),
    Mutant(
        "draft-model-decode-not-uniform",
        "the AR draft decode sync passes no uniform token count (one query per request), as a target step does",
        "draft-model",
        "acceptance",
        "AR-4",
        lambda: wrapped(DRAFT_CONTEXT, "sync", _decode_sync_without_uniform),
    ),
    Mutant(
        "engine-last-valid-off-by-one",
        "the engine hands the drafter the row before each request's last committed token (last_valid - 1)",
        "eagle",
        "dp",
        "AR-2",
        lambda: wrapped("specdec.engine", "TargetStep", _constructed(_last_valid_one_early)),
    ),
    Mutant(
        "eagle-prefill-unpadded",
        "the EAGLE draft prefill runs on the target's real tokens only, not its padded rows (ids, positions, hidden)",
        "eagle",
        "dp",
        "AR-1",
        lambda: wrapped(AR_CLASS, "_prefill", _prefill_on_real_rows),
    ),
    Mutant(
        "eagle-decode-inputs-unpadded",
        "EAGLE decode ids, positions and features padded to the request count, not the DP-padded model rows",
        "eagle",
        "dp",
        "AR-6",
        lambda: _all(
            lambda: wrapped(AR_SPEC, "_pad_ids", _rows_own_length),
            lambda: wrapped(AR_SPEC, "padded_rows", _rows_own_length),
            lambda: wrapped(AR_SPEC, "_pad_features", _rows_own_length),
        ),
    ),
    Mutant(
        "eagle-draft-sampled-before-transform",
        "EAGLE drafts drawn from the raw softmax while the temperature/top-k/top-p proposal is reported",
        "eagle",
        "sampling",
        "VER-3",
        lambda: wrapped(AR_CLASS, "_draw", _drawn_before_transform),
    ),
    # Block drafters.
    Mutant(
        "dspark-block-qsl-padded-requests",
        "block query_start_loc gives padded requests q queries instead of zero-length ranges (shared DFlash code)",
        "dspark",
        "graph",
        "BLK-4",
        lambda: wrapped(DFLASH_SPEC, "build_block_metadata", _block_qsl_padded_requests),
        # q = K = 1: every capture size can hold a FULL block step, the only kind with padded requests.
        options={"num_spec_tokens": 1},
    ),
    Mutant(
        "dflash-block-positions-off-by-one",
        "the DFlash block placed at the last verified position P instead of P + 1",
        "dflash",
        "dp",
        "BLK-5",
        lambda: wrapped(DFLASH_CLASS, "_block_inputs", _block_at_last_verified),
    ),
    # The verifier and DP.
    Mutant(
        "verifier-bonus-dropped",
        "the verifier drops the bonus token after an accepted run (its slot keeps the sentinel)",
        "dflash",
        "acceptance",
        "VER-1",
        lambda: wrapped("specdec.verifier", "VerifierOutput", _constructed(_bonus_dropped)),
    ),
    Mutant(
        "dp-rank-skips-draft-sync",
        "a DP rank with nothing to draft skips the draft sync collective its peers run",
        "dflash",
        "dp",
        "DP-3",
        lambda: wrapped(DRAFT_CONTEXT, "sync", _idle_rank_skips_sync),
        also_accepted=("DPCollectiveTimeout",),
        timeout_s=3.0,
    ),
)

BY_NAME: dict[str, Mutant] = {m.name: m for m in MUTANTS}
assert len(BY_NAME) == len(MUTANTS), "mutant names must be unique"


def get(names: list[str] | tuple[str, ...] | None = None) -> list[Mutant]:
    """The named mutants (all when ``names`` is None), in corpus order; unknown names raise."""
    if names is None:
        return list(MUTANTS)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(f"unknown mutant(s) {unknown}; known: {sorted(BY_NAME)}")
    return [m for m in MUTANTS if m.name in set(names)]


PATCHED_NAMESPACES: tuple[str, ...] = (
    "specdec.attn_metadata",
    "specdec.engine",
    "specdec.speculator",
    "specdec.verifier",
    DRAFT_CONTEXT,
    AR_SPEC,
    AR_CLASS,
    DFLASH_SPEC,
    DFLASH_CLASS,
    DSPARK_SPEC,
    DSPARK_CLASS,
)
"""Every module and class a mutant patches: a test snapshots them to prove that leaving a mutant restores them."""
