"""LoRA (Hu et al. 2022): y = W0 x + b0 + s B (A x), s = alpha / r.

A (r, d_in) starts Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(d_in), 1/sqrt(d_in)), and B (d_out, r) at
zero, so the adapted model equals the frozen one at step 0. Trainable: L r (d_in + d_out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from qlbench.adapters.base import AdapterMethod, Site, check_positive, check_positive_int, check_targets
from qlbench.stacked import ForwardContext, StackedLinear, bmm_add, param, stacked_linear, uniform_members


@dataclass
class LoraConfig:
    r: int = 8  # rank
    alpha: float = 16.0  # scaling numerator: s = alpha / r
    targets: tuple[str, ...] | None = None  # backbone target roles; None = the backbone's default

    def __post_init__(self):
        check_positive_int(self, "r")
        check_positive(self, "alpha")
        check_targets(self)

    @property
    def scale(self) -> float:
        return self.alpha / self.r


def lora_factors(base: StackedLinear, r: int, generators: list[torch.Generator]) -> tuple[nn.Parameter, nn.Parameter]:
    """LoRA's initial A (E, r, d_in) ~ U(+-1/sqrt(d_in)) and B (E, d_out, r) = 0."""
    A = param(uniform_members((r, base.d_in), 1.0 / math.sqrt(base.d_in), generators), like=base.weight)
    B = nn.Parameter(torch.zeros(base.members, base.d_out, r, device=base.weight.device, dtype=base.weight.dtype))
    return A, B


def low_rank_update(y: torch.Tensor, t: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    """y + scale * B t for y (E, ..., d_out), t (E, ..., r), B (E, d_out, r), in one fused batched matmul."""
    if y.dim() == 3:
        return bmm_add(y, t, B.transpose(1, 2), alpha=scale)
    E, r = t.shape[0], t.shape[-1]
    out = bmm_add(y.reshape(E, -1, y.shape[-1]), t.reshape(E, -1, r), B.transpose(1, 2), alpha=scale)
    return out.view(y.shape)


def merges(d_in: int, d_out: int, r: int) -> bool:
    """Whether W0 x + s B A x is cheaper through the merged weight W0 + s B A.

    Per step, merging adds the weight gradient of a full d_out x d_in matrix (2 N d_in d_out FLOPs for N rows) and
    saves the rank-r matmuls of the unmerged form and their gradients (about 6 N r (d_in + d_out)), so it pays
    when d_in d_out < 3 r (d_in + d_out), whatever N: the deep-narrow's 32 x 32 layers merge, the Transformer's
    256-wide projections do not (both measured; docs/speed.md).
    """
    return d_in * d_out < 3 * r * (d_in + d_out)


def lora_linear(x: torch.Tensor, base: StackedLinear, A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    """W0 x + b0 + scale B A x for x (E, ..., d_in), A (E, r, d_in), B (E, d_out, r), merged or not (`merges`)."""
    if merges(base.d_in, base.d_out, A.shape[1]):
        return stacked_linear(x, bmm_add(base.weight, B, A, alpha=scale), base.bias)  # W (E, d_out, d_in)
    return low_rank_update(base(x), stacked_linear(x, A), B, scale)


class LoraLinear(nn.Module):
    """A frozen StackedLinear plus a rank-r update."""

    def __init__(self, base: StackedLinear, site: Site, config: LoraConfig, generators: list[torch.Generator]):
        super().__init__()
        self.base, self.scale = base, config.scale
        self.lora_A, self.lora_B = lora_factors(base, config.r, generators)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return lora_linear(x, self.base, self.lora_A, self.lora_B, self.scale)  # (E, ..., d_out)


METHOD = AdapterMethod("lora", "LoRA: static rank-r update s B A per layer", LoraConfig, LoraLinear)
