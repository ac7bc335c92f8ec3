"""LoRA matched in size: plain LoRA whose rank is chosen so that its trainable parameters match another method's
(by default `instruct-queryable`, the largest routed adapter), the control that keeps a comparison from being a
win of a bigger model over a smaller one.

    y = W0 x + b0 + s B A x,   r = argmin_r |L r (d_in + d_out) - P_matched|   (ties: the larger r)

P_matched is the matched method's trainable count at its defaults (and this config's targets) on the very
backbone being adapted, counted on a shapes-only copy (nothing drawn, nothing allocated). qlbench interpretation:
the scale s = alpha / r stays LoRA's 2 (alpha = 2 r, as the Pareto sweep's LoRA points), so the row differs from
`lora` in its rank only. On the deep-narrow (32 layers of 32 x 32) this gives r = 15, 30,720 parameters against
instruct-queryable's 30,048; on the Transformer (q, k, v, o of 8 layers, d = 256) r = 9, 147,456 against 144,736.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn

from qlbench import stacked
from qlbench.adapters import lora
from qlbench.adapters.base import AdapterMethod, Method, check_positive, check_targets, trainable_parameter_count

NAME = "lora-matched"
MATCHED = "instruct-queryable"


@dataclass
class MatchedLoraConfig:
    alpha: float | None = None  # LoRA's scaling numerator, s = alpha / r; None: 2 r (LoRA's s = 16 / 8 = 2)
    targets: tuple[str, ...] | None = None  # backbone target roles (also the matched method's); None = default

    def __post_init__(self):
        if self.alpha is not None:
            check_positive(self, "alpha")
        check_targets(self)


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose tensors are on the meta device (shapes only; the weights are not copied)."""
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad) for p in model.parameters()}
    memo |= {id(b): torch.empty_like(b, device="meta") for b in model.buffers()}
    return copy.deepcopy(model, memo)


def nearest_rank(target: int, unit: int) -> int:
    """The rank r >= 1 whose count r * unit is nearest `target` (ties: the larger r)."""
    low = max(1, target // unit)
    return min((low, low + 1), key=lambda r: (abs(r * unit - target), -r))


def per_rank(model: nn.Module, targets: tuple[str, ...] | None = None) -> int:
    """Trainable parameters one rank of LoRA adds on this backbone: sum over target layers of d_in + d_out."""
    with stacked.shapes_only():
        one = lora.METHOD.build(meta_copy(model), lora.LoraConfig(r=1, targets=targets), [torch.Generator()], None)
    return trainable_parameter_count(one)


class MatchedLora(AdapterMethod):
    """LoRA's layers (family "lora": the same parameter names), built at the matched rank."""

    def __init__(self, methods: dict[str, Method]):
        super().__init__(
            NAME,
            f"LoRA with the rank that matches {MATCHED}'s trainable parameters (the size control)",
            MatchedLoraConfig,
            lora.LoraLinear,
            family=lora.METHOD.family,
        )
        self.methods = methods  # the registry, read at build time (the matched method registers after this one)

    def rank(self, backbone: nn.Module, config: MatchedLoraConfig, y_train=None) -> int:
        """The rank whose LoRA count is nearest the matched method's on `backbone` (ties: the larger)."""
        matched = self.methods[MATCHED]
        with stacked.shapes_only():
            # its defaults and our targets, at most one routing block per layer (a small test backbone)
            cfg = matched.make_config(targets=config.targets, n_blocks=min(4, backbone.n_layers))
            target = trainable_parameter_count(matched.build(meta_copy(backbone), cfg, [torch.Generator()], y_train))
        return nearest_rank(target, per_rank(backbone, config.targets))

    def lora_config(self, backbone: nn.Module, config: MatchedLoraConfig, y_train=None) -> lora.LoraConfig:
        """The plain LoRA config this row trains on `backbone`."""
        r = self.rank(backbone, config, y_train)
        return lora.LoraConfig(r=r, alpha=2.0 * r if config.alpha is None else config.alpha, targets=config.targets)

    def build(self, backbone, config, generators, y_train):
        return lora.METHOD.build(backbone, self.lora_config(backbone, config, y_train), generators, y_train)
