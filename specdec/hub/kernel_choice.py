"""The fp32 kernel choice remembered per host and model shape in ``$SPECDEC_HOME``, so a load times it once.

``specdec.nn.fp32_kernels`` times both fp32 kernels on a loaded model (1.2-1.4 s
on two cores, a third of loading a cached model) and the choice holds for as
long as the host, torch, the thread count and the model's weight shapes stay
the same. So ``load`` keeps it in ``fp32-kernels.json`` under that key and
reuses it. Reusing it also keeps a model's logits the same bit for bit from one
process to the next on a host, where timing anew could flip a near call. Delete
the file to time again (after a BIOS or memory change, say). A file that cannot
be read or parsed is timed over and rewritten; one that cannot be written (a
read-only home) only costs the timing next time.

A timing taken on a busy host is never kept (``KernelTiming.busy_host``): kept,
it would hold a wrong choice for every later process. Format 1 records were kept
without that check, and format 2 ones without a prefill's timing, so they are
timed over once.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from specdec.nn.fp32_kernels import choose_fp32_kernels, product_shapes, timed_on_busy_host, timed_products
from specdec.nn.packed_linear import set_fp32_f_linear_rows
from specdec.nn.transformer import Transformer

CHOICE_FILE = "fp32-kernels.json"
FORMAT = 3
"""3: the timings include a prefill's (2 had none, and 1 did not check the host was quiet): older are timed over."""


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else what ``platform`` says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def host_key(shapes: list[list[int]]) -> str:
    """What a timing depends on: the CPU, how many of it, torch, its threads and the weight shapes timed."""
    digest = hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16]
    return (
        f"{cpu_model()} x{os.cpu_count()} | torch {torch.__version__} | {torch.get_num_threads()} threads | "
        f"products {digest}"
    )


def choose_fp32_kernels_once(model: Transformer, home: Path) -> frozenset[int] | None:
    """The row counts ``F.linear`` takes for ``model``'s fp32 products, from ``home``'s record or timed and recorded.

    None where there is nothing to choose (``timed_products``): then nothing is read, timed or changed. Where the
    host stayed busy through the timing, no product takes ``F.linear`` and nothing is recorded.
    """
    products = timed_products(model)
    if not products:
        return None
    path = home / CHOICE_FILE
    key = host_key(product_shapes(products))
    entries = _read(path)
    known = entries.get(key)
    if isinstance(known, dict) and _valid_rows(known.get("f_linear_rows")):
        rows = frozenset(int(r) for r in known["f_linear_rows"])
        set_fp32_f_linear_rows(rows)
        return rows
    timings = choose_fp32_kernels(model)
    if timed_on_busy_host(timings):
        return frozenset()  # the packed path for now; a later load on a quiet host times and keeps the choice
    rows = frozenset(t.rows for t in timings if t.f_linear_wins)
    entries[key] = {
        "f_linear_rows": sorted(rows),
        "timings_ms": [
            {
                "rows": t.rows,
                "packed": round(1000 * t.packed_s, 3),
                "f_linear": round(1000 * t.f_linear_s, 3),
                "cpu_wait": None if t.cpu_wait is None else round(t.cpu_wait, 4),
            }
            for t in timings
        ],
        "measured_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    _write(path, entries)
    return rows


def _valid_rows(rows: object) -> bool:
    return isinstance(rows, list) and all(type(r) is int and r >= 1 for r in rows)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("hosts"), dict):
        return {}
    return dict(data["hosts"])


def _write(path: Path, entries: dict[str, Any]) -> None:
    """Atomically (a reader never sees half a file); a home that cannot be written is left as it is."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps({"format": FORMAT, "hosts": entries}, indent=1, sort_keys=True) + "\n")
        os.replace(partial, path)
    except OSError:
        pass
