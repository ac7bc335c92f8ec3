"""Helpers shared by the test modules (imported as `helpers`: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import torch

from qlbench import cli
from qlbench.backbones import DeepNarrowConfig, TransformerConfig
from qlbench.seeding import generator

F64 = torch.float64
TINY_DEEP_NARROW = DeepNarrowConfig(depth=4)
TINY_TRANSFORMER = TransformerConfig(d_model=32, n_layers=4, n_heads=4, d_ff=64)


def gens(*tag, members=2) -> list[torch.Generator]:
    """One seeded generator per member: `members` an int n (members 0..n-1) or the member keys."""
    keys = range(members) if isinstance(members, int) else members
    return [generator("test", *tag, e) for e in keys]


def one_line_error(capsys, argv: list[str]) -> str:
    """Run the CLI, check it failed with exit code 2 and one stderr line (no traceback); return that line."""
    code = cli.main(argv)
    _, err = capsys.readouterr()
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]
