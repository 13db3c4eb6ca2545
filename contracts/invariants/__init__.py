"""Registered invariants, one module per family; importing this package registers them all."""

from contracts.invariants import (  # noqa: F401
    autoregressive,
    block,
    descriptor,
    dp,
    heads,
    inputs,
    kv,
    padded_requests,
    proposal,
    target,
    verifier,
)
