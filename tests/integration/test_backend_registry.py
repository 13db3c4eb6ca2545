"""Backend discovery: entry points in group ``specdec.backends``, in-process registrations, factory specs.

Installed distributions are simulated with real ``.dist-info`` folders on a
temporary ``sys.path`` entry, so discovery runs through ``importlib.metadata``
exactly as it does for a pip-installed backend.
"""

from __future__ import annotations

import functools
import sys
import textwrap
from collections.abc import Callable, Iterator
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest

import backends
import backends.registry
from backends.autoregressive import AutoregressiveSpeculator
from backends.dflash import DFlashSpeculator
from backends.dspark import DSparkSpeculator
from specdec import backend_registry
from specdec.backend_registry import available_backends, create, factory_for, load_factory, register, unregister
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.speculator import Speculator

BUILTINS = {
    "eagle": "backends.registry:make_eagle",
    "draft-model": "backends.registry:make_draft_model",
    "dflash": "backends.registry:make_dflash",
    "dspark": "backends.registry:make_dspark",
}

# A backend module as a third party would ship it; it records that it was imported.
FAKE_BACKEND = textwrap.dedent(
    """
    from contracts import StepKind

    IMPORTED = True


    class Spec:
        name = "fake"
        num_spec_tokens = 2
        draft_step_kinds = frozenset({StepKind.DRAFT_DECODE})
        aux_layers = ()

        def __init__(self, **options):
            self.options = options

        def bind(self, target, ctx):
            pass

        def propose(self, step, ctx):
            raise NotImplementedError

        def finish(self, req_id):
            pass


    def make(target, **options):
        return Spec(**options)


    def make_wrong(target, **options):
        return "not a speculator"


    NOT_CALLABLE = 42
    """
)


@functools.cache
def tiny_target() -> Transformer:
    return Transformer(ModelConfig.tiny(), seed=0)


@pytest.fixture(autouse=True)
def _isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from a fresh scan and no in-process registrations; both are restored afterwards."""
    monkeypatch.setattr(backend_registry, "_scanned", None)
    monkeypatch.setattr(backend_registry, "_registered", {})


Install = Callable[..., None]


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Install]:
    """``install(dist, {name: "module:attr"}, module_name=source)``: a distribution visible on ``sys.path``."""
    modules: list[str] = []
    monkeypatch.syspath_prepend(str(tmp_path))

    def _install(dist: str, eps: dict[str, str], **module_sources: str) -> None:
        info = tmp_path / f"{dist}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        lines = "".join(f"{name} = {value}\n" for name, value in eps.items())
        (info / "entry_points.txt").write_text(f"[specdec.backends]\n{lines}")
        for module, source in module_sources.items():
            (tmp_path / f"{module}.py").write_text(source)
            modules.append(module)

    yield _install
    for module in modules:
        sys.modules.pop(module, None)


# -- discovery -------------------------------------------------------------------------------------


def test_builtins_are_discovered_through_entry_points_without_importing_them() -> None:
    found = available_backends()
    for name, value in BUILTINS.items():
        ep = found[name]
        assert isinstance(ep, EntryPoint), f"{name} should come from an entry point, not a registration"
        assert (ep.group, ep.value) == ("specdec.backends", value)
        assert ep.load() is getattr(backends.registry, value.split(":")[1])


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("eagle", AutoregressiveSpeculator),
        ("draft-model", AutoregressiveSpeculator),
        ("dflash", DFlashSpeculator),
        ("dspark", DSparkSpeculator),
    ],
)
def test_builtins_are_created_by_name_and_the_old_entry_points_still_work(name: str, kind: type) -> None:
    spec = create(name, tiny_target(), num_spec_tokens=3)
    assert isinstance(spec, kind) and isinstance(spec, Speculator) and spec.num_spec_tokens == 3
    assert backends.create is create and backends.registry.create is create


def test_an_installed_distribution_is_found_and_imported_only_when_created(install: Install) -> None:
    install("specdec_fake", {"fake": "fake_backend_a:make"}, fake_backend_a=FAKE_BACKEND)
    found = available_backends()
    assert isinstance(found["fake"], EntryPoint) and found["fake"].value == "fake_backend_a:make"
    assert "fake_backend_a" not in sys.modules, "listing backends must not import them"
    spec: Any = create("fake", tiny_target(), k=7)
    assert "fake_backend_a" in sys.modules and spec.options == {"k": 7}


def test_a_backend_installed_after_the_first_scan_is_found(install: Install) -> None:
    assert "late" not in available_backends()
    install("specdec_late", {"late": "fake_backend_b:make"}, fake_backend_b=FAKE_BACKEND)
    assert create("late", tiny_target()).name == "fake"


# -- in-process registrations and duplicates -----------------------------------------------------


def _factory(target: Transformer, **options: Any) -> Speculator:
    return backends.registry.make_eagle(target, **options)


def _other_factory(target: Transformer, **options: Any) -> Speculator:
    return backends.registry.make_draft_model(target, **options)


def test_register_then_create_then_unregister() -> None:
    assert register("mine", _factory) is _factory
    assert available_backends()["mine"] is _factory
    assert isinstance(create("mine", tiny_target(), num_spec_tokens=2), AutoregressiveSpeculator)
    unregister("mine")
    assert "mine" not in available_backends()
    with pytest.raises(ValueError, match=r"backend 'mine' was not registered in-process"):
        unregister("mine")


def test_registering_a_name_twice_names_both_factories() -> None:
    register("mine", _factory)
    with pytest.raises(ValueError, match=r"'mine' is claimed twice: .*test_backend_registry:_factory.*_other_factory"):
        register("mine", _other_factory)


def test_registering_an_installed_name_names_the_entry_point() -> None:
    with pytest.raises(
        ValueError,
        match=r"'eagle' is claimed twice: entry point eagle = 'backends.registry:make_eagle' of distribution "
        r"'specdec' and in-process register\(\) of .*_factory",
    ):
        register("eagle", _factory)


def test_two_distributions_claiming_one_name_are_an_error_naming_both(install: Install) -> None:
    install("specdec_one", {"clash": "fake_backend_c:make"}, fake_backend_c=FAKE_BACKEND)
    install("specdec_two", {"clash": "fake_backend_d:make"}, fake_backend_d=FAKE_BACKEND)
    both = r"'clash' is claimed twice: .*'fake_backend_\w:make' of distribution 'specdec_\w+' and .*'specdec_\w+'"
    with pytest.raises(ValueError, match=both):
        available_backends()
    with pytest.raises(ValueError, match=both):
        create("clash", tiny_target())
    assert isinstance(create("eagle", tiny_target()), AutoregressiveSpeculator), "other names are unaffected"


@pytest.mark.parametrize("name", ["", "a:b"])
def test_register_rejects_bad_names(name: str) -> None:
    with pytest.raises(ValueError, match="a backend name must be a non-empty string without ':'"):
        register(name, _factory)


def test_register_rejects_a_non_callable() -> None:
    # Under the test suite's jaxtyping hook beartype answers first, naming the parameter; without it, register does.
    with pytest.raises(TypeError, match=r"backend 'x': a factory must be callable|parameter 'factory'"):
        register("x", 42)  # type: ignore[arg-type]


# -- errors when creating ------------------------------------------------------------------------


def test_an_unknown_name_lists_the_known_ones() -> None:
    register("mine", _factory)
    with pytest.raises(
        ValueError,
        match=r"unknown backend 'hydra'; known backends: \['dflash', 'draft-model', 'dspark', 'eagle',.*'mine'.*\]"
        r".*specdec.backends",
    ):
        create("hydra", tiny_target())


def test_a_factory_returning_something_else_is_named() -> None:
    register("wrong", lambda target, **options: object())
    with pytest.raises(
        TypeError,
        match=r"backend 'wrong' \(in-process register\(\) of .*<lambda>\) returned a builtins.object, not a "
        r"specdec.Speculator; missing members: \['name', .*'finish'\]",
    ):
        create("wrong", tiny_target())


def test_an_entry_point_returning_something_else_is_named(install: Install) -> None:
    install("specdec_wrong", {"wrong": "fake_backend_e:make_wrong"}, fake_backend_e=FAKE_BACKEND)
    with pytest.raises(
        TypeError,
        match=r"backend 'wrong' \(entry point wrong = 'fake_backend_e:make_wrong' of distribution 'specdec_wrong'\) "
        r"returned a builtins.str, not a specdec.Speculator",
    ):
        create("wrong", tiny_target())


def test_an_entry_point_that_cannot_load_is_named(install: Install) -> None:
    install("specdec_broken", {"broken": "fake_backend_missing:make", "notcallable": "fake_backend_f:NOT_CALLABLE"})
    install("specdec_f", {}, fake_backend_f=FAKE_BACKEND)
    with pytest.raises(
        ImportError, match=r"backend 'broken': loading entry point broken = 'fake_backend_missing:make' .* failed"
    ):
        create("broken", tiny_target())
    with pytest.raises(TypeError, match=r"backend 'notcallable': entry point .* names 42, which is not a callable"):
        create("notcallable", tiny_target())


def test_create_accepts_a_factory_spec() -> None:
    spec = create("backends.registry:make_dflash", tiny_target(), num_spec_tokens=2)
    assert isinstance(spec, DFlashSpeculator)


# -- load_factory --------------------------------------------------------------------------------


def test_load_factory_resolves_module_and_attribute() -> None:
    assert load_factory("backends.registry:make_eagle") is backends.registry.make_eagle
    assert load_factory(" specdec.backend_registry : create ") is create
    assert load_factory("backends.registry:make_eagle.__call__") == backends.registry.make_eagle.__call__


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        ("backends.registry.make_eagle", ValueError, r"must look like 'package.module:factory'.*no ':'"),
        (":make_eagle", ValueError, "must look like 'package.module:factory'"),
        ("backends.registry:", ValueError, "must look like 'package.module:factory'"),
        ("a:b:c", ValueError, "must look like 'package.module:factory'"),
        ("no_such_package_xyz:make", ImportError, r"cannot import module 'no_such_package_xyz'"),
        ("backends.registry:make_medusa", ImportError, r"module 'backends.registry' has no attribute 'make_medusa'"),
        ("specdec:__version__", TypeError, r"names a str, not a callable factory"),
    ],
)
def test_load_factory_rejects_bad_specs_clearly(spec: str, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        load_factory(spec)


def test_names_option_counts_only_named_parameters() -> None:
    from specdec.backend_registry import names_option

    assert all(names_option(b, "pretrained") for b in ("eagle", "dflash", "dspark"))
    assert not names_option("draft-model", "pretrained")  # takes **options but names no weights
    register("mine", _factory)  # **options only: an unknown keyword may still be refused
    try:
        assert not names_option("mine", "pretrained")
        assert not names_option(_factory, "pretrained")  # a factory, as the conformance kit passes it
        assert names_option("dspark", "capacity") and names_option(factory_for("dspark"), "capacity")
        assert not names_option(factory_for("eagle"), "capacity")
    finally:
        unregister("mine")


@pytest.mark.parametrize(
    ("name", "misspelled"),
    [("eagle", "fussed"), ("draft-model", "draft_is_target"), ("dflash", "num_spec_token"), ("dspark", "capacty")],
)
def test_a_built_in_factory_refuses_an_option_it_does_not_take(name: str, misspelled: str) -> None:
    # They used to swallow unknown options (**_), so a misspelled option was silently ignored.
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{misspelled}'"):
        create(name, tiny_target(), **{misspelled: 1})
