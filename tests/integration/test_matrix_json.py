"""The matrix JSON names the invariant that caught a failure once per failure, in ``caught_by``, not again in its text."""

from __future__ import annotations

import json
from pathlib import Path

from specdec.testing.matrix import main

HOST = "host_metadata_drafter:make_host_slot_mapping"  # tests/support: slot_mapping left on the host, IN-2 on fake cuda


def test_each_failure_in_the_json_carries_its_invariant_id_once(tmp_path: Path) -> None:
    out = tmp_path / "matrix.json"
    # Two examples: the first drafts nothing (its steps hold their context and run no draft forward), the second fails.
    code = main([HOST], families=["dp"], examples=2, tensor_modes=("fake-cuda",), json_path=str(out), workers=1)
    assert code == 1
    [backend] = json.loads(out.read_text())["backends"]
    [cell] = backend["results"]
    assert cell["caught_by"] == ["IN-2"] and cell["failures"] == 1
    message = cell["first_failure"]
    assert message.startswith("IN-2: fake-cuda replay: ") and message.count("IN-2") == 1, message
    assert "[IN-2]" not in message
