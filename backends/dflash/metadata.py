"""Block-step attention metadata for the block drafters (DFlash, DSpark): the public builder in ``specdec.draft_builders``.

q bidirectional queries per drafting request, request-major (BLK-3..BLK-6).
The implementation is the public one, so a third-party block drafter builds
exactly what the shipped ones do.
"""

from __future__ import annotations

from specdec.draft_builders import block_attention_rows, build_block_metadata

__all__ = ["block_attention_rows", "build_block_metadata"]
