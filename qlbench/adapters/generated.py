"""Layers whose LoRA factors a shared network generates (RepLoRA, DoRAN, HyRA).

RepLoRA and HyRA apply the generated factors as LoRA does (`GeneratedLoraLinear`, one subclass per method naming
its shared module); DoRAN applies them as DoRA does (doran.py).

The method's shared module (`model.shared[<method name>]`) is a ModuleDict with one network per (role, shape) key;
a key's network returns the factors of all the key's layers at once, A (E, L, r, d_in) and B (E, L, d_out, r).
A forward generates them on the first layer's request and keeps them in ctx.scratch[<method name>] for the key's
other layers, which only take their slice (layer `site.target.layer` of the backbone is slot l of its key).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from qlbench.adapters.base import Site
from qlbench.adapters.lora import lora_linear
from qlbench.stacked import ForwardContext, StackedLinear


def role_shape_key(site: Site, base: StackedLinear) -> str:
    """The (role, shape) a shared network serves, e.g. "q_256x256" (d_out x d_in)."""
    return f"{site.target.role}_{base.d_out}x{base.d_in}"


def key_slots(model: nn.Module, sites: list[Site]) -> dict[str, list[Site]]:
    """The sites of every (role, shape) key, in forward order. Layer `site.target.layer` is its key's slot, so the
    key's sites must be backbone layers 0, 1, .. in order (true of both backbones: one linear per role and layer)."""
    out: dict[str, list[Site]] = {}
    for site in sites:
        out.setdefault(role_shape_key(site, model.get_submodule(site.target.path)), []).append(site)
    for key, group in out.items():
        if [s.target.layer for s in group] != list(range(len(group))):
            raise ValueError(
                f"the {key} sites must be backbone layers 0 .. L-1 in order, got {[s.target.layer for s in group]}"
            )
    return out


def cached(scratch: dict | None, key: str, compute) -> tuple[tuple[torch.Tensor, ...], ...]:
    """`compute()`'s stacked (E, L, ...) tensors unbound into per-layer views, once per forward per key.

    `scratch` is the method's dict in ctx.scratch (fresh every forward), or None to compute afresh (materialising
    factors outside a forward). unbind, not indexing: its backward is one stack over the layers' gradients, where
    L separate slices would each scatter into a zero tensor of the full size.
    """
    if scratch is None:
        return tuple(t.unbind(1) for t in compute())
    if key not in scratch:
        scratch[key] = tuple(t.unbind(1) for t in compute())
    return scratch[key]


class GeneratedFactors:
    """Mixin for an adapted layer whose (A, B) come from its method's shared network: sets `owner` (the method
    name), `key` and `layer` in `init_slot` and provides `factors`."""

    owner: str
    key: str
    layer: int

    def init_slot(self, owner: str, site: Site, base: StackedLinear) -> None:
        self.owner, self.key, self.layer = owner, role_shape_key(site, base), site.target.layer

    def factors(self, shared: nn.ModuleDict, scratch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's A (E, r, d_in) and B (E, d_out, r); `shared` is the model's `shared`, `scratch` the
        forward's ctx.scratch (None: generate afresh, e.g. to materialise a plain LoRA after training)."""
        cache = None if scratch is None else scratch.setdefault(self.owner, {})
        A, B = cached(cache, self.key, shared[self.owner][self.key])
        return A[self.layer], B[self.layer]


class GeneratedLoraLinear(GeneratedFactors, nn.Module):
    """A frozen StackedLinear plus s B A, with (A, B) this layer's slot of what the method's shared network
    generates; `factors` materialises them (after which inference is plain LoRA). A subclass sets `owner`, the
    method name its shared module is registered under (model.shared[owner])."""

    def __init__(self, base: StackedLinear, site: Site, config, generators: list[torch.Generator]):
        super().__init__()
        self.base, self.scale = base, config.scale
        self.init_slot(self.owner, site, base)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        A, B = self.factors(ctx.shared, ctx.scratch)
        return lora_linear(x, self.base, A, B, self.scale)  # (E, ..., d_out)
