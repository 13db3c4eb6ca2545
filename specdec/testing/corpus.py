"""The whole mutation corpus: the runtime's own mutants plus every corpus published under ``specdec.mutants``.

A backend ships mutants of its own code the way it ships itself: an entry point
``name = "package.module:MUTANTS"`` in the ``specdec.mutants`` group naming a
sequence of ``specdec.testing.mutant.Mutant`` (the built-in drafters publish
``backends.testing.mutants:MUTANTS``). The runtime never imports a backend
package; a corpus module is imported only when the corpus is asked for.
Mutant names are unique across the whole corpus.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from importlib.metadata import EntryPoint, entry_points

from specdec.testing.mutant import Mutant
from specdec.testing.mutants import MUTANTS as OWN

GROUP = "specdec.mutants"
OWN_SOURCE = "specdec.testing.mutants"


def _describe(ep: EntryPoint) -> str:
    dist = f"distribution {ep.dist.name!r}" if ep.dist is not None else "an unknown distribution"
    return f"entry point {ep.name} = {ep.value!r} of {dist} (group {GROUP!r})"


def load_entry_point(ep: EntryPoint) -> tuple[Mutant, ...]:
    """The mutants an entry point names; a clear error when it cannot be loaded or is not a sequence of Mutant."""
    try:
        loaded = ep.load()
    except Exception as e:
        raise ImportError(f"mutation corpus: loading {_describe(ep)} failed: {type(e).__name__}: {e}") from e
    if isinstance(loaded, str | bytes) or not isinstance(loaded, Sequence):
        raise TypeError(
            f"mutation corpus: {_describe(ep)} names a {type(loaded).__qualname__}; expected a sequence of "
            "specdec.testing.mutant.Mutant (e.g. a module-level MUTANTS tuple)"
        )
    wrong = [type(m).__qualname__ for m in loaded if not isinstance(m, Mutant)]
    if wrong:
        raise TypeError(
            f"mutation corpus: {_describe(ep)} holds {wrong} besides Mutant; every item must be a "
            "specdec.testing.mutant.Mutant"
        )
    return tuple(loaded)


def sources() -> list[tuple[str, tuple[Mutant, ...]]]:
    """Each corpus with where it came from: the runtime's own first, then the entry points by name."""
    found: list[tuple[str, tuple[Mutant, ...]]] = [(OWN_SOURCE, OWN)]
    seen: set[str] = set()
    for ep in sorted(entry_points(group=GROUP), key=lambda e: (e.name, e.value)):
        if ep.value in seen:  # one project found on two paths: the same corpus, not a second one
            continue
        seen.add(ep.value)
        found.append((_describe(ep), load_entry_point(ep)))
    return found


def corpus() -> tuple[Mutant, ...]:
    """Every mutant in ``specdec mutate``'s order; a name claimed twice raises, naming both corpora."""
    owner: dict[str, str] = {}
    out: list[Mutant] = []
    for source, mutants in sources():
        for m in mutants:
            if m.name in owner:
                raise ValueError(
                    f"mutant name {m.name!r} is claimed twice: by {owner[m.name]} and by {source}; "
                    "mutant names must be unique across the corpus"
                )
            owner[m.name] = source
            out.append(m)
    return tuple(out)


def get(names: Sequence[str] | None = None) -> list[Mutant]:
    """The named mutants (all when ``names`` is None), in corpus order; unknown names raise."""
    everything = corpus()
    if names is None:
        return list(everything)
    known = {m.name for m in everything}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(
            f"unknown mutant(s) {unknown}; known: {sorted(known)} (corpora come from the {GROUP!r} entry points: "
            "reinstall a package whose entry points changed, e.g. pip install -e .)"
        )
    wanted = set(names)
    return [m for m in everything if m.name in wanted]


@contextmanager
def injected(names: Sequence[str]) -> Iterator[None]:
    """The named mutants applied for the block (none: nothing is looked up), restored on exit."""
    if not names:
        yield
        return
    with ExitStack() as stack:
        for mutant in get(names):
            stack.enter_context(mutant.apply())
        yield
