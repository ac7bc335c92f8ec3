"""HyRA (arXiv 2510.04295): a hypernetwork shared across layers generates every layer's LoRA factors, coupling
the heads of a projection through one generator.

qlbench interpretation (docs/methods.md; the public record is thin):

    H(e) = W_out gelu(W_in e),  e in R^{2 d_e}  (no biases; d_e = 32, hidden 128)
    y = W0 x + b0 + s B (A x)

- one hypernetwork per (role, shape) key, owning a learned embedding e_l per backbone layer and a learned
  embedding h_j per head; attention projections (q, k, v, o) have the backbone's heads, every other target (an
  MLP hidden layer, fc1, fc2) is treated as 4 heads of width d_out / 4;
- W_out = [W_out_A; W_out_B] emits the flattened factors. The output rows of the projection are split into H head
  blocks; block j's B rows (d_out / H, r) come from H([e_l; h_j]). A (r, d_in) is one matrix per layer, as in LoRA,
  and comes from the head-free input H([e_l; 0]) (qlbench's reading: only B is split over the heads);
- init: e_l, h_j ~ N(0, 1); W_in Kaiming-uniform (U(+-1/sqrt(2 d_e))); W_out_B = 0, so B = 0 and the model equals
  the frozen one at step 0; W_out_A ~ U(+-1/sqrt(d_in)) divided by the RMS over layers of ||gelu(W_in [e_l; 0])||,
  so the generated A's entries have LoRA's variance 1 / (3 d_in) (averaged over the key's layers, per member).

Every layer's factors of a key come from one evaluation of H over the key's L (1 + H) inputs per forward, on the
first layer's request, kept for the key's other layers, which only take their slice (generated.py).

Trainable, per (role, shape) key with L layers and H heads:
    L d_e + H d_e + hidden 2 d_e + hidden r d_in + hidden (d_out / H) r.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from qlbench.adapters.base import AdapterMethod, Site, check_positive_int
from qlbench.adapters.generated import GeneratedLoraLinear, role_shape_key
from qlbench.adapters.lora import LoraConfig
from qlbench.stacked import normal_members, param, uniform_members, zero_members

NAME = "hyra"

ATTENTION_ROLES = ("q", "k", "v", "o")
MLP_HEADS = 4  # heads an MLP layer is split into


@dataclass
class HyraConfig(LoraConfig):
    d_e: int = 32  # width of the layer and head embeddings
    hyper_hidden: int = 128  # hidden width of the hypernetwork

    def __post_init__(self):
        super().__post_init__()
        check_positive_int(self, "d_e", "hyper_hidden")


class HyperNetwork(nn.Module):
    """H for one (role, shape) key: layer embeddings, head embeddings, W_in and W_out = [W_out_A; W_out_B]."""

    layer_slots = ("layer_emb",)  # e_l is per layer: slot l of dim 1 is backbone layer l (gradients.py)

    def __init__(
        self,
        n_layers: int,
        heads: int,
        d_in: int,
        d_out: int,
        config: HyraConfig,
        generators: list[torch.Generator],
        like: torch.Tensor,
    ):
        super().__init__()
        c, E = config, len(generators)
        self.r, self.heads, self.d_in, self.d_out = c.r, heads, d_in, d_out
        layer_emb = normal_members((n_layers, c.d_e), 1.0, generators)  # e_l (E, L, d_e)
        head_emb = normal_members((heads, c.d_e), 1.0, generators)  # h_j (E, H, d_e)
        W_in = uniform_members((c.hyper_hidden, 2 * c.d_e), 1.0 / math.sqrt(2 * c.d_e), generators)
        W_out_A = uniform_members((c.r * d_in, c.hyper_hidden), 1.0 / math.sqrt(d_in), generators)
        # A_l = W_out_A z_l has entry variance Var(W_out_A) ||z_l||^2; dividing by the RMS of ||z_l|| over the
        # layers gives LoRA's 1 / (3 d_in) on average (member by member: no op mixes members).
        z = F.gelu(layer_emb @ W_in[:, :, : c.d_e].transpose(1, 2))  # gelu(W_in [e_l; 0]) (E, L, hidden)
        W_out_A = W_out_A / z.pow(2).sum(-1).mean(-1).sqrt().view(E, 1, 1)
        self.layer_emb, self.head_emb = param(layer_emb, like=like), param(head_emb, like=like)
        self.W_in, self.W_out_A = param(W_in, like=like), param(W_out_A, like=like)
        self.W_out_B = param(zero_members((d_out // heads * c.r, c.hyper_hidden), E), like=like)

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's A (E, L, r, d_in) from H([e_l; 0]) and B (E, L, d_out, r), block j from H([e_l; h_j]):
        H over the key's L (1 + H) inputs, the L [e_l; 0] then the L H [e_l; h_j], in one matmul per weight."""
        E, L, d_e = self.layer_emb.shape
        H = self.heads
        e = self.layer_emb.unsqueeze(2).expand(E, L, H, d_e)
        h = self.head_emb.unsqueeze(1).expand(E, L, H, d_e)
        x = torch.cat(
            [
                F.pad(self.layer_emb, (0, d_e)),  # [e_l; 0] (E, L, 2 d_e)
                torch.cat([e, h], dim=-1).view(E, L * H, 2 * d_e),
            ],
            dim=1,
        )  # then [e_l; h_j], layer-major
        z = F.gelu(x @ self.W_in.transpose(1, 2))  # H's hidden layer (E, L + L H, hidden)
        A = (z[:, :L] @ self.W_out_A.transpose(1, 2)).view(E, L, self.r, self.d_in)
        B = (z[:, L:] @ self.W_out_B.transpose(1, 2)).view(E, L, self.d_out, self.r)  # head blocks stacked row-wise
        return A, B

    def factors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s A (E, r, d_in) and B (E, d_out, r) (generated with all the key's layers)."""
        A, B = self()
        return A[:, layer], B[:, layer]


class HyraHyperNetworks(nn.ModuleDict):
    """The shared module: one HyperNetwork per (role, shape) key, built in forward order."""

    def __init__(
        self,
        model: nn.Module,
        sites: list[Site],
        config: HyraConfig,
        generators: list[torch.Generator],
        like: torch.Tensor,
    ):
        super().__init__()
        for site in sites:
            base = model.get_submodule(site.target.path)
            key = role_shape_key(site, base)
            if key in self:
                continue
            heads = model.config.n_heads if site.target.role in ATTENTION_ROLES else MLP_HEADS
            if base.d_out % heads:
                raise ValueError(
                    f"hyra splits {site.target.role}'s d_out={base.d_out} into {heads} heads: "
                    f"d_out must be divisible by {heads}"
                )
            self[key] = HyperNetwork(site.n_layers, heads, base.d_in, base.d_out, config, generators, like)


class HyraLinear(GeneratedLoraLinear):
    """A frozen StackedLinear plus s B A, with (A, B) generated from the layer's embedding by the shared H."""

    owner = NAME


METHOD = AdapterMethod(
    NAME,
    "HyRA: one hypernetwork per (role, shape) generates every layer's factors, B head by head",
    HyraConfig,
    HyraLinear,
    shared_cls=HyraHyperNetworks,
)
