"""Full fine-tuning: every backbone parameter trains, with AdamW or with SOAP (Vyas et al. 2024, arXiv 2409.11321).

SOAP preconditions each weight matrix with its own eigenbasis, so on a stacked (E, out, in) leaf it would mix the
members; `PerMember` gives every member its own optimizer over aliases of its slices instead (no copies: an alias
shares storage with the stacked parameter, and SOAP updates parameters in place).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from qlbench.adapters.base import Method, check_positive_int


class FullFineTune(Method):
    summary = "full fine-tuning of every backbone parameter with AdamW"

    def __init__(self, name: str = "full-adamw"):
        self.name = name

    def build(self, backbone, config, generators, y_train):
        for p in backbone.parameters():
            p.requires_grad_(True)
        return backbone


@dataclass
class SoapConfig:
    """pytorch_optimizer.SOAP's defaults, as methods.md fixes them."""

    betas: tuple[float, float] = (0.95, 0.95)
    precondition_frequency: int = 10

    def __post_init__(self):
        ok = (
            isinstance(self.betas, (tuple, list))
            and len(self.betas) == 2
            and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in self.betas)
        )
        if not ok:
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        self.betas = tuple(self.betas)
        check_positive_int(self, "precondition_frequency")


class PerMember:
    """One optimizer per stacked member, each over aliases of that member's parameter slices.

    A member whose gradient turns non-finite is skipped from then on (it is diverged; the others go on), which
    also keeps SOAP's eigendecompositions away from NaNs.
    """

    def __init__(self, params: list[nn.Parameter], make: callable):
        self.params = params
        members = params[0].shape[0]
        self.aliases = [[nn.Parameter(p.data[e]) for p in params] for e in range(members)]  # views, no copies
        self.optimizers = [make(aliases) for aliases in self.aliases]
        self.live = [True] * members

    def step(self) -> None:
        for e, (opt, aliases) in enumerate(zip(self.optimizers, self.aliases)):
            if not self.live[e]:
                continue
            grads = [None if p.grad is None else p.grad[e] for p in self.params]
            if not all(g is None or torch.isfinite(g).all() for g in grads):
                self.live[e] = False
                continue
            for alias, g in zip(aliases, grads):
                alias.grad = g
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        return {"members": [opt.state_dict() for opt in self.optimizers], "live": list(self.live)}


class FullSoap(FullFineTune):
    name = "full-soap"
    summary = "full fine-tuning with SOAP (pytorch_optimizer.SOAP), one optimizer per stacked member"
    config_cls = SoapConfig

    def __init__(self):
        super().__init__(self.name)

    def optimizer(self, model, config: SoapConfig, lr, weight_decay):
        from pytorch_optimizer import SOAP  # imported here: only this method needs the package

        c = config
        params = [p for p in model.parameters() if p.requires_grad]
        return PerMember(
            params,
            lambda ps: SOAP(
                ps, lr=lr, weight_decay=weight_decay, betas=c.betas, precondition_frequency=c.precondition_frequency
            ),
        )


FULL_ADAMW = FullFineTune()
FULL_SOAP = FullSoap()
