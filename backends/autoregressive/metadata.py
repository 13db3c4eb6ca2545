"""Draft-decode attention metadata for the autoregressive drafters: the public builders in ``specdec.draft_builders``.

One query per drafting request (AR-5..AR-8): the multi-step decode rebuilds the
metadata every step, the fused decode builds its buffers once and advances
``seq_lens`` and slots in them. The implementation is the public one, so a
third-party drafter builds exactly what the shipped ones do.
"""

from __future__ import annotations

from specdec.draft_builders import (
    advance_decode_metadata,
    build_decode_metadata,
    decode_attention_rows,
    padded_rows,
)

__all__ = ["advance_decode_metadata", "build_decode_metadata", "decode_attention_rows", "padded_rows"]
