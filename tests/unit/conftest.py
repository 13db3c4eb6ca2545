"""Fixtures shared by the unit tests."""

from packed_models import medium, restore_choice

__all__ = ["medium", "restore_choice"]
