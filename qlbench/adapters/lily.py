"""Lily (Zhong et al. 2024, arXiv 2407.09946, "Low-Rank Interconnected Adaptation across Layers"): layer-local
low-dimensional projectors A and a set of high-dimensional projector experts B shared by every layer of a
(role, shape), mixed by a per-layer router (sharing and routing), as peft 0.21's `lily` tuner computes it.

For a layer l of group G (the adapted layers of one role and shape, in forward order):

    h = A_{a(l)} x                                   (r; A shared by blocks of `stride` consecutive layers of G)
    p = mean over the forward's tokens of softmax(R_l h)   (R_l (n_experts, r), per layer; p (n_experts,))
    y = W0 x + b0 + s h (sum_j p_j B_j)              (B_j (r, d_out), shared by all of G; s a plain multiplier)

The mixture p is averaged over every sample (and token) of the batch the forward sees, as in peft: a sample's
output depends on the others in its batch (qlbench averages per member; training sees minibatches, evaluation
chunks of up to 1,024 test samples). Init as peft: A and R_l Kaiming-uniform (U(+-1/sqrt(fan_in))), B_j = 0, so the
model equals the frozen one at step 0. Defaults r = 13, two experts, stride 1, s = 1: the one setting with a single
rank whose trainable count is within 10% of LoRA r = 8 on both backbones (0.914 deep-narrow, 1.022 Transformer).

Trainable per group of n layers: ceil(n / stride) r d_in + n_experts r d_out + n r n_experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from qlbench.adapters.base import AdapterMethod, Site, check_positive, check_positive_int, check_targets
from qlbench.adapters.generated import key_slots, role_shape_key
from qlbench.stacked import ForwardContext, StackedLinear, bmm_add, param, stacked_linear, uniform_members

NAME = "lily"


@dataclass
class LilyConfig:
    r: int = 13  # rank of the low-dimensional projectors
    n_experts: int = 2  # high-dimensional projector experts per group (peft's num_B; at least 2)
    stride: int = 1  # consecutive layers of a group sharing one A (peft's stride_A)
    scale: float = 1.0  # s (peft's `scaling`)
    targets: tuple[str, ...] | None = None  # backbone target roles; None = the backbone's default

    def __post_init__(self):
        check_positive_int(self, "r", "n_experts", "stride")
        check_positive(self, "scale")
        check_targets(self)
        if self.n_experts < 2:
            raise ValueError(f"n_experts must be >= 2 (one expert is a LoRA), got {self.n_experts}")


class LilyGroup(nn.Module):
    """One (role, shape) group's shared projectors: A blocks (E, ceil(n / stride), r, d_in), experts
    B (E, n_experts, r, d_out)."""

    def __init__(self, n_layers: int, d_in: int, d_out: int, config: LilyConfig, generators, like):
        super().__init__()
        c = config
        blocks = math.ceil(n_layers / c.stride)
        self.A = param(uniform_members((blocks, c.r, d_in), 1.0 / math.sqrt(d_in), generators), like=like)
        self.B = nn.Parameter(like.new_zeros(len(generators), c.n_experts, c.r, d_out))


class LilyShared(nn.ModuleDict):
    """The shared module: one LilyGroup per (role, shape) key, built in forward order."""

    def __init__(self, model: nn.Module, sites: list[Site], config: LilyConfig, generators, like):
        super().__init__()
        for key, group in key_slots(model, sites).items():
            base = model.get_submodule(group[0].target.path)
            self[key] = LilyGroup(len(group), base.d_in, base.d_out, config, generators, like)


def expert_mixture(h: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """h (E, N, r), router (E, n_experts, r) -> p (E, n_experts): the routing softmax averaged over the N tokens."""
    return torch.softmax(stacked_linear(h, router), dim=-1).mean(dim=1)


class LilyLinear(nn.Module):
    """A frozen StackedLinear plus s h (sum_j p_j B_j), h = A x, with A and the B_j from the group's shared module."""

    def __init__(self, base: StackedLinear, site: Site, config: LilyConfig, generators: list[torch.Generator]):
        super().__init__()
        self.base, self.scale = base, config.scale
        self.key, self.block = role_shape_key(site, base), site.target.layer // config.stride
        bound = 1.0 / math.sqrt(config.r)
        self.lily_router = param(uniform_members((config.n_experts, config.r), bound, generators), like=base.weight)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        group = ctx.shared[NAME][self.key]
        E, d_in = x.shape[0], x.shape[-1]
        x2 = x.reshape(E, -1, d_in)  # (E, N, d_in): every token of the batch
        h = stacked_linear(x2, group.A[:, self.block])  # (E, N, r)
        p = expert_mixture(h, self.lily_router)  # (E, n_experts)
        mixed = torch.einsum("ej,ejro->ero", p, group.B)  # sum_j p_j B_j (E, r, d_out)
        y = bmm_add(self.base(x2), h, mixed, alpha=self.scale)  # (E, N, d_out)
        return y.view(*x.shape[:-1], y.shape[-1])


METHOD = AdapterMethod(
    NAME,
    "Lily: per-layer projectors A, high-dimensional experts B shared by a (role, shape) group, mixed by a "
    "per-layer router",
    LilyConfig,
    LilyLinear,
    shared_cls=LilyShared,
    kind="routed",
)
