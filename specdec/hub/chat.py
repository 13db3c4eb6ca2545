"""Chat templates: the model's own Jinja template, rendered the way Hugging Face renders it.

The template comes from the GGUF (``tokenizer.chat_template``), so the prompt
format is the one the model was tuned on rather than a hand-written copy.
Rendering follows transformers: a sandboxed, immutable environment with
``trim_blocks`` and ``lstrip_blocks``, loop controls, ``raise_exception``, a
``tojson`` filter and ``strftime_now``; the special tokens are in scope.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, Any]
"""``{"role": "system" | "user" | "assistant", "content": str}``; templates may read more keys."""


class ChatTemplateError(ValueError):
    """The template is malformed or rejected the conversation (its own ``raise_exception``)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template rejected the conversation: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """Compile once per template text."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def render_chat(
    template: str,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str | None] | None = None,
    **extra: Any,
) -> str:
    """The prompt text for ``messages``; ``add_generation_prompt`` opens the assistant's turn."""
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str) or "content" not in message:
            raise ChatTemplateError(f"message {i} needs a string 'role' and a 'content', got {dict(message)!r}")
    context = {**(special_tokens or {}), **extra}
    try:
        return compile_template(template).render(
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **context
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed to render: {exc}") from exc
