"""MoE-LoRA: per layer, a mixture of LoRA experts chosen per input by a learned top-k gate on the layer input
(routing without sharing: no parameter is shared across layers). The form of MoLA / MixLoRA-style mixtures:

    logits = W_g x                                           (X experts; W_g (X, d_in), no bias)
    w = softmax over the top-k logits, 0 for the others      (renormalised over the k selected)
    y = W0 x + b0 + s sum_j w_j B_j (A_j x),   s = alpha / r

qlbench interpretation (docs/methods.md): one gate per adapted layer, reading that layer's input (every token of a
Transformer's sequence is routed on its own); no load-balancing loss and no router noise (the gate learns from the
task loss alone, as every other method does); A_j Kaiming-uniform as LoRA's, B_j = 0 (the model equals the frozen
one at step 0), W_g as an nn.Linear's default U(+-1/sqrt(d_in)). Defaults X = 3 experts of rank 2, top-2,
alpha = 4 (s = 2, LoRA's default scale): L (X r (d_in + d_out) + X d_in) trainable parameters, 0.94 of LoRA r = 8
on both backbones (4 experts would give 1.25).

The experts are computed densely (every expert's A_j x, the unselected ones weighted 0): exact, and cheaper than
gathering at these widths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from qlbench.adapters.base import AdapterMethod, Site, check_positive, check_positive_int
from qlbench.adapters.lora import LoraConfig
from qlbench.adapters.routing import topk_softmax
from qlbench.stacked import ForwardContext, StackedLinear, bmm_add, param, stacked_linear, uniform_members

NAME = "moe-lora"
FAMILY = "moe"


@dataclass
class MoeLoraConfig(LoraConfig):
    r: int = 2  # rank of each expert
    alpha: float = 4.0  # s = alpha / r = 2, LoRA's default scale
    n_experts: int = 3  # X
    top_k: int = 2  # experts mixed per input

    def __post_init__(self):
        super().__post_init__()
        check_positive_int(self, "n_experts", "top_k")
        check_positive(self, "alpha")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k must be <= n_experts ({self.n_experts}), got {self.top_k}")


def top_k_weights(logits: torch.Tensor, k: int | tuple[int, ...]) -> torch.Tensor:
    """(E, N, X) gate logits -> (E, N, X) weights: softmax over each row's top-k logits, 0 elsewhere (k: one, or
    one per member, routing.topk_softmax)."""
    return topk_softmax(logits, k)


class MoeLoraLinear(nn.Module):
    """A frozen StackedLinear plus s sum_j w_j(x) B_j A_j x over X rank-r experts."""

    def __init__(self, base: StackedLinear, site: Site, config: MoeLoraConfig, generators: list[torch.Generator]):
        super().__init__()
        c = config
        self.base, self.scale, self.r, self.top_k = base, c.scale, c.r, c.top_k
        self.member_top_k: tuple[int, ...] | None = None  # k per member (a stacked Pareto grid; None: top_k)
        bound = 1.0 / math.sqrt(base.d_in)
        # the experts' A_j stacked row-wise (E, X r, d_in); B_j side by side (E, d_out, X r)
        self.moe_A = param(uniform_members((c.n_experts * c.r, base.d_in), bound, generators), like=base.weight)
        self.moe_B = nn.Parameter(base.weight.new_zeros(base.members, base.d_out, c.n_experts * c.r))
        self.moe_gate = param(uniform_members((c.n_experts, base.d_in), bound, generators), like=base.weight)

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        """x (E, ..., d_in) -> the experts' weights (E, ..., X)."""
        return top_k_weights(stacked_linear(x, self.moe_gate), self.member_top_k or self.top_k)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        E, d_in = x.shape[0], x.shape[-1]
        x2 = x.reshape(E, -1, d_in)  # (E, N, d_in)
        w = self.gate(x2)  # (E, N, X)
        t = stacked_linear(x2, self.moe_A)  # every expert's A_j x (E, N, X r)
        t = (t.view(*w.shape, self.r) * w.unsqueeze(-1)).view(t.shape)  # w_j A_j x
        y = bmm_add(self.base(x2), t, self.moe_B.transpose(1, 2), alpha=self.scale)  # (E, N, d_out)
        return y.view(*x.shape[:-1], y.shape[-1])


METHOD = AdapterMethod(
    NAME,
    "MoE-LoRA: per layer, X LoRA experts mixed by a learned top-k gate on the layer input (routing, no sharing)",
    MoeLoraConfig,
    MoeLoraLinear,
    family=FAMILY,
    kind="routed",
)
