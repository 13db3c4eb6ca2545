"""The reference transformer: paged steps equal a no-cache forward, padding is inert, kernels validate like kernels.

The oracle is ``Transformer.forward_dense``: one sequence, no cache, attention
through ``scaled_dot_product_attention``. Every paged configuration (chunked
prefill, mixed batches, graph padding, irregular block tables) must reproduce
its logits.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts import PAD_SLOT_ID, AttentionMetadata, BatchExecutionDescriptor, CUDAGraphMode
from specdec.attn_metadata import ScheduledRequest, build_positions, build_target_metadata, reserve
from specdec.dp_group import DPGroup, InProcessDPGroup, in_process_world, run_ranks
from specdec.kv_cache import KVCacheManager
from specdec.kv_storage import PagedKVStorage
from specdec.nn import IndexerConfig, ModelConfig, ModelOutput, MoEConfig, Transformer, paged_attention
from specdec.nn.attention import query_rows_metadata
from specdec.nn.layers import stream_seed
from specdec.nn.packed_linear import (
    ROW_INVARIANT_ROWS,
    PackedLinear,
    mkldnn_available,
    mkldnn_bf16_available,
)

ATOL = 1e-4


CONFIG = ModelConfig.tiny()
MODEL = Transformer(CONFIG, seed=0)


# -- harness ---------------------------------------------------------------------------------------


@dataclass
class Step:
    """One scheduled forward: new tokens per request, and how the descriptor pads it."""

    chunks: list[tuple[str, list[int]]]
    mode: str = "NONE"  # NONE, PIECEWISE (token padding) or FULL (token and request padding)
    pad_tokens: int = 0
    pad_reqs: int = 0


@dataclass
class Session:
    """A model with its host cache bookkeeping and cache tensors, run step by step like an engine."""

    model: Transformer
    kvm: KVCacheManager
    kv: PagedKVStorage
    pad_ids: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(123))

    @classmethod
    def new(cls, model: Transformer = MODEL, num_blocks: int = 96, block_size: int = 4) -> Session:
        return cls(model, KVCacheManager(num_blocks, block_size), model.make_kv_storage(num_blocks, block_size))

    def prepare(self, step: Step) -> tuple[list[ScheduledRequest], BatchExecutionDescriptor, AttentionMetadata]:
        for rid, _ in step.chunks:
            if rid not in self.kvm:
                self.kvm.add_request(rid)
        requests = [ScheduledRequest(rid, self.kvm.length(rid), len(toks)) for rid, toks in step.chunks]
        reserve(requests, self.kvm)
        real = sum(r.query_len for r in requests)
        if step.mode == "NONE":
            desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=real, num_reqs=len(requests))
        elif step.mode == "PIECEWISE":
            desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.PIECEWISE, num_tokens=real + step.pad_tokens)
        else:
            desc = BatchExecutionDescriptor(
                cg_mode=CUDAGraphMode.FULL, num_tokens=real + step.pad_tokens, num_reqs=len(requests) + step.pad_reqs
            )
        return requests, desc, build_target_metadata(requests, desc, self.kvm)

    def run(
        self,
        step: Step,
        *,
        dp_group: DPGroup | None = None,
        num_tokens_across_dp: Sequence[int] | None = None,
        **meta_changes: object,
    ) -> list[torch.Tensor]:
        """Run the step; the logits of each request's new tokens. Padded rows get random token ids."""
        requests, desc, meta = self.prepare(step)
        if meta_changes:
            meta = dataclasses.replace(meta, **meta_changes)  # type: ignore[arg-type]
        real = [t for _, toks in step.chunks for t in toks]
        garbage = torch.randint(0, self.model.config.vocab_size, (desc.num_tokens - len(real),), generator=self.pad_ids)
        ids = torch.cat([torch.tensor(real, dtype=torch.int64), garbage])
        positions = build_positions(requests, desc)
        out = self.model(ids, positions, meta, self.kv, dp_group=dp_group, num_tokens_across_dp=num_tokens_across_dp)
        for r in requests:
            self.kvm.set_length(r.req_id, r.seq_len)
        logits = self.model.compute_logits(out.hidden_states[: len(real)])
        return list(logits.split([r.query_len for r in requests]))

    def cached(self, rid: str) -> list[torch.Tensor]:
        """Every layer's cached K and V at the request's positions (to spot a slot overwritten by padding)."""
        slots = torch.tensor(self.kvm.slot_mapping(rid, range(self.kvm.length(rid))), dtype=torch.int64)
        return [
            buf[slots]
            for layer in range(self.model.config.num_layers)
            for buf in (self.kv.key_cache(layer), self.kv.value_cache(layer))
        ]


def dense_logits(model: Transformer, tokens: Sequence[int], causal: bool = True) -> torch.Tensor:
    out = model.forward_dense(torch.tensor(list(tokens), dtype=torch.int64), causal=causal)
    return model.compute_logits(out.hidden_states)


def tokens(seed: int, n: int, vocab: int = CONFIG.vocab_size) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- paged steps equal the dense forward --------------------------------------------------------------


def test_prefill_then_greedy_decode_matches_full_recomputation() -> None:
    session = Session.new()
    seq = tokens(1, 7)
    step_logits = [session.run(Step([("a", seq)]))[0]]
    for _ in range(10):
        nxt = int(step_logits[-1][-1].argmax())
        seq.append(nxt)
        step_logits.append(session.run(Step([("a", [nxt])]))[0])
    torch.testing.assert_close(torch.cat(step_logits), dense_logits(MODEL, seq), atol=ATOL, rtol=0)


@st.composite
def schedules(draw: st.DrawFn) -> tuple[dict[str, list[int]], list[Step], int]:
    """Several requests whose sequences arrive in random chunks: prefill, chunked prefill and decode mixed."""
    num_reqs = draw(st.integers(1, 4))
    seqs = {
        f"r{i}": draw(st.lists(st.integers(0, CONFIG.vocab_size - 1), min_size=1, max_size=12)) for i in range(num_reqs)
    }
    done = dict.fromkeys(seqs, 0)
    steps: list[Step] = []
    while any(done[r] < len(s) for r, s in seqs.items()):
        pending = [r for r, s in seqs.items() if done[r] < len(s)]
        chosen = [r for r in pending if draw(st.booleans())] or [pending[0]]
        chunks = []
        for r in chosen:
            n = draw(st.integers(1, len(seqs[r]) - done[r]))
            chunks.append((r, seqs[r][done[r] : done[r] + n]))
            done[r] += n
        mode = draw(st.sampled_from(["NONE", "PIECEWISE", "FULL"]))
        pad_tokens = draw(st.integers(0, 3)) if mode != "NONE" else 0
        # FULL token padding comes with request padding: without it the rows past qo_indptr[-1] belong to nobody
        pad_reqs = draw(st.integers(1 if pad_tokens else 0, 2)) if mode == "FULL" else 0
        steps.append(Step(chunks, mode, pad_tokens, pad_reqs))
    block_size = draw(st.sampled_from([1, 2, 3, 16]))
    return seqs, steps, block_size


@settings(deadline=None, max_examples=25)
@given(schedule=schedules(), filler_blocks=st.integers(0, 8))
def test_chunked_mixed_and_padded_batches_match_full_recomputation(
    schedule: tuple[dict[str, list[int]], list[Step], int], filler_blocks: int
) -> None:
    """Every chunking and padding gives the dense logits; padding changes no real row and no real cache slot."""
    seqs, steps, block_size = schedule
    padded, plain = Session.new(block_size=block_size), Session.new(block_size=block_size)
    for s in (padded, plain):  # identical, scrambled allocation histories
        scramble_free_blocks(s.kvm, 8, live=filler_blocks, seed=filler_blocks)
    got: dict[str, list[torch.Tensor]] = {r: [] for r in seqs}
    for step in steps:
        with_pad = padded.run(step)
        without = plain.run(Step(step.chunks))
        for (rid, _), a, b in zip(step.chunks, with_pad, without, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
            got[rid].append(a)
    for rid, seq in seqs.items():
        torch.testing.assert_close(torch.cat(got[rid]), dense_logits(MODEL, seq), atol=ATOL, rtol=0)
        for a, b in zip(padded.cached(rid), plain.cached(rid), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@settings(deadline=None, max_examples=25)
@given(schedule=schedules(), data=st.data())
def test_a_layer_run_at_some_rows_gives_those_rows_and_caches_every_row(
    schedule: tuple[dict[str, list[int]], list[Step], int], data: st.DataObject
) -> None:
    """``forward_rows`` (EAGLE's prefill path): the full layer's output at the chosen rows, and the same cache."""
    _, steps, block_size = schedule
    layer = MODEL.model.decoder_layers()[0]
    full, partial = Session.new(block_size=block_size), Session.new(block_size=block_size)
    for step in steps:
        requests, desc, meta = full.prepare(step)
        partial.prepare(step)
        n = desc.num_tokens  # padded rows too: they attend to nothing, as in the full layer
        rows = data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n), label="rows")
        x = torch.randn(desc.num_tokens, CONFIG.hidden_size, generator=torch.Generator().manual_seed(len(rows)))
        positions = build_positions(requests, desc)
        want = layer(x, positions, meta, full.kv)[rows]
        got = layer.forward_rows(x, positions, meta, partial.kv, rows)
        assert got.shape == (len(rows), CONFIG.hidden_size)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        for s in (full, partial):
            for r in requests:
                s.kvm.set_length(r.req_id, r.seq_len)
        torch.testing.assert_close(partial.kv.key_cache(0), full.kv.key_cache(0), atol=1e-6, rtol=0)
        torch.testing.assert_close(partial.kv.value_cache(0), full.kv.value_cache(0), atol=1e-6, rtol=0)


def test_rows_outside_the_real_requests_cannot_be_attended_alone() -> None:
    session = Session.new()
    _, _, meta = session.prepare(
        Step([("a", tokens(1, 3)), ("b", tokens(2, 2))], mode="FULL", pad_tokens=2, pad_reqs=1)
    )
    assert query_rows_metadata(meta, [4, 0]).seq_lens.tolist() == [2, 1]
    with pytest.raises(ValueError, match=re.escape("row 5 belongs to no real request")):
        query_rows_metadata(meta, [0, 5])
    with pytest.raises(ValueError, match="needs causal metadata"):
        query_rows_metadata(dataclasses.replace(meta, causal=False), [0])


def test_padded_rows_write_only_the_scratch_slot() -> None:
    """A FULL-padded step leaves every cache slot outside the real tokens' slots untouched."""
    session = Session.new(num_blocks=16, block_size=4)
    session.run(Step([("a", tokens(2, 5)), ("b", tokens(3, 3))]))
    before = [session.kv.key_cache(0).clone(), session.kv.value_cache(0).clone()]
    requests, desc, meta = session.prepare(
        Step([("a", tokens(4, 1)), ("b", tokens(5, 2))], mode="FULL", pad_tokens=5, pad_reqs=2)
    )
    ids = torch.randint(0, CONFIG.vocab_size, (desc.num_tokens,))
    MODEL(ids, build_positions(requests, desc), meta, session.kv)
    written = {s for s in meta.slot_mapping.tolist() if s != PAD_SLOT_ID}
    assert len(written) == 3
    untouched = torch.tensor([s for s in range(session.kv.num_slots) if s not in written])
    for old, new in zip(before, [session.kv.key_cache(0), session.kv.value_cache(0)], strict=True):
        assert torch.equal(old[untouched], new[untouched])


def scramble_free_blocks(kvm: KVCacheManager, num_fillers: int, live: int, seed: int) -> None:
    """Take one block per filler request, then return most of them in a random order and keep ``live`` in use.

    The pool reuses returned blocks last-in first-out, so later tables come out
    scrambled (``[9, 2, 14, ...]``) and skip the blocks still held.
    """
    fillers = [f"filler{i}" for i in range(num_fillers)]
    for f in fillers:
        kvm.add_request(f)
        kvm.ensure_capacity(f, 1)
    order = torch.randperm(num_fillers, generator=torch.Generator().manual_seed(seed)).tolist()
    for i in order[: num_fillers - live]:
        kvm.free(fillers[i])


def test_block_size_and_irregular_block_tables_give_identical_results() -> None:
    seqs = {"a": tokens(6, 11), "b": tokens(7, 8)}
    results = []
    for block_size, scrambled in ((1, False), (3, True), (4, False), (4, True), (16, False), (1, True)):
        session = Session.new(num_blocks=64, block_size=block_size)
        if scrambled:
            scramble_free_blocks(session.kvm, 24, live=6, seed=block_size)
        logits = session.run(Step([("a", seqs["a"][:4]), ("b", seqs["b"][:6])]))
        logits += session.run(Step([("b", seqs["b"][6:7]), ("a", seqs["a"][4:9])]))
        logits += session.run(Step([("a", seqs["a"][9:]), ("b", seqs["b"][7:])]))
        results.append(torch.cat(logits))
        table = session.kvm.block_table("a")
        if scrambled:
            assert table != list(range(table[0], table[0] + len(table))), table
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], atol=1e-6, rtol=0)


# -- aux hidden states ---------------------------------------------------------------------------------


def test_aux_hidden_states_are_the_outputs_of_the_chosen_layers() -> None:
    config = ModelConfig.tiny(num_layers=3)
    model = Transformer(config, seed=3)
    session = Session.new(model)
    seq = tokens(8, 9)
    requests, desc, meta = session.prepare(Step([("a", seq)], mode="PIECEWISE", pad_tokens=2))
    ids = torch.tensor([*seq, 0, 0])
    positions = build_positions(requests, desc)
    out = model(ids, positions, meta, session.kv, aux_layers=(2, 0))
    assert [tuple(h.shape) for h in out.aux_hidden_states] == [(11, config.hidden_size)] * 2

    # the same layers, run by hand on a second cache
    kv = model.make_kv_storage(96, 4)
    x = model.embed(ids)
    per_layer = []
    for layer in model.model.decoder_layers():
        x = layer(x, positions, meta, kv)
        per_layer.append(x)
    torch.testing.assert_close(out.aux_hidden_states[0], per_layer[2], atol=0, rtol=0)
    torch.testing.assert_close(out.aux_hidden_states[1], per_layer[0], atol=0, rtol=0)
    torch.testing.assert_close(out.hidden_states, model.model.norm(per_layer[2]), atol=0, rtol=0)

    dense = model.forward_dense(torch.tensor(seq), aux_layers=(2, 0))
    for paged, ref in zip(out.aux_hidden_states, dense.aux_hidden_states, strict=True):
        torch.testing.assert_close(paged[:9], ref, atol=ATOL, rtol=0)
    from_embeds = model(ids, positions, meta, session.kv, inputs_embeds=model.embed(ids), aux_layers=(2, 0))
    torch.testing.assert_close(from_embeds.hidden_states, out.hidden_states, atol=0, rtol=0)
    with pytest.raises(ValueError, match=re.escape("aux_layers [3] are outside [0, num_layers=3)")):
        model(ids, positions, meta, session.kv, aux_layers=(3,))


# -- causal and bidirectional blocks -------------------------------------------------------------------


def block_outputs(session: Session, block: list[int], causal: bool) -> torch.Tensor:
    """Run a block of queries over the request's context on a copy of the cache; the block's hidden states."""
    trial = copy.deepcopy(session)
    requests, desc, meta = trial.prepare(Step([("a", block)]))
    meta = dataclasses.replace(meta, causal=causal, query_width=len(block) if not causal else None)
    out = trial.model(torch.tensor(block), build_positions(requests, desc), meta, trial.kv)
    return out.hidden_states


def test_bidirectional_block_queries_see_each_other_and_causal_ones_do_not() -> None:
    session = Session.new()
    session.run(Step([("a", tokens(9, 6))]))
    block = [5, 17, 33, 40]
    changed = [*block[:-1], 41]
    for causal in (True, False):
        a, b = block_outputs(session, block, causal), block_outputs(session, changed, causal)
        if causal:
            torch.testing.assert_close(a[:-1], b[:-1], atol=1e-6, rtol=0)
        else:
            assert (a[0] - b[0]).abs().max() > 1e-3  # the first query saw the last one
        assert (a[-1] - b[-1]).abs().max() > 1e-3


def test_bidirectional_prefill_matches_dense_bidirectional_attention() -> None:
    seq = tokens(10, 7)
    session = Session.new()
    got = session.run(Step([("a", seq)]), causal=False)[0]
    torch.testing.assert_close(got, dense_logits(MODEL, seq, causal=False), atol=ATOL, rtol=0)


# -- validation like a kernel -----------------------------------------------------------------------------


def block_batch(
    num_reqs: int = 12, q: int = 4, *, model_rows: int, attn_rows: int, req_rows: int | None = None
) -> tuple[Session, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A block-drafter step (``q`` bidirectional queries per request over 3 cached tokens) with chosen row counts."""
    session = Session.new(num_blocks=128, block_size=4)
    session.run(Step([(f"r{i}", tokens(20 + i, 3)) for i in range(num_reqs)]))
    chunks = [(f"r{i}", tokens(40 + i, q)) for i in range(num_reqs)]
    requests, desc, meta = session.prepare(Step(chunks))
    rows = req_rows or num_reqs
    qsl = torch.tensor([min(i, num_reqs) * q for i in range(rows + 1)], dtype=torch.int32)
    seq = torch.tensor([r.seq_len for r in requests] + [0] * (rows - num_reqs), dtype=torch.int32)
    table = torch.cat([meta.block_table, torch.zeros((rows - num_reqs, meta.block_table.shape[1]), dtype=torch.int32)])
    slots = torch.cat([meta.slot_mapping, torch.full((model_rows - num_reqs * q,), PAD_SLOT_ID)])
    meta = dataclasses.replace(
        meta,
        num_reqs_padded=rows,
        num_tokens_padded=attn_rows,
        causal=False,
        query_width=q,
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq,
        seq_lens_cpu=seq.clone(),
        block_table=table,
        slot_mapping=slots,
    )
    ids = torch.tensor([t for _, toks in chunks for t in toks] + [0] * (model_rows - num_reqs * q))
    positions = torch.cat([build_positions(requests, desc), torch.zeros(model_rows - num_reqs * q, dtype=torch.int64)])
    return session, ids, positions, meta


def test_attention_rejects_rows_past_qo_indptr_without_request_padding() -> None:
    """The DFlash/DSpark follow-up bug: 12 requests x 4 queries, metadata sized by 52 DP-padded model rows."""
    session, ids, positions, meta = block_batch(model_rows=52, attn_rows=52)
    with pytest.raises(RuntimeError, match=re.escape("q.shape[0] (52) != qo_indptr[-1] (48)")):
        MODEL(ids, positions, meta, session.kv)
    # the fix: attention sized by the requests' queries, model inputs keep the DP pad
    session, ids, positions, meta = block_batch(model_rows=52, attn_rows=48)
    out = MODEL(ids, positions, meta, session.kv)
    assert out.hidden_states.shape == (52, CONFIG.hidden_size)


def test_request_padding_makes_extra_rows_legal_and_they_get_zero_attention() -> None:
    session, ids, positions, meta = block_batch(model_rows=52, attn_rows=52, req_rows=13)
    MODEL(ids, positions, meta, session.kv)  # FULL layout: the 13th request row is empty
    q = torch.randn(52, CONFIG.num_heads, CONFIG.head_dim)
    out = paged_attention(q, meta, session.kv, 0)
    assert out[:48].abs().sum() > 0
    assert torch.equal(out[48:], torch.zeros_like(out[48:]))


def test_kernel_and_model_validation_messages() -> None:
    session, ids, positions, meta = block_batch(model_rows=48, attn_rows=48)
    short = dataclasses.replace(meta, slot_mapping=meta.slot_mapping[:47])
    with pytest.raises(ValueError, match=re.escape("meta.slot_mapping has 47 entries but the model runs 48 rows")):
        MODEL(ids, positions, short, session.kv)
    with pytest.raises(ValueError, match=re.escape("meta.num_tokens_padded (49) exceeds the model rows (48)")):
        MODEL(ids, positions, dataclasses.replace(meta, num_tokens_padded=49), session.kv)
    q = torch.randn(48, CONFIG.num_heads, CONFIG.head_dim)
    with pytest.raises(ValueError, match=re.escape("attention got 48 query rows but meta.num_tokens_padded is 52")):
        paged_attention(q, dataclasses.replace(meta, num_tokens_padded=52), session.kv, 0)
    with pytest.raises(RuntimeError, match=re.escape("q.shape[0] (44) != qo_indptr[-1] (48)")):
        paged_attention(q[:44], dataclasses.replace(meta, num_tokens_padded=44), session.kv, 0)
    with pytest.raises(ValueError, match=re.escape("seq_len 3 < query_len 4")):
        paged_attention(q, dataclasses.replace(meta, seq_lens_cpu=meta.seq_lens - 4), session.kv, 0)
    other_kv = PagedKVStorage(2, 8, 4, 1, CONFIG.head_dim)
    with pytest.raises(ValueError, match="does not fit the model"):
        MODEL(ids, positions, meta, other_kv)


def test_slot_mapping_sized_by_attention_rows_is_rejected() -> None:
    """Draft decode with a DP pad: 13 model rows but a slot mapping of the 12 attention rows."""
    session, ids, positions, meta = decode_batch(model_rows=13, attn_rows=12)
    bad = dataclasses.replace(meta, slot_mapping=meta.slot_mapping[:12])
    with pytest.raises(ValueError, match=re.escape("meta.slot_mapping has 12 entries but the model runs 13 rows")):
        MODEL(ids, positions, bad, session.kv)


# -- the motivating failure: the sparse indexer's reshape ----------------------------------------------------

INDEXED = Transformer(ModelConfig.tiny(indexer=IndexerConfig(num_heads=64, head_dim=128, topk=2048)), seed=0)


def decode_batch(
    model: Transformer = MODEL, num_reqs: int = 12, *, model_rows: int, attn_rows: int, context: int = 3
) -> tuple[Session, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Draft decode after a prefill: one query per request, model inputs DP-padded to ``model_rows``."""
    session = Session.new(model, num_blocks=128, block_size=4)
    session.run(Step([(f"r{i}", tokens(60 + i, context)) for i in range(num_reqs)]))
    chunks = [(f"r{i}", tokens(80 + i, 1)) for i in range(num_reqs)]
    requests, desc, meta = session.prepare(Step(chunks))
    pad = model_rows - num_reqs
    meta = dataclasses.replace(
        meta,
        num_tokens_padded=attn_rows,
        slot_mapping=torch.cat([meta.slot_mapping, torch.full((pad,), PAD_SLOT_ID)]),
    )
    ids = torch.tensor([t for _, toks in chunks for t in toks] + [0] * pad)
    positions = torch.cat([build_positions(requests, desc), torch.zeros(pad, dtype=torch.int64)])
    return session, ids, positions, meta


def test_indexer_reproduces_the_motivating_failure_exactly() -> None:
    """12 requests, draft metadata built with the DP-padded 13 rows: DeepSeek-V3.2's indexer reshape fails."""
    session, ids, positions, meta = decode_batch(INDEXED, model_rows=13, attn_rows=13)
    assert (meta.num_reqs, meta.num_reqs_padded, meta.max_query_len) == (12, 12, 1)
    with pytest.raises(RuntimeError, match=re.escape("shape '[12, -1, 64, 128]' is invalid for input of size 106496")):
        INDEXED(ids, positions, meta, session.kv)


@pytest.mark.parametrize("layout", ["eager", "full"])
def test_indexer_runs_on_the_fixed_metadata_and_is_dense_when_topk_covers_the_context(layout: str) -> None:
    """The fix: 12 attention rows under eager DP padding, or a FULL graph with 13 request rows for 13 tokens."""
    results = []
    for model in (INDEXED, MODEL):
        if layout == "eager":
            session, ids, positions, meta = decode_batch(model, model_rows=13, attn_rows=12)
        else:
            session, ids, positions, meta = decode_batch(model, model_rows=12, attn_rows=12)
            requests, desc, meta = session.prepare(
                Step([(f"r{i}", [int(t)]) for i, t in enumerate(ids)], mode="FULL", pad_tokens=1, pad_reqs=1)
            )
            assert (meta.num_reqs, meta.num_reqs_padded, meta.num_tokens_padded) == (12, 13, 13)
            ids, positions = torch.cat([ids, torch.tensor([0])]), build_positions(requests, desc)
        results.append(model(ids, positions, meta, session.kv).hidden_states)
    assert results[0].shape == (13, CONFIG.hidden_size)
    torch.testing.assert_close(results[0], results[1], atol=0, rtol=0)  # shared weights, every position kept


def test_indexer_keeps_topk_positions_on_decode_and_leaves_prefill_dense() -> None:
    sparse = Transformer(ModelConfig.tiny(indexer=IndexerConfig(num_heads=4, head_dim=8, topk=3)), seed=0)
    session, ids, positions, meta = decode_batch(sparse, num_reqs=3, model_rows=4, attn_rows=3, context=9)
    h = sparse.model.layers[0].input_layernorm(sparse.embed(ids))
    mask = sparse.model.layers[0].self_attn.indexer(h[:3], meta, session.kv, 0)
    assert mask.shape == (3, 10)
    assert mask.sum(dim=1).tolist() == [3, 3, 3]
    got = sparse(ids, positions, meta, session.kv).hidden_states
    session, ids, positions, meta = decode_batch(MODEL, num_reqs=3, model_rows=4, attn_rows=3, context=9)
    dense = MODEL(ids, positions, meta, session.kv).hidden_states
    assert (got[:3] - dense[:3]).abs().max() > 1e-3
    # prefill steps are not decode-shaped: the indexer stays out and the result is the dense one
    seq = tokens(11, 8)
    torch.testing.assert_close(
        Session.new(sparse).run(Step([("a", seq)]))[0], dense_logits(MODEL, seq), atol=ATOL, rtol=0
    )


# -- weights ------------------------------------------------------------------------------------------------


def test_same_seed_same_weights_different_seed_different_weights() -> None:
    a, b, c = Transformer(CONFIG, seed=5), Transformer(CONFIG, seed=5), Transformer(CONFIG, seed=6)
    wa, wb, wc = a.named_weights(), b.named_weights(), c.named_weights()
    assert wa.keys() == wb.keys() == wc.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not any(torch.equal(wa[k], wc[k]) for k in wa)
    # a weight depends on (seed, name, shape) only: optional components do not shift the shared ones
    moe = Transformer(ModelConfig.tiny(moe=MoEConfig(num_experts=4, top_k=2)), seed=5).named_weights()
    assert torch.equal(moe["model.layers.1.self_attn.q_proj.weight"], wa["model.layers.1.self_attn.q_proj.weight"])
    assert stream_seed(5, "lm_head.weight") == stream_seed(5, "lm_head.weight") != stream_seed(6, "lm_head.weight")


def test_hugging_face_names_and_state_dict_loading() -> None:
    names = set(MODEL.named_weights())
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= names
    assert "model.layers.1.self_attn.q_proj.weight" in names
    assert "model.layers.0.mlp.down_proj.weight" in names
    other = Transformer(CONFIG, seed=9)
    other.load_hf_state_dict({**MODEL.named_weights(), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)})
    seq = tokens(12, 5)
    torch.testing.assert_close(dense_logits(other, seq), dense_logits(MODEL, seq), atol=0, rtol=0)

    tied = Transformer(ModelConfig.tiny(tie_word_embeddings=True), seed=1)
    assert "lm_head.weight" not in tied.named_weights()
    assert tied.lm_head_weight is tied.model.embed_tokens.weight
    tied.load_hf_state_dict({**tied.named_weights(), "lm_head.weight": torch.zeros(96, 32)})  # ignored when tied
    bad = {**MODEL.named_weights(), "lm_head.weight": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match=re.escape("('lm_head.weight', (3, 3), (96, 32))")):
        other.load_hf_state_dict(bad)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match=re.escape("num_heads (6) must be a multiple of num_kv_heads (4)")):
        ModelConfig.tiny(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="head_dim must be even"):
        ModelConfig.tiny(head_dim=7)
    with pytest.raises(ValueError, match=re.escape("moe.top_k must be in [1, num_experts=2], got 3")):
        MoEConfig(num_experts=2, top_k=3)
    with pytest.raises(ValueError, match=re.escape("indexer.topk must be >= 1")):
        IndexerConfig(topk=0)
    with pytest.raises(ValueError, match="frozen"):
        CONFIG.hidden_size = 8  # type: ignore[misc]
    assert isinstance(MODEL.forward_dense(torch.tensor([1, 2])), ModelOutput)


# -- MoE with expert-parallel dispatch over DP ranks -----------------------------------------------------------

MOE = Transformer(ModelConfig.tiny(moe=MoEConfig(num_experts=5, top_k=2)), seed=0)
RANK_PROMPTS = {  # prompt lengths of each rank's requests; an empty rank runs dummy (all-padding) steps
    2: [[5, 2], [3]],
    4: [[4], [2, 3, 1], [], [6]],
}


def rank_steps(rank: int, prompt_lens: list[int]) -> list[list[tuple[str, list[int]]]]:
    """A prefill step, then one decode step, for one rank's requests."""
    prefill = [(f"r{rank}.{i}", tokens(100 * rank + i, n)) for i, n in enumerate(prompt_lens)]
    decode = [(f"r{rank}.{i}", tokens(900 + 100 * rank + i, 1)) for i in range(len(prompt_lens))]
    return [prefill, decode]


def run_rank(
    group: InProcessDPGroup | None, steps: list[list[tuple[str, list[int]]]], counts: list[list[int]], eager: bool
) -> list[torch.Tensor]:
    """One rank's steps: DP-padded to the largest rank (PIECEWISE), or eager with per-rank counts."""
    session = Session.new(MOE)
    logits = []
    for chunks, across in zip(steps, counts, strict=True):
        real = sum(len(t) for _, t in chunks)
        if eager:
            out = session.run(Step(chunks), dp_group=group, num_tokens_across_dp=across)
        else:
            out = session.run(Step(chunks, mode="PIECEWISE", pad_tokens=max(across) - real), dp_group=group)
        logits.append(torch.cat(out) if out else torch.zeros(0, CONFIG.vocab_size))
    return logits


@pytest.mark.parametrize("eager", [False, True], ids=["dp_padded", "eager_unequal"])
@pytest.mark.parametrize("dp_size", [2, 4])
def test_expert_parallel_moe_equals_single_process(dp_size: int, eager: bool) -> None:
    steps = [rank_steps(rank, lens) for rank, lens in enumerate(RANK_PROMPTS[dp_size])]
    counts = [[sum(len(t) for _, t in steps[rank][k]) for rank in range(dp_size)] for k in range(2)]
    assert eager or any(len(set(c)) > 1 for c in counts)  # the padding matters
    results = run_ranks(lambda g: run_rank(g, steps[g.rank], counts, eager), in_process_world(dp_size, timeout_s=20.0))
    for rank in range(dp_size):
        alone = run_rank(None, steps[rank], [[c[rank]] for c in counts], eager=False)
        for got, want in zip(results[rank], alone, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_unequal_rows_without_dp_padding_fail_in_the_collective() -> None:
    steps = [rank_steps(rank, lens) for rank, lens in enumerate(RANK_PROMPTS[2])]

    def unpadded(group: InProcessDPGroup) -> list[torch.Tensor]:
        session = Session.new(MOE)
        return session.run(Step(steps[group.rank][0]), dp_group=group)

    with pytest.raises(RuntimeError, match=r"ranks passed different shapes .*padded to the same token count"):
        run_ranks(unpadded, in_process_world(2, timeout_s=20.0))

    def wrong_counts(group: InProcessDPGroup) -> list[torch.Tensor]:
        return Session.new(MOE).run(Step(steps[group.rank][0]), dp_group=group, num_tokens_across_dp=[7, 7])

    with pytest.raises(ValueError, match=re.escape("num_tokens_across_dp=[7, 7] does not describe this rank's 3 rows")):
        run_ranks(wrong_counts, in_process_world(2, timeout_s=20.0))


# -- packed linears and bf16 --------------------------------------------------------------------------

needs_onednn = pytest.mark.skipif(not mkldnn_available(), reason="this torch build has no oneDNN")
needs_onednn_bf16 = pytest.mark.skipif(
    not mkldnn_bf16_available(),
    reason="this CPU has no oneDNN bf16 matmul (AVX512-BF16, AVX-NE-CONVERT or AVX512BW/VL/DQ): bf16 stays on F.linear",
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 100, 300])
def test_packed_linear_equals_f_linear(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=g)
    weights = [torch.randn(out, 256, generator=g) for out in (192, 64, 64)]
    packed = PackedLinear()
    # bf16: the same oneDNN kernel as F.linear, so the same bits, at any row count; plain F.linear on a CPU
    # without oneDNN's bf16 matmul (its reorder raises there)
    xb, wb = x.bfloat16(), [w.bfloat16() for w in weights]
    assert PackedLinear.applies(xb, wb) == mkldnn_bf16_available()
    for got, want in zip(packed.run(xb, wb), (F.linear(xb, w) for w in wb), strict=True):
        assert torch.equal(got, want)
    # fp32: packed at every row count (a prefill's in pieces), equal to F.linear up to summation order
    assert PackedLinear.applies(x, weights) == mkldnn_available()
    for got, want in zip(PackedLinear().run(x, weights), (F.linear(x, w) for w in weights), strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # fp32 weights of the test matrix's size stay on F.linear, where packing costs more than it saves
    tiny = [w[:, :64].contiguous() for w in weights]
    assert not PackedLinear.applies(x[:, :64].contiguous(), tiny)


@needs_onednn
def test_packed_fp32_rows_are_independent_and_match_f_linear() -> None:
    """Each row's result depends on that row alone and equals ``F.linear`` up to fp32 summation order.

    Whether a row also gets the same bits at every row count depends on the CPU:
    on an AVX2 host it did for every SmolLM2 shape up to 400 rows; on an AVX-512
    host a 576x1536 product differs in the last bit between one row and two. So
    fp32 verify rows equal decode rows up to rounding only (a near tie can break
    either way, which the bench's tie analysis allows), and this test asserts
    only what holds everywhere.
    """
    g = torch.Generator().manual_seed(0)
    for out_features, in_features in ((960, 576), (576, 1536), (3072, 576)):
        w = torch.randn(out_features, in_features, generator=g)
        x = torch.randn(300, in_features, generator=g)
        assert all(PackedLinear.applies(x[:n], (w,)) for n in (1, 5, 40, 300))
        for n in (1, 2, 3, 5, 8, 40, 300):
            got = PackedLinear().run(x[:n], (w,))[0]
            torch.testing.assert_close(got, F.linear(x[:n], w), rtol=0, atol=2e-5 * float(got.abs().max()))
            if n > 1:
                others = x[:n].clone()
                others[1:] = torch.randn(n - 1, in_features, generator=g)
                assert torch.equal(PackedLinear().run(others, (w,))[0][0], got[0]), f"{n} rows of {tuple(w.shape)}"


@needs_onednn
def test_packed_linear_follows_weight_updates_and_keeps_autograd() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 256, generator=g), torch.randn(256, 256, generator=g)
    packed = PackedLinear()
    torch.testing.assert_close(packed.run(x, (w,))[0], F.linear(x, w), atol=1e-4, rtol=0)
    w.mul_(2)  # in place: the packed copy must notice (the tensor's version changes)
    torch.testing.assert_close(packed.run(x, (w,))[0], F.linear(x, w), atol=1e-4, rtol=0)
    other = torch.randn(256, 256, generator=g)  # replaced (load_state_dict(assign=True) does this)
    torch.testing.assert_close(packed.run(x, (other,))[0], F.linear(x, other), atol=1e-4, rtol=0)

    leaf = x.clone().requires_grad_(True)
    assert not PackedLinear.applies(leaf, (w,))  # autograd needs F.linear
    packed.run(x, (w,))  # w packed and found fit: a later call with it checks only the input's side
    packed.run(leaf, (w,))[0].sum().backward()
    assert leaf.grad is not None
    torch.testing.assert_close(leaf.grad, w.sum(0).expand(4, 256), atol=1e-4, rtol=1e-5)
    with torch.no_grad():
        assert PackedLinear.applies(leaf, (w,))
    packed.packed((other,))  # packed by hand (as the kernel timing does): a later run with w must not use it
    torch.testing.assert_close(packed.run(x, (w,))[0], F.linear(x, w), atol=1e-4, rtol=0)


@needs_onednn
def test_a_packed_model_deep_copies_and_pickles() -> None:
    model = Transformer(CONFIG, seed=3, dtype=torch.bfloat16)
    seq = tokens(4, 6)
    before = dense_logits(model, seq)  # packs every weight
    clone = copy.deepcopy(model)
    assert torch.equal(dense_logits(clone, seq), before)
    restored = pickle.loads(pickle.dumps(model))
    assert torch.equal(dense_logits(restored, seq), before)


def test_bf16_model_paged_steps_match_its_dense_forward_and_logits_are_float32() -> None:
    bf16 = Transformer(CONFIG, seed=0, dtype=torch.bfloat16)
    session = Session.new(bf16)
    seq = tokens(1, 7)
    step_logits = [session.run(Step([("a", seq)]))[0]]
    for _ in range(6):
        nxt = int(step_logits[-1][-1].argmax())
        seq.append(nxt)
        step_logits.append(session.run(Step([("a", [nxt])]))[0])
    verify = session.run(Step([("a", tokens(2, 5))]))[0]  # a 5-token verify-shaped step
    paged = torch.cat(step_logits)
    assert paged.dtype == verify.dtype == torch.float32
    dense = dense_logits(bf16, seq)
    # measured: paged equals dense exactly, bf16 is within 0.8 % of fp32; the bounds leave room for other kernels
    scale = dense_logits(MODEL, seq).abs().max().item()
    torch.testing.assert_close(paged, dense, atol=0.01 * scale, rtol=0)
    torch.testing.assert_close(dense, dense_logits(MODEL, seq), atol=0.03 * scale, rtol=0)
    assert torch.isfinite(verify).all()


@needs_onednn_bf16
@pytest.mark.parametrize(
    ("num_blocks", "prompt_len", "reads_a_view"),
    [(96, 9, True), (5, 13, False)],
    ids=["cache-view", "width-past-the-cache-end-gathers"],
)
def test_bf16_verify_rows_equal_the_decode_steps_of_the_same_tokens_bit_for_bit(
    num_blocks: int, prompt_len: int, reads_a_view: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What makes bf16 speculative decoding reproduce plain greedy: no logit tie can break differently.

    Both ways an exact group reads its context rounded up to ``EXACT_WIDTH_MULTIPLE``: a view of consecutive cache
    slots, or (where the rounded-up width would run past the cache's 20 slots) a gather whose tail reads the null row.
    """
    bf16 = Transformer(CONFIG, seed=0, dtype=torch.bfloat16)
    prompt, drafts = tokens(3, prompt_len), tokens(4, 5)
    decoded, verified = Session.new(bf16, num_blocks=num_blocks), Session.new(bf16, num_blocks=num_blocks)
    decoded.run(Step([("a", prompt)]))
    verified.run(Step([("a", prompt)]))
    one_by_one = torch.cat([decoded.run(Step([("a", [t])]))[0] for t in drafts])
    views: list[int] = []
    real_range = PagedKVStorage.slot_range

    def counted(self: PagedKVStorage, layer: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        views.append(length)
        return real_range(self, layer, start, length)

    monkeypatch.setattr(PagedKVStorage, "slot_range", counted)
    assert torch.equal(verified.run(Step([("a", drafts)]))[0], one_by_one)
    assert torch.equal(torch.cat(verified.cached("a")), torch.cat(decoded.cached("a")))
    assert views == ([16] * CONFIG.num_layers if reads_a_view else []), views  # 14 positions rounded up to 16


def recorded_attention_shapes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """From now on, the query and key shapes of every attention call, in order."""
    import specdec.nn.attention as attention

    shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    sdpa = F.scaled_dot_product_attention

    def recorded(q: torch.Tensor, k: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        shapes.append((tuple(q.shape), tuple(k.shape)))
        return sdpa(q, k, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recorded)
    return shapes


@needs_onednn_bf16
@pytest.mark.parametrize("exact", [True, False])
def test_exact_verify_lays_a_bf16_verify_groups_rows_along_the_batch_dimension(
    exact: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``exact_verify`` on: one attention call a layer whose batch holds the 5 verify rows, one query row each, over
    the context rounded up to ``EXACT_WIDTH_MULTIPLE`` (what keeps each row equal to its decode); off: one call of 5
    query rows over the exact width (faster, but its rows may round differently from the decode)."""
    import specdec.nn.attention as attention

    bf16 = Transformer(CONFIG, seed=0, dtype=torch.bfloat16)
    bf16.exact_verify = exact
    session = Session.new(bf16)
    session.run(Step([("a", tokens(3, 9))]))
    shapes = recorded_attention_shapes(monkeypatch)
    logits = session.run(Step([("a", tokens(4, 5))]))[0]
    assert logits.shape[0] == 5 and torch.isfinite(logits).all()
    heads, kv_heads, dim = CONFIG.num_heads, CONFIG.num_kv_heads, CONFIG.head_dim
    width = attention.EXACT_WIDTH_MULTIPLE if exact else 14  # 9 cached + 5 new positions
    per_layer = (
        ((5, heads, 1, dim), (5, kv_heads, width, dim)) if exact else ((1, heads, 5, dim), (1, kv_heads, width, dim))
    )
    assert shapes == [per_layer] * CONFIG.num_layers


# -- batch invariance (opt-in) -----------------------------------------------------------------------

BATCH_STEPS = [  # per step, the new tokens of each request (a request absent from a step does not run in it)
    {"a": tokens(20, 19), "b": tokens(21, 5), "c": tokens(22, 23)},  # prefills of three lengths: 47 rows in all
    {"a": tokens(23, 1), "b": tokens(24, 1), "c": tokens(25, 1)},  # decodes
    {"a": tokens(26, 4), "b": tokens(27, 1), "c": tokens(28, 4)},  # verify, decode, verify
    {"a": tokens(29, 5), "c": tokens(30, 3)},  # verifies of two lengths
]


def step_logits(model: Transformer, batched: bool) -> dict[str, list[torch.Tensor]]:
    """Each request's logits per step, its steps run in one batch with the others or in a session of its own."""
    out: dict[str, list[torch.Tensor]] = {rid: [] for rid in BATCH_STEPS[0]}
    if batched:
        session = Session.new(model)
        for chunks in BATCH_STEPS:
            for (rid, _), logits in zip(chunks.items(), session.run(Step(list(chunks.items()))), strict=True):
                out[rid].append(logits)
        return out
    for rid in out:
        alone = Session.new(model)
        out[rid] = [alone.run(Step([(rid, chunks[rid])]))[0] for chunks in BATCH_STEPS if rid in chunks]
    return out


@needs_onednn_bf16
def test_batch_invariant_bf16_requests_get_the_same_logits_in_a_batch_as_alone() -> None:
    """Prefill, decode and verify rows of a request equal, bit for bit, the same steps run alone.

    The batched prefill has 47 rows, more than ``ROW_INVARIANT_ROWS``, so the linears' row chunking is
    exercised too. Without ``batch_invariant`` 1 of the 11 request-steps differs (measured on this CPU).
    """
    model = Transformer(CONFIG, seed=0, dtype=torch.bfloat16)
    model.batch_invariant = True
    batched, alone = step_logits(model, batched=True), step_logits(model, batched=False)
    for rid in alone:
        assert len(batched[rid]) == len(alone[rid])
        for i, (got, want) in enumerate(zip(batched[rid], alone[rid], strict=True)):
            assert torch.equal(got, want), f"request {rid}, step {i}"


@needs_onednn_bf16
def test_batch_invariant_speculative_greedy_in_a_batch_equals_plain_greedy_alone() -> None:
    """End to end through the engine, verify rows included (the logits test above is the one that fails without it)."""
    from specdec.backend_registry import create
    from specdec.engine import Engine, EngineConfig
    from specdec.scheduler import SchedulerConfig

    model = Transformer(ModelConfig.tiny(vocab_size=64), seed=2, dtype=torch.bfloat16)
    model.batch_invariant = True
    prompts = [tokens(40 + i, 3 + 2 * i, vocab=64) for i in range(4)]

    def greedy(batch: list[list[int]], speculate: bool) -> list[list[int]]:
        config = EngineConfig(num_blocks=96, block_size=4, scheduler=SchedulerConfig(max_model_len=64))
        spec = create("draft-model", model, num_spec_tokens=3, draft=model) if speculate else None
        engine = Engine(model, config, speculator=spec)
        for i, prompt in enumerate(batch):
            engine.add_request(str(i), prompt, max_tokens=24)
        with torch.inference_mode():
            out = engine.run()
        return [out[str(i)] for i in range(len(batch))]

    alone = [greedy([p], speculate=False)[0] for p in prompts]
    assert greedy(prompts, speculate=True) == alone
    assert greedy(prompts, speculate=False) == alone


@needs_onednn_bf16
def test_batch_invariant_decodes_hold_under_a_sparse_indexer() -> None:
    """A sparse indexer restricts each decode row to its request's top-k positions inside the shared exact call.

    Only steps whose every request decodes are compared: the indexer runs on decode-shaped steps only (as
    DeepSeek-V3.2's), so a decode next to a verify is dense in a batch and sparse alone, whatever the attention does.
    """
    config = ModelConfig.tiny(indexer=IndexerConfig(num_heads=4, head_dim=8, topk=16))
    model = Transformer(config, seed=0, dtype=torch.bfloat16)
    model.batch_invariant = True
    batched, alone = step_logits(model, batched=True), step_logits(model, batched=False)
    for rid in alone:  # steps 0 and 1: the prefills, then a decode of every request
        for i in (0, 1):
            assert torch.equal(batched[rid][i], alone[rid][i]), f"request {rid}, step {i}"
    dense = Transformer(CONFIG, seed=0, dtype=torch.bfloat16)
    dense.batch_invariant = True
    assert not torch.equal(step_logits(dense, batched=True)["a"][1], batched["a"][1])  # the indexer took effect


@needs_onednn_bf16
def test_batch_invariant_rows_of_a_batch_share_an_attention_call_per_query_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under ``batch_invariant`` the decode and verify rows of the requests of one query length go in one call a
    layer: a request per item of the batch dimension over a common width rounded up to ``EXACT_WIDTH_MULTIPLE``,
    its rows along the heads dimension (a lone request's along the batch dimension). Each row's bits are the ones
    it gets alone (the logits test above), by the width rule."""
    model = Transformer(CONFIG, seed=0, dtype=torch.bfloat16)
    model.batch_invariant = True
    session = Session.new(model)
    session.run(Step([("a", tokens(3, 9)), ("b", tokens(4, 30)), ("c", tokens(5, 17))]))
    shapes = recorded_attention_shapes(monkeypatch)
    session.run(Step([("a", tokens(6, 1)), ("b", tokens(7, 1)), ("c", tokens(8, 1))]))
    heads, kv_heads, dim = CONFIG.num_heads, CONFIG.num_kv_heads, CONFIG.head_dim
    assert shapes == [((3, heads, 1, dim), (3, kv_heads, 32, dim))] * CONFIG.num_layers  # 31 positions at most
    shapes.clear()
    session.run(Step([("a", tokens(9, 1)), ("b", tokens(10, 4)), ("c", tokens(11, 1))]))  # decode, verify, decode
    decodes, verify = ((2, heads, 1, dim), (2, kv_heads, 32, dim)), ((4, heads, 1, dim), (4, kv_heads, 48, dim))
    assert sorted(shapes) == sorted([decodes, verify] * CONFIG.num_layers)  # b: 35 positions
    shapes.clear()
    session.run(Step([("a", tokens(12, 3)), ("b", tokens(13, 3)), ("c", tokens(14, 1))]))  # two verifies of 3 rows
    verifies, decode = ((2, 3 * heads, 1, dim), (2, kv_heads, 48, dim)), ((1, heads, 1, dim), (1, kv_heads, 32, dim))
    assert sorted(shapes) == sorted([verifies, decode] * CONFIG.num_layers)  # b: 38 positions


@pytest.mark.skipif(mkldnn_bf16_available(), reason="this CPU has oneDNN's bf16 matmul")
def test_batch_invariant_is_refused_where_the_cpu_cannot_keep_it() -> None:
    """Without the packed bf16 kernel the guarantee cannot hold, so asking for it is an error, not a silent no-op."""
    model = Transformer(CONFIG, seed=0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="batch_invariant needs oneDNN's packed bf16 matmul"):
        model.batch_invariant = True
    assert not model.batch_invariant
    Transformer(CONFIG, seed=0).batch_invariant = True  # fp32 takes the flag (it chunks nothing it cannot keep)


@needs_onednn_bf16
def test_row_chunked_packed_bf16_rows_equal_the_rows_computed_alone() -> None:
    """What ``batch_invariant`` relies on: chunks of at most 32 rows give every row its one-row bits."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1536, 576, generator=g) * 0.05).bfloat16()
    x = torch.randn(100, 576, generator=g).bfloat16()
    packed = PackedLinear()
    with torch.inference_mode():
        alone = torch.cat([packed.run(x[i : i + 1], (w,))[0] for i in range(100)])
        packed.row_chunk = ROW_INVARIANT_ROWS
        assert torch.equal(packed.run(x, (w,))[0], alone)
        assert torch.equal(copy.deepcopy(packed).run(x, (w,))[0], alone)  # a copy keeps its chunking
