"""Explicit, stable seed derivation: every random stream in qlbench comes from a named seed, never the global RNG."""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from a tuple of names and numbers, stable across processes and platforms.

    `derive_seed("data", "dropwave", "target", 3)` always gives the same integer; Python's `hash()` is salted
    per process, so it cannot be used here.
    """
    text = "\x1f".join(repr(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & ((1 << 63) - 1)


def generator(*parts: object, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch.Generator seeded with `derive_seed(*parts)`."""
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(*parts))
    return g
