"""ShareLoRA (Song et al. 2024, arXiv 2406.10785): LoRA whose down-projection A (or up-projection B, or both) is one
matrix shared by every layer of the same kind, the sharing baseline the paper cites.

    y = W0 x + b0 + s B_l A x        (share "A": A shared, each layer its own B_l; s = alpha / r, as LoRA)

qlbench interpretation of "the same kind": the layers of one role (the deep-narrow's hidden layers; the Transformer's
q, k, v, o, fc1 and fc2 each apart), as ShareLoRA shares one A per projection type (its query, key and value each
keep their own). `share` picks the shared factor: "A" (the paper's ShareA, the default), "B" or "AB". Init as LoRA:
A ~ U(+-1/sqrt(d_in)), B = 0 (the adapted model equals the frozen one at step 0); a shared factor is drawn once per
member, in the shared module, roles in forward order.

Trainable, share "A", L layers of R roles: R r d_in + L r d_out (8,448 on the deep-narrow MLP and 73,728 on the
Transformer at r = 8, against LoRA's 16,384 and 131,072).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from qlbench.adapters.base import AdapterMethod, Site, check_positive, check_positive_int, check_targets
from qlbench.adapters.lora import lora_linear
from qlbench.stacked import ForwardContext, StackedLinear, param, uniform_members

NAME = "share-lora"
FAMILY = "sharelora"  # parameter prefix and model.shared key (a method name with a hyphen is no attribute name)
SHARES = ("A", "B", "AB")


@dataclass
class ShareLoraConfig:
    r: int = 8  # rank
    alpha: float = 16.0  # scaling numerator: s = alpha / r
    share: str = "A"  # the factor(s) one role's layers share: A, B or AB
    targets: tuple[str, ...] | None = None  # backbone target roles; None = the backbone's default

    def __post_init__(self):
        check_positive_int(self, "r")
        check_positive(self, "alpha")
        check_targets(self)
        if self.share not in SHARES:
            raise ValueError(f"share must be one of {', '.join(SHARES)}, got {self.share!r}")

    @property
    def scale(self) -> float:
        return self.alpha / self.r


class SharedFactors(nn.Module):
    """The shared module: per role, the shared A (E, r, d_in) and/or B (E, d_out, r), as `A_<role>`, `B_<role>`."""

    def __init__(
        self, model: nn.Module, sites: list[Site], config: ShareLoraConfig, generators: list[torch.Generator], like
    ):
        super().__init__()
        shapes: dict[str, tuple[int, int]] = {}
        for site in sites:  # one shape per role, or the role's layers cannot share a factor
            base = model.get_submodule(site.target.path)
            shape = shapes.setdefault(site.target.role, (base.d_in, base.d_out))
            if shape != (base.d_in, base.d_out):
                raise ValueError(f"share-lora: the {site.target.role} layers differ in shape, so they cannot share")
        self.factors = nn.ParameterDict()
        for role, (d_in, d_out) in shapes.items():  # forward order of first appearance
            if "A" in config.share:
                bound = 1.0 / math.sqrt(d_in)
                self.factors[f"A_{role}"] = param(uniform_members((config.r, d_in), bound, generators), like=like)
            if "B" in config.share:
                self.factors[f"B_{role}"] = nn.Parameter(like.new_zeros(len(generators), d_out, config.r))


class ShareLoraLinear(nn.Module):
    """A frozen StackedLinear plus s B A x, with A and/or B its role's shared factor."""

    def __init__(self, base: StackedLinear, site: Site, config: ShareLoraConfig, generators: list[torch.Generator]):
        super().__init__()
        self.base, self.scale, self.role = base, config.scale, site.target.role
        if "A" not in config.share:
            bound = 1.0 / math.sqrt(base.d_in)
            self.sharelora_A = param(uniform_members((config.r, base.d_in), bound, generators), like=base.weight)
        if "B" not in config.share:
            self.sharelora_B = nn.Parameter(base.weight.new_zeros(base.members, base.d_out, config.r))

    def factors(self, shared: nn.ModuleDict) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's A (E, r, d_in) and B (E, d_out, r): its own, or its role's shared one."""
        own = shared[FAMILY].factors
        A = getattr(self, "sharelora_A", None)
        B = getattr(self, "sharelora_B", None)
        return (own[f"A_{self.role}"] if A is None else A), (own[f"B_{self.role}"] if B is None else B)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        A, B = self.factors(ctx.shared)
        return lora_linear(x, self.base, A, B, self.scale)  # (E, ..., d_out)


METHOD = AdapterMethod(
    NAME,
    "ShareLoRA: LoRA with one A (or B, or both) shared by all layers of a role: sharing, no routing",
    ShareLoraConfig,
    ShareLoraLinear,
    shared_cls=SharedFactors,
    family=FAMILY,
)
