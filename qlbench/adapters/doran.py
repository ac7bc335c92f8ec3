"""DoRAN (arXiv 2510.04331): DoRA with a learnable stabiliser and generated factors.

qlbench interpretation (docs/methods.md): DoRA (dora.py) with the two stabilisers the paper names,

    V = W0 + s B A,   g = m / (stopgrad(||V||_row) + tau_l),   tau_l = softplus(rho_l),   y = g * (V x) + b0

- tau_l is one learnable positive scalar per layer; rho_l starts at softplus^-1(tau_init), tau_init = 1e-3;
- m (d_out) starts at ||W0||_row + tau_l, so g = 1 (exactly) at step 0;
- (A, B) come from RepLoRA's shared generators (the "auxiliary networks", replora.py), registered under this
  method's own prefix: A = G_A(A~), B = G_B(B~), latents initialised as LoRA's factors, so B = 0 at step 0. As
  there, the latents of a key's layers are stacked in the shared module (`shared.doran.<key>.latent_A` /
  `latent_B`) and every layer's factors of a key are generated in one batched call per forward (generated.py);
  the layers keep tau_l and m.
The row norm is DoRA's (detached, clamped at dora.NORM_EPS).

Trainable: L (r (d_in + d_out) + d_out + 1) + sum over (role, shape) keys of 2 h (d_in + d_out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from qlbench.adapters.base import AdapterMethod, Site, check_positive
from qlbench.adapters.dora import rescaled_linear, weight_norm
from qlbench.adapters.generated import GeneratedFactors
from qlbench.adapters.replora import RepLoraConfig, RepLoraGenerators
from qlbench.stacked import ForwardContext, StackedLinear, bmm_add, memberwise

NAME = "doran"


@dataclass
class DoranConfig(RepLoraConfig):
    tau_init: float = 1e-3  # the stabiliser tau_l = softplus(rho_l) at step 0

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "tau_init")


class DoranLinear(GeneratedFactors, nn.Module):
    """A frozen StackedLinear re-parameterised as m times the stabilised direction of W0 + s G_B(B~) G_A(A~)."""

    def __init__(self, base: StackedLinear, site: Site, config: DoranConfig, generators: list[torch.Generator]):
        super().__init__()
        self.base, self.scale = base, config.scale
        self.init_slot(NAME, site, base)  # slot `layer` of the key's latents
        rho = math.log(math.expm1(config.tau_init))  # softplus^-1
        w = base.weight
        self.doran_rho = nn.Parameter(torch.full((base.members,), rho, device=w.device, dtype=w.dtype))  # (E,)
        # the forward's denominator at step 0 (V = W0 there), so g = 1 exactly
        self.doran_m = nn.Parameter(weight_norm(base.weight) + self.tau().detach())  # (E, d_out)

    def tau(self) -> torch.Tensor:
        """tau_l = softplus(rho_l), (E, 1) to broadcast over the output units."""
        return memberwise(F.softplus, self.doran_rho).unsqueeze(-1)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        A, B = self.factors(ctx.shared, ctx.scratch)
        V = bmm_add(self.base.weight, B, A, alpha=self.scale)  # W0 + s B A (E, d_out, d_in)
        g = self.doran_m / (weight_norm(V) + self.tau())  # (E, d_out)
        return rescaled_linear(x, V, g, self.base.bias)  # (E, ..., d_out)


METHOD = AdapterMethod(
    NAME,
    "DoRAN: DoRA with a learnable norm stabiliser and RepLoRA-generated factors",
    DoranConfig,
    DoranLinear,
    shared_cls=RepLoraGenerators,
)
