"""Paged KV cache bookkeeping on the host: which blocks each request holds and how much of them is filled.

The tensors live in ``specdec.kv_storage``; this module only decides where a
token's K/V goes. Every mutation either completes or leaves the state exactly as
it was, so a failed allocation can be answered by preemption without repair.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from contracts import CacheFacts, Mode, StepKind, Subject, current_mode
from contracts import check as run_checks

FINISHED_HISTORY = 4096
"""How many finished request ids are remembered for KV-1; bounded so a long run does not grow without end."""


class KVCacheError(RuntimeError):
    """The cache was asked for something its bookkeeping cannot do (unknown request, double free, ...)."""


class OutOfBlocksError(KVCacheError):
    """Not enough free blocks; nothing was allocated, so the caller can preempt and retry."""

    def __init__(
        self, req_ids: str | Sequence[str], needed: int, free: int, total: int, *, cache: str | None = None
    ) -> None:
        self.req_ids: tuple[str, ...] = (req_ids,) if isinstance(req_ids, str) else tuple(req_ids)
        self.needed = needed
        self.free = free
        self.total = total
        self.cache = cache
        names = ", ".join(repr(r) for r in self.req_ids) or "<none>"
        label = "request" if len(self.req_ids) == 1 else "requests"
        where = f"{cache}: " if cache else ""
        super().__init__(
            f"{where}out of KV blocks: {label} {names} need {needed} more block(s), "
            f"but only {free} of {total} are free (nothing was allocated)"
        )


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens (ceiling division)."""
    return -(-num_tokens // block_size)


class BlockPool:
    """A free list of block ids with ownership tracking, so a lost or double-freed block is an error, not silent corruption."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self._num_total = num_blocks
        # A stack popped from the end: fresh pools hand out 0, 1, 2, ...; freed blocks are reused first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._in_use: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    def free_blocks(self) -> tuple[int, ...]:
        return tuple(self._free)

    def allocate(self, n: int, *, owner: str | Sequence[str] = "<unnamed>") -> list[int]:
        """Take ``n`` blocks; raises ``OutOfBlocksError`` (taking none) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise OutOfBlocksError(owner, n, len(self._free), self._num_total)
        taken = [self._free.pop() for _ in range(n)]
        self._in_use.update(taken)
        return taken

    def free(self, blocks: Iterable[int]) -> None:
        """Return blocks to the pool; validates all of them before returning any."""
        returned = list(blocks)
        seen: set[int] = set()
        for b in returned:
            if not 0 <= b < self._num_total:
                raise KVCacheError(f"block {b} is out of range [0, {self._num_total})")
            if b in seen:
                raise KVCacheError(f"block {b} appears twice in one free() call")
            if b not in self._in_use:
                raise KVCacheError(f"block {b} is not in use (double free, or never allocated)")
            seen.add(b)
        self._in_use.difference_update(returned)
        self._free.extend(reversed(returned))


class KVCacheManager:
    """Per-request block tables and cached lengths over one ``BlockPool``.

    ``length(req)`` counts tokens whose K/V is in the cache; capacity (blocks
    held times ``block_size``) may run ahead of it while a step is in flight.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        finished_history: int = FINISHED_HISTORY,
        name: str | None = None,
        hint: str = "",
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.name = name
        """Who owns the cache (``draft cache 'eagle' of backend 'eagle'``): every error this cache raises starts with it."""
        self._hint = hint
        """What the owner should do when it addresses a position it holds no block for (a drafter: its lookahead)."""
        self._block_size = block_size
        self._pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        self._lengths: dict[str, int] = {}
        self._finished: dict[str, None] = {}  # insertion-ordered set, oldest first
        self._finished_history = finished_history

    # -- read-only views -------------------------------------------------------------------------

    @property
    def _where(self) -> str:
        return f"{self.name}: " if self.name else ""

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self._pool.num_total

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

    @property
    def requests(self) -> tuple[str, ...]:
        return tuple(self._tables)

    @property
    def finished_requests(self) -> tuple[str, ...]:
        return tuple(self._finished)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._tables

    def block_table(self, req_id: str) -> list[int]:
        """A copy of the request's block ids, in position order."""
        return list(self._table(req_id))

    def length(self, req_id: str) -> int:
        self._table(req_id)
        return self._lengths[req_id]

    def capacity(self, req_id: str) -> int:
        """Tokens the request's blocks can hold."""
        return len(self._table(req_id)) * self._block_size

    def blocks_needed(self, req_id: str, num_tokens_total: int) -> int:
        """Extra blocks ``ensure_capacity(req_id, num_tokens_total)`` would take."""
        if num_tokens_total < 0:
            raise ValueError(f"num_tokens_total must be >= 0, got {num_tokens_total} for request {req_id!r}")
        return max(0, blocks_for(num_tokens_total, self._block_size) - len(self._table(req_id)))

    # -- lifecycle -------------------------------------------------------------------------------

    def add_request(self, req_id: str) -> None:
        if req_id in self._tables:
            raise KVCacheError(f"{self._where}request {req_id!r} is already in the cache")
        self._finished.pop(req_id, None)  # an id may be reused after it finished
        self._tables[req_id] = []
        self._lengths[req_id] = 0

    def ensure_capacity(self, req_id: str, num_tokens_total: int) -> list[int]:
        """Grow the request's blocks to hold ``num_tokens_total`` tokens; returns the new blocks. Never shrinks."""
        needed = self.blocks_needed(req_id, num_tokens_total)
        try:
            new = self._pool.allocate(needed, owner=req_id)
        except OutOfBlocksError as exc:
            raise OutOfBlocksError(req_id, exc.needed, exc.free, exc.total, cache=self.name) from None
        self._tables[req_id].extend(new)
        return new

    def ensure_capacities(self, totals: Mapping[str, int]) -> None:
        """``ensure_capacity`` for several requests, all or nothing: a batch is either schedulable or not."""
        needs = {r: self.blocks_needed(r, n) for r, n in totals.items()}
        total_needed = sum(needs.values())
        if total_needed > self._pool.num_free:
            short = [r for r, n in needs.items() if n > 0]
            raise OutOfBlocksError(short, total_needed, self._pool.num_free, self._pool.num_total, cache=self.name)
        for r, n in needs.items():
            self._tables[r].extend(self._pool.allocate(n, owner=r))

    def set_length(self, req_id: str, n: int) -> None:
        """Record that ``n`` tokens of K/V are cached (after a forward wrote them)."""
        cap = self.capacity(req_id)
        if not 0 <= n <= cap:
            raise KVCacheError(
                f"{self._where}request {req_id!r}: cannot set cached length {n}; capacity is {cap} tokens "
                f"({len(self._tables[req_id])} blocks of {self._block_size}), call ensure_capacity first{self._hint}"
            )
        self._lengths[req_id] = n

    def truncate(self, req_id: str, length: int) -> list[int]:
        """Roll back to ``length`` cached tokens (rejected drafts) and free the blocks no longer needed (KV-2)."""
        current = self.length(req_id)
        if not 0 <= length <= current:
            raise KVCacheError(
                f"{self._where}request {req_id!r}: cannot truncate to {length}; cached length is {current}"
            )
        table = self._tables[req_id]
        keep = blocks_for(length, self._block_size)
        released = table[keep:]
        self._release(req_id, released)
        del table[keep:]
        self._lengths[req_id] = length
        return released

    def commit(self, req_id: str, length: int) -> list[int]:
        """Hold exactly ``length`` tokens from now on: the step wrote them, anything past them is rolled back (KV-2).

        ``length`` may lie past the cached length (the step's rows up to it were
        written) but not past the capacity; returns the blocks released.
        """
        if length > self.length(req_id):
            self.set_length(req_id, length)
        return self.truncate(req_id, length)

    def free(self, req_id: str) -> None:
        """A finished request returns every block and is remembered as finished (KV-1)."""
        table = self._table(req_id)
        self._release(req_id, table)
        del self._tables[req_id]
        del self._lengths[req_id]
        self._finished[req_id] = None
        while len(self._finished) > self._finished_history:
            del self._finished[next(iter(self._finished))]

    def preempt(self, req_id: str) -> int:
        """Drop all of the request's K/V and blocks but keep it registered; returns the tokens to recompute."""
        table = self._table(req_id)
        self._release(req_id, table)
        table.clear()
        dropped = self._lengths[req_id]
        self._lengths[req_id] = 0
        return dropped

    # -- addressing ------------------------------------------------------------------------------

    def slot_mapping(self, req_id: str, positions: Iterable[int]) -> list[int]:
        """Flat cache slot of each position: ``table[pos // block_size] * block_size + pos % block_size``."""
        table = self._table(req_id)
        bs = self._block_size
        slots: list[int] = []
        for pos in positions:
            block_index = pos // bs
            if pos < 0 or block_index >= len(table):
                raise KVCacheError(
                    f"{self._where}request {req_id!r}: position {pos} is outside its allocated capacity of "
                    f"{len(table) * bs} tokens (cached length {self._lengths[req_id]}); reserve blocks "
                    f"(ensure_capacity) before addressing them{self._hint}"
                )
            slots.append(table[block_index] * bs + pos % bs)
        return slots

    # -- contracts -------------------------------------------------------------------------------

    def facts(
        self, committed_lengths: Mapping[str, int] | None = None, live_requests: Iterable[str] | None = None
    ) -> CacheFacts:
        """A snapshot for the KV-* checks; copies, so later mutations do not change it."""
        return CacheFacts(
            num_blocks_total=self._pool.num_total,
            free_blocks=self._pool.free_blocks,
            block_tables={r: tuple(t) for r, t in self._tables.items()},
            finished_requests=tuple(self._finished),
            cache_lengths=dict(self._lengths),
            committed_lengths=dict(committed_lengths) if committed_lengths is not None else None,
            block_size=self._block_size,
            live_requests=frozenset(live_requests) if live_requests is not None else None,
        )

    def check(
        self,
        committed_lengths: Mapping[str, int] | None = None,
        *,
        live_requests: Iterable[str] | None = None,
        component: str = "kv_cache",
    ) -> None:
        """Run the KV-* invariants.

        Pass the verifier's committed lengths to also check the rollback (KV-2),
        and the requests still running to check that no other request holds a
        block (KV-4).
        """
        if current_mode() is Mode.OFF:
            return
        facts = self.facts(committed_lengths, live_requests)
        run_checks(Subject.CACHE, facts, step_kind=StepKind.CACHE, component=component)

    def _release(self, req_id: str, blocks: list[int]) -> None:
        """Return ``blocks`` to the pool; a bookkeeping error names this cache and the request."""
        try:
            self._pool.free(blocks)
        except KVCacheError as exc:
            raise KVCacheError(f"{self._where}request {req_id!r}: {exc}") from None

    def _table(self, req_id: str) -> list[int]:
        try:
            return self._tables[req_id]
        except KeyError:
            state = "has finished" if req_id in self._finished else "was never added"
            raise KVCacheError(f"{self._where}request {req_id!r} is not in the cache (it {state})") from None
