"""``--prompts-file``: prompts one per line, as plain text or as JSON lines, from a file or stdin (``-``).

A file is JSON lines when its name ends in ``.jsonl`` or its first non-space
character is ``{``; each line is then ``{"prompt": "..."}`` or ``{"messages":
[{"role": ..., "content": ...}, ...]}``. Otherwise each line is one prompt.
Empty lines and malformed ones are mistakes, named by their line number:
skipping them would silently shift which output answers which prompt.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.cli.errors import UsageError, check_text
from specdec.hub.tokenizer import Message

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class FilePrompt:
    """One prompt of the file: text, or a conversation for the chat template."""

    line: int
    text: str | None = None
    messages: list[Message] | None = None

    @property
    def shown(self) -> Any:
        """The prompt as the JSON output echoes it."""
        return self.text if self.messages is None else self.messages


def read_prompts(path: str) -> list[FilePrompt]:
    """The prompts of ``path`` (``-``: stdin), in order; a usage error names the first bad line."""
    if path == "-":
        content = sys.stdin.read()
        where = "stdin"
    else:
        file = Path(path)
        if not file.is_file():
            raise UsageError(f"--prompts-file {path}: no such file")
        try:
            content = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise UsageError(f"--prompts-file {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        where = path
    check_text(content, f"--prompts-file {where}")
    lines = content.splitlines()
    as_json = path.endswith(".jsonl") or content.lstrip().startswith("{")
    prompts = [_parse(line, n, where, as_json) for n, line in enumerate(lines, start=1)]
    if not prompts:
        raise UsageError(f"--prompts-file {where} holds no prompt; expected one prompt per line")
    return prompts


def _parse(line: str, n: int, where: str, as_json: bool) -> FilePrompt:
    if not line.strip():
        raise UsageError(f"--prompts-file {where}, line {n}: empty; expected one prompt per line")
    if not as_json:
        return FilePrompt(n, text=line)
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--prompts-file {where}, line {n}: not JSON ({exc.msg}); {_EXPECTED}") from None
    if not isinstance(record, dict) or len(record) != 1 or not {"prompt", "messages"} & set(record):
        raise UsageError(f"--prompts-file {where}, line {n}: {_EXPECTED}")
    if "prompt" in record:
        text = record["prompt"]
        if not isinstance(text, str) or not text:
            raise UsageError(f'--prompts-file {where}, line {n}: "prompt" must be non-empty text')
        return FilePrompt(n, text=text)
    messages = record["messages"]
    ok = isinstance(messages, list) and messages and all(_is_message(m) for m in messages)
    if not ok:
        raise UsageError(
            f'--prompts-file {where}, line {n}: "messages" must be a non-empty list of '
            f'{{"role": one of {", ".join(ROLES)}, "content": text}}'
        )
    return FilePrompt(n, messages=[{"role": m["role"], "content": m["content"]} for m in messages])


_EXPECTED = 'expected {"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]}'


def _is_message(m: object) -> bool:
    return (
        isinstance(m, dict) and set(m) == {"role", "content"} and m["role"] in ROLES and isinstance(m["content"], str)
    )
