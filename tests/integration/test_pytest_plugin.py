"""The pytest plugin's session: a collected node per backend, one torch thread, the type hook, one error for a bad spec.

Every run is a subprocess (``runpytest_subprocess``): the plugin sets torch's
threads and installs import hooks for the whole process, which an in-process
run would leak into this one.
"""

from __future__ import annotations

import re
import textwrap

import pytest

ONE_EXAMPLE = ["--specdec-examples", "1", "--specdec-families", "chunked-prefill", "--specdec-tensor-modes", "cpu"]
NO_CACHE = ["-p", "no:cacheprovider"]


def test_the_suite_is_a_collected_node_that_collect_only_lists_and_counts(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
    cells = ["--specdec-families", "dp,graph", "--specdec-tensor-modes", "cpu"]
    listed = pytester.runpytest_subprocess("--specdec-backend", "eagle", *cells, "--collect-only", *NO_CACHE)
    assert listed.ret == pytest.ExitCode.OK
    listed.stdout.fnmatch_lines(
        [
            "collected 3 items",
            "*<ConformanceSuite specdec[[]eagle[]]>",
            "*<ConformanceItem dp[[]cpu[]]>",
            "*<ConformanceItem graph[[]cpu[]]>",
        ]
    )
    chosen = pytester.runpytest_subprocess(
        "--specdec-backend", "eagle", *cells, "--collect-only", "-q", "-k", "graph or plain", *NO_CACHE
    )
    chosen.stdout.fnmatch_lines(
        ["test_plain.py::test_plain", "specdec[[]eagle[]]::graph[[]cpu[]]", "2/3 tests collected*"]
    )


THREADS_PROBE = textwrap.dedent(
    """
    import subprocess, sys
    import torch

    def test_threads():
        fresh = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.get_num_threads())"], capture_output=True, text=True
        )
        print(f"THREADS {torch.get_num_threads()} FRESH {fresh.stdout.strip()}")
    """
)


def _threads(pytester: pytest.Pytester, *args: str) -> tuple[int, int]:
    """The torch threads a test saw under the plugin, and what a fresh interpreter gets with the same environment."""
    run = pytester.runpytest_subprocess("-s", "-k", "test_threads", *args, *NO_CACHE)
    run.assert_outcomes(passed=1, deselected=run.parseoutcomes().get("deselected", 0))
    [(seen, fresh)] = re.findall(r"THREADS (\d+) FRESH (\d+)", run.stdout.str())
    return int(seen), int(fresh)


def test_a_conformance_session_runs_torch_single_threaded_unless_the_user_chose(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_threads=THREADS_PROBE)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("SPECDEC_THREADS", raising=False)
    backend = ["--specdec-backend", "eagle"]
    assert _threads(pytester, *backend)[0] == 1
    assert _threads(pytester, *backend, "--specdec-threads", "3")[0] == 3
    seen, fresh = _threads(pytester)  # no backend: someone else's test run, torch as it comes
    assert seen == fresh
    monkeypatch.setenv("SPECDEC_THREADS", "2")
    assert _threads(pytester, *backend)[0] == 2
    monkeypatch.delenv("SPECDEC_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", str(max(2, fresh)))
    seen, fresh = _threads(pytester, *backend)
    assert seen == fresh  # the user's own choice for torch stands (torch caps it at the machine's cores)
    bad = pytester.runpytest_subprocess(*backend, "--specdec-threads", "0", *NO_CACHE)
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*--specdec-threads is a number of torch threads, at least 1; got 0*"])


TYPED_BACKEND = textwrap.dedent(
    """
    import torch
    from jaxtyping import Float, Int
    from torch import Tensor

    from specdec.backend_registry import factory_for


    def drafts_of(scores: Float[Tensor, "rows vocab"]) -> Int[Tensor, " rows"]:
        return scores.argmax(-1)


    def make(target, **options):
        drafts_of(torch.ones(2, 5, dtype=torch.int64))  # integer scores where floats are declared: argmax works anyway
        return factory_for("eagle")(target, **options)
    """
)


def test_typecheck_catches_a_wrongly_typed_tensor_in_the_backend_and_is_silent_without_it(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(typed_backend=TYPED_BACKEND)
    args = ["--specdec-backend", "typed_backend:make", *ONE_EXAMPLE, *NO_CACHE]
    plain = pytester.runpytest_subprocess(*args)
    plain.assert_outcomes(passed=1)  # nothing else notices: the drafts come out right
    checked = pytester.runpytest_subprocess(*args, "--specdec-typecheck")
    checked.assert_outcomes(failed=1)
    text = checked.stdout.str()
    assert "TypeCheckError" in text and "drafts_of" in text and "scores" in text, text


def test_typecheck_wants_a_backend_and_a_correct_backend_passes_it(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(typed_backend=TYPED_BACKEND.replace("torch.ones(2, 5, dtype=torch.int64)", "torch.ones(2, 5)"))
    fine = pytester.runpytest_subprocess("--specdec-backend", "typed_backend:make", *ONE_EXAMPLE, "--specdec-typecheck")
    fine.assert_outcomes(passed=1)
    alone = pytester.runpytest_subprocess("--specdec-typecheck", *NO_CACHE)
    assert alone.ret == pytest.ExitCode.USAGE_ERROR
    alone.stderr.fnmatch_lines(["*--specdec-typecheck checks the package of a --specdec-backend; none was given*"])


@pytest.mark.parametrize(
    ("spec", "cause"),
    [
        ("no-such-backend", "ValueError: unknown backend 'no-such-backend'"),
        ("raising_backend:make", "RuntimeError: broken at import (at *raising_backend.py:1)"),
    ],
)
def test_a_spec_that_does_not_resolve_is_one_usage_error_before_any_test(
    pytester: pytest.Pytester, spec: str, cause: str
) -> None:
    pytester.makepyfile(
        test_plain="def test_plain():\n    pass\n",
        raising_backend='raise RuntimeError("broken at import")\n',
    )
    run = pytester.runpytest_subprocess("--specdec-backend", spec, *NO_CACHE)
    assert run.ret == pytest.ExitCode.USAGE_ERROR
    run.stderr.fnmatch_lines(
        [
            f"ERROR: --specdec-backend {spec!r} does not resolve to a backend factory: *{cause}*",
            "installed backends: *eagle*; or give an importable factory as package.module:factory",
        ]
    )
    out = run.stdout.str() + run.stderr.str()
    assert "Traceback" not in out and "importlib" not in out and "passed" not in out, out
    assert out.count("does not resolve") == 1
