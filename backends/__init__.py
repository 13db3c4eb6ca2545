"""Drafters behind one ``Speculator`` interface (autoregressive, DFlash, DSpark)."""
