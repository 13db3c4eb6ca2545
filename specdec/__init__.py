"""The specdec runtime: padding and DP sync, paged KV cache, attention metadata, engine."""

__version__ = "0.1.0"
