"""Wrap vLLM's speculator methods so that every draft step is checked against the contracts.

(Skeleton: the lead is writing the real implementation; the API below is fixed.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HookReport:
    """What ``install`` did in this process."""

    vllm_version: str | None
    """The vLLM release found, or None when vLLM is not importable."""
    supported: bool
    """Whether the adapter's version table covers that release."""
    patched: tuple[str, ...]
    """``module:Class.method`` (or ``module:function``) of every wrapped callable."""
    reason: str | None = None
    """Why nothing was patched, when nothing was."""


def install() -> HookReport:
    """Wrap the methods the version table names; idempotent (a second call patches nothing twice)."""
    raise NotImplementedError


def uninstall() -> None:
    """Restore every wrapped callable."""
    raise NotImplementedError
