"""Drafters behind one ``Speculator`` interface, and the registry that builds them by name."""

from backends.registry import BACKENDS, create, register
from specdec.speculator import DraftContext, Proposal, Speculator, TargetStep

__all__ = ["BACKENDS", "DraftContext", "Proposal", "Speculator", "TargetStep", "create", "register"]
