"""Prompt-lookup (n-gram) drafting for specdec, written only against its public API.

Drafts come from the request's own tokens: where its last n tokens occurred
before, propose what followed. There is no draft network, hence no draft
forward, no draft DP sync and no draft KV cache; acceptance is high wherever
text repeats itself (code, quotes, extraction, greedy loops).
"""

from specdec_ngram.drafter import NgramSpeculator, lookup, make_speculator

__all__ = ["NgramSpeculator", "lookup", "make_speculator"]
