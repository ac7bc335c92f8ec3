"""VB-LoRA (Li et al. 2024, arXiv 2405.15179): every layer's LoRA factors are composed from one vector bank shared by
all adapted layers (sharing, no input-dependent routing), as peft 0.21's `vblora` tuner computes them.

The bank V (n_vectors, vector_length) is one parameter of the whole model. Each layer holds logits for its factors'
tiles: A (r, d_in) is cut into r x (d_in / vl) tiles of length vl, B (d_out, r) into (d_out / vl) x r tiles, and a
tile with logits z (n_vectors,) is the admixture of the bank's top-k vectors

    tile(z) = sum_{j in topk(z)} softmax(z_topk)_j V_j       (softmax over the k selected logits only)

    y = W0 x + b0 + B (A x)                                   (no alpha / r scaling, as in peft)

Tile layout (peft's): logits_A (r, d_in / vl, n_vectors) -> A[i, t vl:(t + 1) vl] = tile; logits_B
(d_out / vl, r, n_vectors) -> B[t vl:(t + 1) vl, j] = tile. Init (peft's defaults): V ~ U(-0.02, 0.02),
logits ~ N(0, 0.1^2), so the update is small but not zero at step 0 (unlike LoRA's B = 0). qlbench draws the bank
once per member, shared module first (peft draws it once per layer and keeps the last draw: the same distribution).
Gradients reach only the selected logits and bank rows (top-k is piecewise constant).

Trainable, L layers: n_vectors vl + L r n_vectors (d_in + d_out) / vl. The defaults (r 4, 16 vectors of length 8,
top-2) give 16,512 on the deep-narrow MLP (LoRA r = 8: 16,384) and 131,200 on the Transformer (131,072).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from qlbench.adapters.base import AdapterMethod, Site, check_positive, check_positive_int, check_targets
from qlbench.adapters.lora import lora_linear
from qlbench.stacked import ForwardContext, StackedLinear, normal_members, param, uniform_members

NAME = "vb-lora"
FAMILY = "vblora"  # parameter prefix and model.shared key (a method name with a hyphen is no attribute name)


@dataclass
class VbLoraConfig:
    r: int = 4  # rank
    n_vectors: int = 16  # rows of the shared bank
    vector_length: int = 8  # bank vector length: divides every adapted layer's d_in and d_out
    top_k: int = 2  # bank vectors mixed into each tile
    init_bank_bound: float = 0.02  # V ~ U(-bound, bound)
    init_logits_std: float = 0.1  # logits ~ N(0, std^2)
    targets: tuple[str, ...] | None = None  # backbone target roles; None = the backbone's default

    def __post_init__(self):
        check_positive_int(self, "r", "n_vectors", "vector_length", "top_k")
        check_positive(self, "init_bank_bound", "init_logits_std")
        check_targets(self)
        if self.top_k > self.n_vectors:
            raise ValueError(f"top_k must be <= n_vectors ({self.n_vectors}), got {self.top_k}")


def admix(logits: torch.Tensor, bank: torch.Tensor, k: int) -> torch.Tensor:
    """Tiles from logits (E, ..., n_vectors) and the bank (E, n_vectors, vl): each tile the softmax-weighted sum
    of the bank vectors of its top-k logits -> (E, ..., vl)."""
    E, nv, vl = bank.shape
    top, index = logits.topk(k, dim=-1)  # (E, ..., k)
    weights = torch.softmax(top, dim=-1)
    picked = torch.gather(bank, 1, index.reshape(E, -1, 1).expand(-1, -1, vl))  # (E, (...) k, vl)
    picked = picked.view(*index.shape, vl)  # (E, ..., k, vl)
    return (weights.unsqueeze(-1) * picked).sum(-2)  # (E, ..., vl)


def vblora_factors(
    logits_A: torch.Tensor, logits_B: torch.Tensor, bank: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A (E, r, d_in) from logits_A (E, r, d_in / vl, nv) and B (E, d_out, r) from logits_B (E, d_out / vl, r, nv)."""
    E, r = logits_A.shape[:2]
    A = admix(logits_A, bank, k).reshape(E, r, -1)  # (E, r, d_in / vl, vl) -> (E, r, d_in)
    B = admix(logits_B, bank, k).transpose(2, 3).reshape(E, -1, r)  # (E, d_out / vl, vl, r) -> (E, d_out, r)
    return A, B


class VectorBank(nn.Module):
    """The shared module: the bank V (E, n_vectors, vector_length)."""

    def __init__(
        self, model: nn.Module, sites: list[Site], config: VbLoraConfig, generators: list[torch.Generator], like
    ):
        super().__init__()
        vl = config.vector_length
        for site in sites:
            base = model.get_submodule(site.target.path)
            if base.d_in % vl or base.d_out % vl:
                raise ValueError(
                    f"vb-lora's vector_length={vl} must divide every adapted layer's d_in and d_out; "
                    f"{site.target.path} is {base.d_out} x {base.d_in}"
                )
        self.bank = param(uniform_members((config.n_vectors, vl), config.init_bank_bound, generators), like=like)


class VbLoraLinear(nn.Module):
    """A frozen StackedLinear plus B A x, with A and B composed from the shared bank by this layer's logits."""

    def __init__(self, base: StackedLinear, site: Site, config: VbLoraConfig, generators: list[torch.Generator]):
        super().__init__()
        c, vl = config, config.vector_length
        self.base, self.top_k = base, c.top_k
        shape_A, shape_B = (c.r, base.d_in // vl, c.n_vectors), (base.d_out // vl, c.r, c.n_vectors)
        self.vblora_logits_A = param(normal_members(shape_A, c.init_logits_std, generators), like=base.weight)
        self.vblora_logits_B = param(normal_members(shape_B, c.init_logits_std, generators), like=base.weight)

    def factors(self, shared: nn.ModuleDict) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's A (E, r, d_in) and B (E, d_out, r)."""
        return vblora_factors(self.vblora_logits_A, self.vblora_logits_B, shared[FAMILY].bank, self.top_k)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        A, B = self.factors(ctx.shared)
        return lora_linear(x, self.base, A, B, 1.0)  # (E, ..., d_out)


METHOD = AdapterMethod(
    NAME,
    "VB-LoRA: every layer's factors are top-k admixtures of one vector bank shared by all layers (no routing)",
    VbLoraConfig,
    VbLoraLinear,
    shared_cls=VectorBank,
    family=FAMILY,
)
