"""``register()``, the ``vllm.general_plugins`` entry point: once per process, loud on failure, never raising."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from specdec.integrations.vllm import hooks, plugin
from specdec.integrations.vllm.hooks import HookReport

SUPPORTED = HookReport("0.32.0", True, ("vllm.v1.worker.gpu.spec_decode.eagle:EagleSpeculator.propose",))
UNSUPPORTED = HookReport(
    "0.27.0", False, (), reason="vLLM 0.27.0 is not in specdec's version table; supported: 0.28 to 0.32"
)


class FakeHooks:
    """Stands in for ``hooks.install``/``uninstall`` and counts the calls."""

    def __init__(self, result: HookReport | Exception) -> None:
        self.result = result
        self.installs = 0
        self.uninstalls = 0

    def install(self) -> HookReport:
        self.installs += 1
        if isinstance(self.result, Exception):
            raise self.result
        return self.result

    def uninstall(self) -> None:
        self.uninstalls += 1


@pytest.fixture
def report_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A fresh process as far as the plugin knows, reporting to a file of its own."""
    monkeypatch.setattr(plugin, "_outcome", None)
    path = tmp_path / "plugin-report.jsonl"
    monkeypatch.setenv(plugin.REPORT_ENV_VAR, str(path))
    return path


@pytest.fixture
def fake_hooks(monkeypatch: pytest.MonkeyPatch) -> Callable[[HookReport | Exception], FakeHooks]:
    def make(result: HookReport | Exception) -> FakeHooks:
        fake = FakeHooks(result)
        monkeypatch.setattr(hooks, "install", fake.install)
        monkeypatch.setattr(hooks, "uninstall", fake.uninstall)
        return fake

    return make


def report_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def plugin_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == plugin.LOGGER_NAME]


def test_a_second_load_in_the_same_process_installs_logs_and_reports_nothing_new(
    report_file: Path, fake_hooks: Callable[[HookReport | Exception], FakeHooks], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=plugin.LOGGER_NAME)
    fake = fake_hooks(SUPPORTED)
    plugin.register()
    plugin.register()
    assert fake.installs == 1
    assert len(plugin_records(caplog)) == 1
    [line] = report_lines(report_file)
    assert line == {
        "pid": os.getpid(),
        "process": "MainProcess",
        "vllm_version": "0.32.0",
        "supported": True,
        "patched": list(SUPPORTED.patched),
        "contracts": "shapes",  # the test suite's mode (tests/conftest.py)
        "reason": None,
        "error": None,
    }
    outcome = plugin.outcome()
    assert outcome is not None and outcome.patched == SUPPORTED.patched


def test_a_forked_child_registers_again(
    report_file: Path,
    fake_hooks: Callable[[HookReport | Exception], FakeHooks],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's own once-per-process flag is inherited across fork, but a child that loads plugins gets a line."""
    fake = fake_hooks(SUPPORTED)
    plugin.register()
    parent = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: parent + 1)
    assert plugin.outcome() is None
    plugin.register()
    assert fake.installs == 2
    assert [line["pid"] for line in report_lines(report_file)] == [parent, parent + 1]


def test_an_unsupported_release_is_logged_once_with_the_hooks_reason(
    report_file: Path, fake_hooks: Callable[[HookReport | Exception], FakeHooks], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=plugin.LOGGER_NAME)
    fake = fake_hooks(UNSUPPORTED)
    plugin.register()
    plugin.register()
    [record] = plugin_records(caplog)
    assert record.levelno == logging.WARNING
    assert "0.27.0" in record.getMessage()
    assert UNSUPPORTED.reason is not None and UNSUPPORTED.reason in record.getMessage()
    assert fake.uninstalls == 0
    [line] = report_lines(report_file)
    assert (line["supported"], line["patched"], line["reason"]) == (False, [], UNSUPPORTED.reason)


def test_a_supported_release_with_nothing_patched_is_a_warning(
    report_file: Path, fake_hooks: Callable[[HookReport | Exception], FakeHooks], caplog: pytest.LogCaptureFixture
) -> None:
    fake_hooks(HookReport("0.32.0", True, ()))
    plugin.register()
    [record] = plugin_records(caplog)
    assert record.levelno == logging.WARNING and "no method was patched" in record.getMessage()


def test_an_install_that_raises_is_logged_with_its_traceback_and_undone(
    report_file: Path, fake_hooks: Callable[[HookReport | Exception], FakeHooks], caplog: pytest.LogCaptureFixture
) -> None:
    fake = fake_hooks(RuntimeError("planted install bug"))
    plugin.register()  # does not raise
    plugin.register()
    assert fake.installs == 1
    assert fake.uninstalls == 1  # whatever the failed install patched is restored
    [record] = plugin_records(caplog)
    assert record.levelno == logging.ERROR
    assert "planted install bug" in record.getMessage() and "unchecked" in record.getMessage()
    assert record.exc_info is not None
    [line] = report_lines(report_file)
    assert line["error"] == "RuntimeError: planted install bug"
    assert (line["supported"], line["patched"]) == (None, [])


def test_an_unwritable_report_file_is_logged_and_the_install_still_stands(
    report_file: Path,
    fake_hooks: Callable[[HookReport | Exception], FakeHooks],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(plugin.REPORT_ENV_VAR, str(report_file.parent))  # a directory
    fake = fake_hooks(SUPPORTED)
    plugin.register()
    assert fake.installs == 1 and fake.uninstalls == 0
    errors = [record for record in plugin_records(caplog) if record.levelno == logging.ERROR]
    assert len(errors) == 1 and plugin.REPORT_ENV_VAR in errors[0].getMessage()


def test_the_entry_point_vllm_loads_is_register() -> None:
    from importlib.metadata import entry_points

    [entry] = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "specdec"]
    assert entry.load() is plugin.register


def test_vllms_plugin_loader_survives_a_failing_install(
    report_file: Path, fake_hooks: Callable[[HookReport | Exception], FakeHooks], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM calls general plugins without a try; a raising register would stop the engine from starting."""
    import vllm.plugins

    monkeypatch.setenv("VLLM_PLUGINS", "specdec")
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    fake = fake_hooks(RuntimeError("planted install bug"))
    vllm.plugins.load_general_plugins()
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)  # loaded twice in one process
    vllm.plugins.load_general_plugins()
    assert fake.installs == 1
    [line] = report_lines(report_file)
    assert line["error"] == "RuntimeError: planted install bug"


def test_an_invalid_contract_mode_is_reported_and_does_not_raise(tmp_path: Path) -> None:
    """``SPECDEC_CONTRACTS`` is read when contracts is imported; a typo there must not stop vLLM, nor pass quietly."""
    report = tmp_path / "plugin-report.jsonl"
    env = {**os.environ, "SPECDEC_CONTRACTS": "ful", plugin.REPORT_ENV_VAR: str(report)}
    code = "from specdec.integrations.vllm import plugin; plugin.register(); print('registered')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "registered"
    assert "not a contract mode" in done.stderr  # the error log line, on stderr without any logging setup
    [line] = report_lines(report)
    assert line["contracts"] == "ful"
    assert "SPECDEC_CONTRACTS='ful' is not a contract mode" in line["error"]
    assert line["patched"] == []


def test_a_bug_in_the_plugin_itself_is_logged_not_raised(
    report_file: Path,
    fake_hooks: Callable[[HookReport | Exception], FakeHooks],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken_log(outcome: plugin.PluginOutcome) -> None:
        raise KeyError("planted plugin bug")

    monkeypatch.setattr(plugin, "_log", broken_log)
    fake_hooks(SUPPORTED)
    plugin.register()
    [record] = plugin_records(caplog)
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert record.exc_info[1] is not None and "planted plugin bug" in str(record.exc_info[1])
