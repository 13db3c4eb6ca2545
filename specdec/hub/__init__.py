"""Real models: a verified local store of converted GGUF checkpoints, their tokenizers and a loader.

``load(name)`` returns the project's own ``Transformer`` with the checkpoint's
weights and the model's ``Tokenizer``; ``ModelStore`` pulls and verifies; the
catalog lists what can be pulled. See ``docs/models.md``.
"""

from specdec.hub.catalog import KNOWN_MODELS, FileSource, ModelSpec, WheelSource, get_spec
from specdec.hub.chat import ChatTemplateError, render_chat
from specdec.hub.errors import (
    ChecksumError,
    ModelStoreError,
    StoreNotWritableError,
    UnknownModelError,
    UnsupportedModelError,
)
from specdec.hub.loader import load
from specdec.hub.progress import RichProgress, SilentProgress
from specdec.hub.store import CacheStatus, ModelStore, default_root
from specdec.hub.tokenizer import StreamDecoder, Tokenizer

__all__ = [
    "KNOWN_MODELS",
    "CacheStatus",
    "ChatTemplateError",
    "ChecksumError",
    "FileSource",
    "ModelSpec",
    "ModelStore",
    "ModelStoreError",
    "RichProgress",
    "SilentProgress",
    "StoreNotWritableError",
    "StreamDecoder",
    "Tokenizer",
    "UnknownModelError",
    "UnsupportedModelError",
    "WheelSource",
    "default_root",
    "get_spec",
    "load",
    "render_chat",
]
