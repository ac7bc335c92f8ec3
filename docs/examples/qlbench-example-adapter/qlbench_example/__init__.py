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
