"""State every drafter with its own paged KV cache shares: the cache and its tensors.

The engine opens, commits and frees the cache around every proposal; a drafter
only writes rows into it (and grows it for speculative positions).
"""

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
        """Nothing to release beyond the draft cache, whose blocks the engine frees itself."""
        del req_id
