"""Full fine-tuning: every backbone parameter trains, with AdamW or with SOAP (Vyas et al. 2024, arXiv 2409.11321).

SOAP preconditions each weight matrix with its own eigenbasis, so on a stacked (E, out, in) leaf
`pytorch_optimizer.SOAP` would mix the members; `qlbench.soap.StackedSoap` holds every member's Kronecker factors
and eigenbases as batched tensors and updates all members in one step (equal to pytorch_optimizer.SOAP run once per
member: tests/test_soap.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from qlbench.adapters.base import EPS, Method, check_positive_int
from qlbench.soap import StackedSoap


class FullFineTune(Method):
    summary = "full fine-tuning of every backbone parameter with AdamW"
    kind = "full"

    def __init__(self, name: str = "full-adamw"):
        self.name = name

    def build(self, backbone, config, generators, y_train):
        for p in backbone.parameters():
            p.requires_grad_(True)
        return backbone


@dataclass
class SoapConfig:
    """pytorch_optimizer.SOAP's defaults, as docs/methods.md states them."""

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


class FullSoap(FullFineTune):
    name = "full-soap"
    summary = "full fine-tuning with SOAP (batched over members; equals pytorch_optimizer.SOAP per member)"
    config_cls = SoapConfig

    def __init__(self):
        super().__init__(self.name)

    def optimizer(self, model, config: SoapConfig, lr, weight_decay, eps=EPS):
        params = [p for p in model.parameters() if p.requires_grad]
        return StackedSoap(
            params,
            lr=lr,
            weight_decay=weight_decay,
            eps=eps,
            betas=config.betas,
            precondition_frequency=config.precondition_frequency,
            capturable=bool(params) and all(p.device.type == "cuda" for p in params),  # as adamw's on CUDA
        )


FULL_ADAMW = FullFineTune()
FULL_SOAP = FullSoap()
