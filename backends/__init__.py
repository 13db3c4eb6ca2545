"""Drafters behind one ``Speculator`` interface; built by name through ``specdec.backend_registry``."""

from backends.registry import create
from specdec.speculator import DraftContext, Proposal, Speculator, TargetStep

__all__ = ["DraftContext", "Proposal", "Speculator", "TargetStep", "create"]
