"""Each adaptive draft-length decision as one character, so that a run's decisions read as a string.

Timings on a shared machine move by tens of percent from one run to the next;
what the policy chose does not depend on them nearly as much. A run's decision
string says where its speedup or slowdown came from: ``....p.....2222L3``
drafted nothing for five steps, probed once, drafted nothing again, then drafted
up to two tokens, once only a prompt lookup's drafts, then up to three.

One character per decision (the engine decides once per step in which a
request may draft):

- ``c``: calibrating, the first steps' fixed lengths that fit the step cost;
- ``b``: drafting nothing to measure plain decoding's step again (a baseline);
- ``.``: no drafts;
- ``p``: probes only (every drafting request drafts one token to test its estimate);
- ``L``: free drafts only (a prompt lookup's: no model proposal runs);
- ``1``-``9``: the longest draft the drafter proposes (``+``: 10 or more), with
  any free drafts and probes besides.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from specdec.step_cost import longest_proposed

CALIBRATING = "c"
BASELINE = "b"
NO_DRAFTS = "."
PROBES_ONLY = "p"
FREE_ONLY = "L"
LONG_PROPOSAL = "+"

KINDS = ("proposed", "free", "probe", "none", "baseline", "calibrating")
"""The kinds ``count_decisions`` sorts the characters into, in the order reports list them."""
_KIND_OF = {
    CALIBRATING: "calibrating",
    BASELINE: "baseline",
    NO_DRAFTS: "none",
    PROBES_ONLY: "probe",
    FREE_ONLY: "free",
}


def decision_symbol(lengths: Mapping[str, int], *, free: Collection[str], probes: Collection[str]) -> str:
    """The character of a decision that gave each request ``lengths[r]`` drafts.

    ``free``: the requests whose drafts cost no proposal; ``probes``: those this
    decision probes (one draft to test an estimate that said not to draft).
    """
    drafting = [rid for rid, n in lengths.items() if n]
    if not drafting:
        return NO_DRAFTS
    if all(rid in probes for rid in drafting):
        return PROBES_ONLY
    longest = longest_proposed(lengths, free)
    if longest == 0:
        return FREE_ONLY
    return str(longest) if longest < 10 else LONG_PROPOSAL


def count_decisions(trace: str) -> dict[str, int]:
    """How many decisions of each of ``KINDS`` a trace holds (every kind present, 0 where none)."""
    counts = dict.fromkeys(KINDS, 0)
    for symbol in trace:
        kind = _KIND_OF.get(symbol)
        if kind is None:
            if not (symbol.isdigit() and symbol != "0") and symbol != LONG_PROPOSAL:
                raise ValueError(f"{symbol!r} in a decision trace is none of the characters a decision is written as")
            kind = "proposed"
        counts[kind] += 1
    return counts


def describe_decisions(trace: str) -> str:
    """A trace's counts in a few words for a summary line: ``"12 proposed, 40 none, 8 calibrating"``."""
    counts = count_decisions(trace)
    return ", ".join(f"{n} {kind}" for kind, n in counts.items() if n) or "none made"
