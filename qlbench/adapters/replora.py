"""RepLoRA (Truong et al., ICML 2025, arXiv 2502.03044): LoRA factors produced by shared generator MLPs.

qlbench interpretation (docs/methods.md; the public record is thin):

    A = G_A(A~) row-wise,  B = G_B(B~) column-wise,  G(u) = u + W2 gelu(W1 u)  (no biases, hidden h = 64)
    y = W0 x + b0 + s B (A x)

- every adapted layer has latent factors A~ (r, d_in) and B~ (d_out, r), initialised as LoRA's A and B (so B~ = 0);
- one generator pair (G_A over d_in, G_B over d_out) per (role, shape) is shared by all layers of that key (the
  deep-narrow MLP has one pair; the Transformer one per projection q, k, v, o (fc1, fc2)), which couples the layers;
- W1 is Kaiming-uniform as PyTorch's default (a = sqrt(5): U(+-1/sqrt(d))), W2 ~ N(0, 0.02^2). G(0) = 0, so B = 0
  and the model equals the frozen one at step 0;
- `RepLoraLinear.factors` materialises (A, B), after which inference is plain LoRA.

Layout: the latents of all L layers of a key live next to the key's generator pair, stacked as A~ (E, L, r, d_in)
and B~ (E, L, d_out, r) (`shared.replora.<key>.latent_A` / `latent_B`; layer l of the key is slot l). A forward
generates every layer's factors of a key in one batched call of each generator, on the first layer's request, and
keeps them in ctx.scratch[<method name>] for the key's other layers, which only take their slice (generated.py).
Random draws, member by member from generators[e]: every key's G_A W1, G_A W2, G_B W1, G_B W2 in forward order of the
keys, then every layer's A~ in forward order (the draws, in the same order, of a layout where each layer holds its own
latents).

Trainable: L r (d_in + d_out) + sum over (role, shape) keys of 2 h (d_in + d_out).
DoRAN (doran.py) reuses `RepLoraGenerators` as its auxiliary networks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from qlbench.adapters.base import AdapterMethod, Site, check_positive_int
from qlbench.adapters.generated import GeneratedLoraLinear, key_slots, role_shape_key
from qlbench.adapters.lora import LoraConfig
from qlbench.stacked import normal_members, param, uniform_members, zero_members

NAME = "replora"

W2_STD = 0.02  # small, so the generators start close to the identity


@dataclass
class RepLoraConfig(LoraConfig):
    gen_hidden: int = 64  # hidden width h of the generator MLPs

    def __post_init__(self):
        super().__post_init__()
        check_positive_int(self, "gen_hidden")


class FactorGenerator(nn.Module):
    """G(u) = u + W2 gelu(W1 u) on the last dimension: u (E, n, d) -> (E, n, d); W1 (E, h, d), W2 (E, d, h)."""

    def __init__(self, d: int, hidden: int, generators: list[torch.Generator], like: torch.Tensor):
        super().__init__()
        self.W1 = param(uniform_members((hidden, d), 1.0 / math.sqrt(d), generators), like=like)
        self.W2 = param(normal_members((d, hidden), W2_STD, generators), like=like)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return u + F.gelu(u @ self.W1.transpose(1, 2)) @ self.W2.transpose(1, 2)  # (E, n, d)


class GeneratorPair(nn.Module):
    """One (role, shape) key: the generators A (G_A over d_in) and B (G_B over d_out), and the latents of the
    key's L layers, latent_A = A~ (E, L, r, d_in) and latent_B = B~ (E, L, d_out, r)."""

    layer_slots = ("latent_A", "latent_B")  # per-layer parameters: slot l of dim 1 is backbone layer l (gradients.py)

    def __init__(self, A: FactorGenerator, B: FactorGenerator, latent_A: nn.Parameter, latent_B: nn.Parameter):
        super().__init__()
        self.A, self.B = A, B
        self.latent_A, self.latent_B = latent_A, latent_B

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's A = G_A(A~) (E, L, r, d_in) and B = G_B(B~) (E, L, d_out, r), one call per generator."""
        E, L, r, d_in = self.latent_A.shape
        d_out = self.latent_B.shape[2]
        A = self.A(self.latent_A.reshape(E, L * r, d_in)).view(E, L, r, d_in)  # rows of every A~
        Bt = self.B(self.latent_B.transpose(2, 3).reshape(E, L * r, d_out))  # columns of every B~, (E, L r, d_out)
        return A, Bt.view(E, L, r, d_out).transpose(2, 3)


class RepLoraGenerators(nn.ModuleDict):
    """The shared module: one GeneratorPair (generators and the key's latents) per (role, shape) key, built in
    forward order; draws as the module docstring lists."""

    def __init__(
        self,
        model: nn.Module,
        sites: list[Site],
        config: RepLoraConfig,
        generators: list[torch.Generator],
        like: torch.Tensor,
    ):
        super().__init__()
        E, r, h = len(generators), config.r, config.gen_hidden
        groups = key_slots(model, sites)
        shapes = {key: model.get_submodule(group[0].target.path) for key, group in groups.items()}
        nets = {
            key: (FactorGenerator(b.d_in, h, generators, like), FactorGenerator(b.d_out, h, generators, like))
            for key, b in shapes.items()
        }
        latents = {key: [] for key in groups}
        for site in sites:  # LoRA's A init per layer (U(+-1/sqrt(d_in))), in forward order
            b = model.get_submodule(site.target.path)
            latents[role_shape_key(site, b)].append(uniform_members((r, b.d_in), 1.0 / math.sqrt(b.d_in), generators))
        for key, b in shapes.items():
            latent_A = param(torch.stack(latents[key], dim=1), like=like)  # A~ (E, L, r, d_in)
            latent_B = param(zero_members((len(groups[key]), b.d_out, r), E), like=like)  # B~ = 0
            self[key] = GeneratorPair(*nets[key], latent_A, latent_B)


class RepLoraLinear(GeneratedLoraLinear):
    """A frozen StackedLinear plus s B A, with (A, B) generated from this layer's latents (slot `layer` of its key's
    stacked latents) by the shared pair; `factors` materialises them."""

    owner = NAME


METHOD = AdapterMethod(
    NAME,
    "RepLoRA: LoRA factors generated by MLPs shared across layers of a (role, shape)",
    RepLoraConfig,
    RepLoraLinear,
    shared_cls=RepLoraGenerators,
)
