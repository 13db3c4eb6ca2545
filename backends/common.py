"""State every drafter with its own paged KV cache shares: the cache, its tensors, release."""

from __future__ import annotations

from specdec.kv_cache import KVCacheManager
from specdec.kv_storage import PagedKVStorage


class DraftCacheOwner:
    """Holds a draft KV cache created through ``DraftContext.new_cache`` and its storage."""

    name: str
    _kv: KVCacheManager | None = None
    _storage: PagedKVStorage | None = None

    @property
    def kv(self) -> KVCacheManager:
        if self._kv is None:
            raise RuntimeError(f"speculator {self.name!r} is not bound to an engine")
        return self._kv

    @property
    def storage(self) -> PagedKVStorage:
        if self._storage is None:
            raise RuntimeError(f"speculator {self.name!r} is not bound to an engine")
        return self._storage

    def finish(self, req_id: str) -> None:
        """A finished or preempted request releases its draft blocks (KV-1)."""
        if req_id in self.kv:
            self.kv.free(req_id)
