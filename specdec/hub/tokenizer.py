"""The runtime tokenizer: ``tokenizers`` over the cached ``tokenizer.json``, the chat template and stop ids.

Streaming output must never show half a character: byte-level BPE splits a
multi-byte UTF-8 character across tokens, and decoding a prefix that ends inside
one yields U+FFFD. ``StreamDecoder`` holds text back until it decodes cleanly.

A chat message's content is the user's text, never markup: ``<|im_start|>system``
typed by a user must stay those characters, or a user could open a system turn.
``encode_chat`` therefore encodes the template's own text with its control
tokens and each message's content with special-token text spelled out.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from specdec.hub.chat import ChatTemplateError, Message, render_chat
from specdec.hub.errors import ModelStoreError

REPLACEMENT = "\ufffd"


class Tokenizer:
    """Encode, decode, stream-decode and chat-format for one model."""

    def __init__(self, backend: HFTokenizer, config: dict[str, Any]) -> None:
        self.backend = backend
        self.config = config
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token_id = self._id_of(config.get("bos_token"))
        self.eos_token_id = self._id_of(config.get("eos_token"))
        self.pad_token_id = self._id_of(config.get("pad_token"))
        stop = config.get("stop_token_ids")
        if stop is None:
            stop = [self.eos_token_id] if self.eos_token_id is not None else []
        self.stop_token_ids: tuple[int, ...] = tuple(int(t) for t in stop)
        bad = [t for t in self.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ModelStoreError(f"stop token ids {bad} are outside the vocabulary of {self.vocab_size}")

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        """The tokenizer of a cache directory (``tokenizer.json`` and ``tokenizer_config.json``)."""
        try:
            backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
            config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
            raise ModelStoreError(f"cannot read the tokenizer in {path}: {exc}") from exc
        return cls(backend, config)

    def _id_of(self, token: str | None) -> int | None:
        if token is None:
            return None
        index = self.backend.token_to_id(token)
        if index is None:
            raise ModelStoreError(f"special token {token!r} is not in the vocabulary")
        return int(index)

    @property
    def vocab_size(self) -> int:
        """Ids run ``0 .. vocab_size - 1`` (added tokens included)."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids; special-token text such as ``<|im_start|>`` becomes its single id."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        """The prompt text in the model's own chat format."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; encode plain text instead")
        specials = {k: self.config.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return render_chat(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt, special_tokens=specials
        )

    def encode_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> list[int]:
        """Ids of the chat prompt (the template writes any BOS itself, so none is added).

        Content without special-token text is encoded exactly as the whole
        rendered prompt would be; content with it is cut out and encoded with
        that text as plain characters, so it cannot become a control token.
        """
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        spans = self._content_spans(text, messages, add_generation_prompt)
        if not spans:
            return self.encode(text, add_special_tokens=False)
        ids: list[int] = []
        start = 0
        for begin, end in spans:
            ids += self.encode(text[start:begin], add_special_tokens=False) if begin > start else []
            ids += self._literal.encode(text[begin:end], add_special_tokens=False).ids
            start = end
        return ids + (self.encode(text[start:], add_special_tokens=False) if start < len(text) else [])

    @functools.cached_property
    def special_texts(self) -> tuple[str, ...]:
        """The text of every special (control) token, longest first."""
        texts = {t.content for t in self.backend.get_added_tokens_decoder().values() if t.special}
        return tuple(sorted(texts, key=len, reverse=True))

    @functools.cached_property
    def _literal(self) -> HFTokenizer:
        """A copy of the tokenizer that encodes special-token text as ordinary characters."""
        literal = HFTokenizer.from_str(self.backend.to_str())
        literal.encode_special_tokens = True
        return literal

    def _content_spans(
        self, text: str, messages: Sequence[Message], add_generation_prompt: bool
    ) -> list[tuple[int, int]]:
        """Where in ``text`` the contents holding special-token text were rendered, in message order.

        The template is rendered a second time with each content replaced by a
        private-use marker; the pieces between markers are the template's own
        text, so each content is located by position, never by searching for it
        (a content such as ``<|im_start|>`` also occurs in the template's text).
        """
        marked = [i for i, m in enumerate(messages) if isinstance(m.get("content"), str) and self._has_special(m)]
        if not marked:
            return []
        markers = [f"\ue000{i}\ue001" for i in range(len(messages))]
        stand_ins = [
            {**m, "content": markers[i]} if isinstance(m.get("content"), str) else dict(m)
            for i, m in enumerate(messages)
        ]
        rendered = self.apply_chat_template(stand_ins, add_generation_prompt=add_generation_prompt)
        pieces = re.split("\ue000(\\d+)\ue001", rendered)
        spans: list[tuple[int, int]] = []
        seen: set[int] = set()
        ok = text.startswith(pieces[0])
        pos = len(pieces[0])
        for index, after in zip(pieces[1::2], pieces[2::2], strict=True):
            content = str(messages[int(index)]["content"])
            fits = [c for c in (content, content.strip()) if text.startswith(c + after, pos)]
            if not ok or not fits:
                ok = False
                break
            if int(index) in marked:  # every place the template prints it, should it print it twice
                spans.append((pos, pos + len(fits[0])))
                seen.add(int(index))
            pos += len(fits[0]) + len(after)
        if not ok or pos != len(text) or seen != set(marked):
            raise ChatTemplateError(
                f"messages {marked} hold special-token text and the chat template changes how their content is "
                "printed, so it cannot be encoded as plain text; remove the special-token text from the messages"
            )
        return spans

    def _has_special(self, message: Message) -> bool:
        return any(s in str(message["content"]) for s in self.special_texts)

    def stream(self, *, skip_special_tokens: bool = False) -> StreamDecoder:
        """A decoder for tokens arriving one (or a few) at a time."""
        return StreamDecoder(self, skip_special_tokens)


@dataclass
class StreamDecoder:
    """Incremental detokenization that only ever emits whole characters.

    Each call decodes a short window: the tokens since the last emitted
    boundary (``prefix``), with and without the new ones; the difference is
    new text unless it ends in U+FFFD, the mark of an incomplete UTF-8
    sequence, in which case it waits for more tokens. Decoding a window
    rather than each token alone also keeps byte-level spaces and merges
    right. ``flush`` emits whatever is left at the end of a stream.
    """

    tokenizer: Tokenizer
    skip_special_tokens: bool = False
    ids: list[int] = field(default_factory=list)
    prefix: int = 0
    read: int = 0

    def push(self, token_ids: int | Iterable[int]) -> str:
        """Add tokens; the text they complete (possibly empty)."""
        self.ids.extend([token_ids] if isinstance(token_ids, int) else token_ids)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read], skip_special_tokens=self.skip_special_tokens)
        after = decode(self.ids[self.prefix :], skip_special_tokens=self.skip_special_tokens)
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end shows as U+FFFD)."""
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read], skip_special_tokens=self.skip_special_tokens)
        after = decode(self.ids[self.prefix :], skip_special_tokens=self.skip_special_tokens)
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]
