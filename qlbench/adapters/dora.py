"""DoRA (Liu et al. 2024, arXiv 2402.09353): weight-decomposed low-rank adaptation.

    V = W0 + s B A,   g = m / stopgrad(||V||_row),   y = g * (V x) + b0

The row norm is taken per output unit (over d_in) and detached from the graph, as the paper's section 4.3 and
huggingface peft do; the bias is not rescaled. m (d_out) starts at ||W0||_row, so g = 1 (exactly) at step 0, and
A, B start as LoRA's. The config is LoRA's (r, alpha, targets): DoRA adds no hyper-parameter.
Trainable: L (r (d_in + d_out) + d_out).

The norm is clamped at NORM_EPS so that a zero row of V (a dead unit of W0, before B has moved) gives a finite g
instead of 0 / 0 = NaN; m starts at the same clamped norm, so such a row also has g = 1 and trains like LoRA's.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from qlbench.adapters.base import AdapterMethod, Site
from qlbench.adapters.lora import LoraConfig, lora_factors
from qlbench.stacked import ForwardContext, StackedLinear, bmm_add, layout_grads, stacked_linear

NORM_EPS = 1e-12  # far below any live row norm, far above float32's smallest normal (1e-38)


def weight_norm(V: torch.Tensor) -> torch.Tensor:
    """stopgrad(||V||_row) clamped at NORM_EPS: V (E, d_out, d_in) -> (E, d_out)."""
    return torch.linalg.vector_norm(V.detach(), dim=-1).clamp_min(NORM_EPS)


def rescaled_linear(x: torch.Tensor, V: torch.Tensor, g: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """g * (V x) + b for x (E, ..., d_in), V (E, d_out, d_in), g (E, d_out): g is folded into V's rows, so the
    whole layer is one batched matmul and the bias stays unscaled."""
    return stacked_linear(x, g.unsqueeze(-1) * V, bias)


class DoraLinear(nn.Module):
    """A frozen StackedLinear re-parameterised as magnitude m times the direction of W0 + s B A."""

    def __init__(self, base: StackedLinear, site: Site, config: LoraConfig, generators: list[torch.Generator]):
        super().__init__()
        self.base, self.scale = base, config.scale
        self.dora_A, self.dora_B = lora_factors(base, config.r, generators)
        # the same function as the forward's denominator, so g = m / ||W0|| is exactly 1 at step 0
        self.dora_m = nn.Parameter(weight_norm(base.weight))  # (E, d_out)

    def adapted_weight(self) -> torch.Tensor:
        """V = W0 + s B A, (E, d_out, d_in): off the CPU one batched matmul (stacked.bmm_add, as LoRA's merged
        weight), 3 kernels fewer per layer and step; on the CPU three ops, which keep the CPU's numbers' bits (the
        same values, rounded in another order; tests/test_stacked.py compares the two)."""
        if layout_grads(self.dora_A):
            return bmm_add(self.base.weight, self.dora_B, self.dora_A, alpha=self.scale)
        return self.base.weight + self.scale * (self.dora_B @ self.dora_A)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        V = self.adapted_weight()
        g = self.dora_m / weight_norm(V)  # (E, d_out)
        return rescaled_linear(x, V, g, self.base.bias)  # (E, ..., d_out)


METHOD = AdapterMethod(
    "dora", "DoRA: magnitude m times the row-normalised direction of W0 + s B A", LoraConfig, DoraLinear
)
