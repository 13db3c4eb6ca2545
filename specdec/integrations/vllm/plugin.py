"""The vLLM plugin: specdec's contract hooks installed in every vLLM process.

vLLM calls ``register`` through its ``vllm.general_plugins`` entry-point group in
the front end, the engine core and each worker, and may call it more than once in
one process. ``register`` installs the hooks once per process and never raises:
a plugin that raised would stop a correct engine from starting, so every failure
(an install that raises, a bad ``SPECDEC_CONTRACTS``, an unwritable report file)
is logged as an error with its cause under the ``specdec.vllm`` logger and leaves
vLLM unpatched.

Setting ``SPECDEC_VLLM_PLUGIN_REPORT=<path>`` makes each process append one JSON
line saying what the plugin did there, so tests and operators can see which
processes run checked.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import sys
from dataclasses import asdict, dataclass

LOGGER_NAME = "specdec.vllm"
REPORT_ENV_VAR = "SPECDEC_VLLM_PLUGIN_REPORT"

logger = logging.getLogger(LOGGER_NAME)


@dataclass(frozen=True)
class PluginOutcome:
    """What ``register`` did in one process: the install result plus where and under which mode."""

    pid: int
    process: str
    """The multiprocessing name: ``MainProcess`` (the front end), ``EngineCore``, ``VllmWorker-0``, ..."""
    vllm_version: str | None
    supported: bool | None
    """None when install raised before it could say."""
    patched: tuple[str, ...]
    contracts: str
    """The contract mode the hooks check under (``SPECDEC_CONTRACTS``), or its raw text when it is invalid."""
    reason: str | None = None
    """Why nothing was patched on an unsupported release (the hooks' own text)."""
    error: str | None = None
    """``ExceptionType: message`` when installing failed; vLLM is then left unpatched."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


_outcome: PluginOutcome | None = None
"""This process's outcome; a forked child sees its parent's pid here and registers anew."""


def register() -> None:
    """Entry point of ``vllm.general_plugins``: install the hooks once in this process, report, never raise."""
    global _outcome
    if _outcome is not None and _outcome.pid == os.getpid():
        return
    try:
        _outcome = _install()
        _log(_outcome)
        _append_report(_outcome)
    except Exception:  # a bug in the plugin itself: still not a reason to stop vLLM
        logger.exception("specdec: the vLLM plugin failed; vLLM runs without specdec's contract checks")


def outcome() -> PluginOutcome | None:
    """What ``register`` did in this process, or None before it ran here."""
    return _outcome if _outcome is not None and _outcome.pid == os.getpid() else None


def _install() -> PluginOutcome:
    mode = os.environ.get("SPECDEC_CONTRACTS", "off")
    imported = False
    try:
        import contracts  # raises on an invalid SPECDEC_CONTRACTS
        from specdec.integrations.vllm import hooks

        imported = True
        mode = contracts.current_mode().value
        report = hooks.install()
    except Exception as exc:
        error = _describe(exc)
        logger.error(
            "specdec: installing the contract hooks into vLLM failed, so vLLM runs unchecked in this process "
            "(pid %d): %s",
            os.getpid(),
            error,
            exc_info=True,
        )
        if imported:
            _restore()
        return _make(vllm_version=_vllm_version(), supported=None, patched=(), mode=mode, error=error)
    return _make(
        vllm_version=report.vllm_version,
        supported=report.supported,
        patched=tuple(report.patched),
        mode=mode,
        reason=report.reason,
    )


def _restore() -> None:
    """Undo whatever a failed install patched before it raised, so vLLM is left as it was."""
    try:
        from specdec.integrations.vllm import hooks

        hooks.uninstall()
    except Exception as exc:
        logger.error("specdec: restoring vLLM after the failed install also failed: %s", _describe(exc))


def _make(
    *,
    vllm_version: str | None,
    supported: bool | None,
    patched: tuple[str, ...],
    mode: str,
    reason: str | None = None,
    error: str | None = None,
) -> PluginOutcome:
    return PluginOutcome(
        pid=os.getpid(),
        process=multiprocessing.current_process().name,
        vllm_version=vllm_version,
        supported=supported,
        patched=patched,
        contracts=mode,
        reason=reason,
        error=error,
    )


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _vllm_version() -> str | None:
    vllm = sys.modules.get("vllm")
    version = getattr(vllm, "__version__", None)
    return version if isinstance(version, str) else None


def _log(outcome: PluginOutcome) -> None:
    if outcome.error is not None:
        return  # _install logged it, with the traceback
    where = f"{outcome.process}, pid {outcome.pid}"
    if not outcome.supported:
        logger.warning(
            "specdec: vLLM %s is left unpatched (%s): %s",
            outcome.vllm_version,
            where,
            outcome.reason or "the release is not in specdec's version table",
        )
    elif not outcome.patched:
        logger.warning(
            "specdec: vLLM %s is supported but no method was patched (%s); draft steps are not checked",
            outcome.vllm_version,
            where,
        )
    else:
        logger.info(
            "specdec: %d vLLM callables checked under SPECDEC_CONTRACTS=%s (vLLM %s, %s)",
            len(outcome.patched),
            outcome.contracts,
            outcome.vllm_version,
            where,
        )


def _append_report(outcome: PluginOutcome) -> None:
    """One JSON line per process, written with a single append so lines from concurrent processes do not mix."""
    path = os.environ.get(REPORT_ENV_VAR, "").strip()
    if not path:
        return
    line = (outcome.to_json() + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as exc:
        logger.error("specdec: cannot append the plugin report to %s=%s: %s", REPORT_ENV_VAR, path, exc)
