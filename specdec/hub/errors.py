"""What can go wrong in the model store, as exception types a caller (or the CLI) can tell apart."""

from __future__ import annotations


class ModelStoreError(RuntimeError):
    """Fetching, converting or reading a cached model failed."""


class UnknownModelError(ValueError):
    """A model name the catalog does not know."""


class ChecksumError(ModelStoreError):
    """A file's sha256 differs from the pinned or recorded one: a corrupted download, mirror or cache."""


class UnsupportedModelError(ModelStoreError):
    """The GGUF describes an architecture, tokenizer or feature the converter does not implement."""


class StoreNotWritableError(ModelStoreError):
    """The store cannot create or lock its directory, so a model can be neither pulled nor rebuilt there."""
