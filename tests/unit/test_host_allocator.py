"""``keep_freed_memory``: a freed mid-sized block stays mapped for the next step, unless the user set the allocator."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specdec import host_allocator
from specdec.host_allocator import MMAP_THRESHOLD, _left_alone

GLIBC = sys.platform.startswith("linux") and host_allocator._is_glibc()

# A block a step would free (16 MiB: below the kept mmap threshold, far above glibc's default one), touched page
# by page so it is resident, then freed: how much of it the process still holds afterwards.
_CHILD = """
import sys
from specdec.host_allocator import keep_freed_memory
status = keep_freed_memory() if sys.argv[1] == "keep" else "default"
page = 4096
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
n = 16 << 20
block = bytearray(n)
block[::page] = b"\\x01" * (n // page)
held = resident()
del block
print(status, (held - resident()) >> 20)
"""


def _released_mib(mode: str, env: dict[str, str] | None = None) -> tuple[str, int]:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode],
        env={**child_env, **(env or {})},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return " ".join(out[:-1]), int(out[-1])


@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's")
def test_a_freed_block_stays_resident_only_with_the_thresholds_kept() -> None:
    assert MMAP_THRESHOLD > 16 << 20
    status, released = _released_mib("default")
    assert released >= 15, f"glibc's default thresholds return a freed 16 MiB block at once, released {released} MiB"
    status, released = _released_mib("keep")
    assert status.startswith("glibc malloc keeps freed memory"), status
    assert released <= 1, f"with the thresholds kept the block stays for reuse, but {released} MiB were released"


@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's")
def test_the_users_allocator_settings_win() -> None:
    status, released = _released_mib("keep", {"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert status == "left as is: MALLOC_TRIM_THRESHOLD_ set in the environment"
    assert released >= 15, "the environment's thresholds stay in force: the block goes back to the kernel"


@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's")
@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "left as is: MALLOC_MMAP_THRESHOLD_ set in the environment"),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "left as is: GLIBC_TUNABLES set in the environment"),
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "left as is: jemalloc preloaded"),
        ({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}, "left as is: tcmalloc preloaded"),
        ({"MALLOC_ARENA_MAX": "2", "GLIBC_TUNABLES": "glibc.pthread.rseq=0", "LD_PRELOAD": "libfoo.so"}, None),
    ],
)
def test_what_leaves_the_allocator_alone(env: dict[str, str], reason: str | None) -> None:
    assert _left_alone(env) == reason


def test_the_cli_keeps_freed_memory_before_any_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from specdec.cli.main import main

    calls: list[str] = []
    monkeypatch.setattr(host_allocator, "keep_freed_memory", lambda: calls.append("kept") or "kept")
    assert main(["contracts", "--format", "text"]) == 0
    assert calls == ["kept"]
