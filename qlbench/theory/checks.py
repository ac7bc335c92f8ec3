"""The checks `qlbench verify` reports: every norm and Lipschitz statement of the paper, observed on a traced
forward of the real model (qlbench.theory.tracing) against its right-hand side (qlbench.theory.formulas), over a data
set.

The statements live in qlbench.theory.norm_checks and qlbench.theory.lipschitz_checks, in the paper's order; the
result type `Bound` and its tolerance REL_TOL in qlbench.theory.bounds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qlbench.theory.bounds import Bound, _merge
from qlbench.theory.formulas import vnorm
from qlbench.theory.lipschitz_checks import lipschitz
from qlbench.theory.norm_checks import (
    convex_hull,
    depth_summaries,
    layer_updates,
    query_norms,
    rmsnorm_jacobians,
    softmax_jacobians,
)
from qlbench.theory.tracing import Trace, trace

__all__ = ["NORM_STATEMENTS", "check_model", "perturbed_instruction"]

NORM_STATEMENTS = (convex_hull, layer_updates, depth_summaries, query_norms, rmsnorm_jacobians, softmax_jacobians)


def perturbed_instruction(e: torch.Tensor, generator: torch.Generator, rel: float = 1e-3) -> torch.Tensor:
    """e' = e + delta, a random direction per member with ||delta|| = rel * max(1, ||e||)."""
    d = torch.randn(e.shape, generator=generator, dtype=e.dtype).to(e.device)
    d = d / vnorm(d)[:, None] * (rel * vnorm(e).clamp(min=1))[:, None]
    return e + d


def check_model(
    model: torch.nn.Module,
    x: torch.Tensor,
    instruction: torch.Tensor | None = None,
    *,
    chunk: int = 200,
    seed: int = 0,
    tracer: Callable[..., Trace] = trace,
) -> list[Bound]:
    """Every norm and Lipschitz statement over the samples x (E, N, ...) in float64 (a float64 copy of the weights
    is made in place: pass a model you no longer train). Lipschitz statements probe e' = e + delta per chunk.
    `tracer(model, x_chunk, instruction)` traces one forward (a peft-wrapped model: qlbench.hf.verify)."""
    model.double()
    x = x.to(torch.float64)
    if instruction is not None:
        instruction = instruction.to(torch.float64)
    g = torch.Generator().manual_seed(seed)
    out: list[Bound] = []
    with torch.no_grad():
        for i in range(0, x.shape[1], chunk):
            t = tracer(model, x[:, i : i + chunk], instruction)
            for fn in NORM_STATEMENTS:
                out += fn(t)
            if instruction is not None:
                out += lipschitz(t, perturbed_instruction(instruction, g))
    return _merge(out)
