"""Autoregressive drafting: EAGLE-style heads and separate draft models."""

from backends.autoregressive.networks import EagleHead, ModelDrafter
from backends.autoregressive.speculator import AutoregressiveSpeculator

__all__ = ["AutoregressiveSpeculator", "EagleHead", "ModelDrafter"]
