"""Medusa-style draft heads for specdec, written only against its public API.

K small residual heads read the target's last hidden state of each drafting
request; head k predicts the token k steps after the next one. No draft KV
cache and no attention: the heads run through ``DraftContext.forward_heads``
after a draft DP sync every step, an idle DP rank included.
"""

from specdec_medusa.drafter import MedusaSpeculator, make_speculator
from specdec_medusa.heads import MedusaHeads

__all__ = ["MedusaHeads", "MedusaSpeculator", "make_speculator"]
