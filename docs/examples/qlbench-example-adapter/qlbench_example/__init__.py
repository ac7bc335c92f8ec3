"""Gated LoRA: y = W0 x + b0 + g B (A x), with A and B both random and a learned gate g per layer that starts at 0,
so the adapted model starts as the pretrained one (ReZero's idea applied to a low-rank update).

A method written for ONE plain model (qlbench.adapters.MemberMethod): qlbench builds it once per member, each under
its own seed, and trains the members as one stack (docs/extending.md in the qlbench repository).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from qlbench.adapters import MemberMethod


@dataclass
class GatedLoraConfig:
    r: int = 4  # rank

    def __post_init__(self):
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"r must be an integer >= 1, got {self.r!r}")


class GatedLoraLinear(nn.Module):
    def __init__(self, base: nn.Linear, r: int):
        super().__init__()
        self.base = base  # frozen by qlbench before adapt_member is called
        bound = 1 / math.sqrt(base.in_features)
        self.A = nn.Parameter(torch.empty(r, base.in_features).uniform_(-bound, bound))  # (r, d_in)
        self.B = nn.Parameter(torch.empty(base.out_features, r).uniform_(-bound, bound))  # (d_out, r)
        self.gate = nn.Parameter(torch.zeros(()))  # g = 0: the pretrained model at step 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (..., d_in) -> (..., d_out)
        return self.base(x) + self.gate * (x @ self.A.T @ self.B.T)


class GatedLora(MemberMethod):
    name = "gated-lora"
    summary = "gated LoRA: a random rank-r update behind a learned gate that starts at 0 (example package)"
    kind = "static"
    config_cls = GatedLoraConfig

    def adapt_member(self, model: nn.Module, config: GatedLoraConfig, targets: list[str]) -> nn.Module:
        for path in targets:  # the dotted paths of the nn.Linear layers to adapt
            parent, _, child = path.rpartition(".")
            owner = model.get_submodule(parent)
            setattr(owner, child, GatedLoraLinear(getattr(owner, child), config.r))
        return model


METHOD = GatedLora()


# A second method: LoRA itself, written here as an outside method. Same update (s B A x, s = 16 / 8), same initial
# distribution (A ~ U(+-1/sqrt(d_in)), B = 0) as qlbench's `lora`, but drawn from this method's own random stream
# (torch's global generator, seeded per member by qlbench). Against `lora` it is an A/A pair: any difference the
# benchmark reports between the two is noise, so a comparison that calls it a win or a loss is miscalibrated.
@dataclass
class LoraTwinConfig:
    r: int = 8  # rank
    alpha: float = 16.0  # s = alpha / r

    def __post_init__(self):
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"r must be an integer >= 1, got {self.r!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"alpha must be a number > 0, got {self.alpha!r}")


class LoraTwinLinear(nn.Module):
    def __init__(self, base: nn.Linear, r: int, alpha: float):
        super().__init__()
        self.base, self.scale = base, alpha / r
        bound = 1 / math.sqrt(base.in_features)
        self.A = nn.Parameter(torch.empty(r, base.in_features).uniform_(-bound, bound))  # (r, d_in)
        self.B = nn.Parameter(torch.zeros(base.out_features, r))  # (d_out, r): the pretrained model at step 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (..., d_in) -> (..., d_out)
        return self.base(x) + self.scale * (x @ self.A.T @ self.B.T)


class LoraTwin(MemberMethod):
    name = "lora-twin"
    summary = "LoRA written as an outside method, from its own random stream: an A/A row against lora (example)"
    kind = "static"
    config_cls = LoraTwinConfig

    def adapt_member(self, model: nn.Module, config: LoraTwinConfig, targets: list[str]) -> nn.Module:
        for path in targets:
            parent, _, child = path.rpartition(".")
            owner = model.get_submodule(parent)
            setattr(owner, child, LoraTwinLinear(getattr(owner, child), config.r, config.alpha))
        return model


LORA_TWIN = LoraTwin()
