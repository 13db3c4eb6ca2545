"""Test support for the built-in drafters: their mutation corpus (``backends.testing.mutants``)."""
