"""Adapters that check other engines' speculative-decoding code against the contracts."""
