"""Per-layer adapter gradient norms and the gradient concentration index (the paper's figures "per-layer adapter
gradient norms" and "gradient concentration index across epochs").

The engine records them at the evaluation cadence, from the last training step of each evaluated epoch (after
backward, before the optimizer step; `engine.fit(..., diagnose=...)`), for every trained method.

qlbench interpretation of "per-layer adapter gradient norm" for member e and backbone layer l:

    ||g_{e,l}|| = sqrt( sum over the trainable parameters of layer l of the squared gradient entries, slice e )

- a parameter belongs to layer l when it lives in that layer's module (`hidden.<l>` in the deep-narrow MLP,
  `layers.<l>` in the Transformer: its q, k, v, o (and fc1, fc2) adapters together): LoRA's A and B, DoRA's m,
  Queryable LoRA's A, B and gate eta, DoRAN's m and rho; under full fine-tuning, the layer's own weights;
- a parameter of a shared module that holds one slot per layer (RepLoRA's and DoRAN's latent factors
  A~, B~ (E, L, ...), HyRA's layer embeddings e_l (E, L, d_e); their modules list them in `layer_slots`) contributes
  its slot l to layer l: those slots are per-layer parameters stored side by side, not shared ones;
- everything else is one separate "shared" entry, never folded into the layers: Queryable LoRA's atoms, keys,
  block prior and router matrices, RepLoRA/DoRAN's generator networks, HyRA's hypernetwork weights and head
  embeddings; under full fine-tuning, the input layer and head (parameters of no adapted layer). None when a
  method has no such parameter (LoRA, DoRA).

Gradient concentration index = max_l ||g_{e,l}|| / mean_l ||g_{e,l}|| over the layers only (the shared entry is not
a layer); 1 when every layer gets the same norm, L when one layer gets everything; lower is better (the paper).
It is computed from the records (`results.gradients_summary`), not here.
The gradient is of the member's own batch-mean loss (the stack minimises the sum of members' losses).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn


def layer_module(path: str, layer: int) -> str:
    """The backbone layer's module path of an adapter target: "hidden.3" -> "hidden.3", "layers.0.q" -> "layers.0"
    (the path up to the component that is the layer's index)."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part == str(layer):
            return ".".join(parts[: i + 1])
    raise ValueError(f"target path {path!r} has no component {layer} (its layer index)")


@dataclass
class ParamGroups:
    """Which trainable parameters make up each layer's gradient norm, and which are shared."""

    n_layers: int
    layers: list[tuple[int, nn.Parameter]] = field(default_factory=list)  # (layer, parameter of that layer)
    slotted: list[nn.Parameter] = field(default_factory=list)  # (E, L', ...): slot l of dim 1 is layer l
    shared: list[nn.Parameter] = field(default_factory=list)


def param_groups(model: nn.Module) -> ParamGroups:
    """Group a built model's trainable parameters by backbone layer (see the module docstring)."""
    prefixes = {layer_module(t.path, t.layer) + ".": t.layer for t in model.adapter_targets()}
    slotted = {id(getattr(module, name)) for module in model.modules() for name in getattr(module, "layer_slots", ())}
    groups = ParamGroups(model.n_layers)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        layer = next((lay for prefix, lay in prefixes.items() if name.startswith(prefix)), None)
        if layer is not None:
            groups.layers.append((layer, p))
        elif id(p) in slotted:
            groups.slotted.append(p)
        else:
            groups.shared.append(p)
    return groups


def _sq(p: nn.Parameter, dims_kept: int) -> torch.Tensor | None:
    """Sum of squared gradient entries over all but the first `dims_kept` dimensions (float64), or None (no grad)."""
    if p.grad is None:
        return None
    g = p.grad.detach().to(torch.float64)
    return g.reshape(*g.shape[:dims_kept], -1).pow(2).sum(-1)  # (E,) or (E, L')


@torch.no_grad()
def grad_norms(groups: ParamGroups) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-layer gradient norms (E, L) and the shared entry's (E,) (None without shared parameters), float64 on
    the CPU, from the parameters' current .grad (a parameter without one counts as zero)."""
    every = [p for _, p in groups.layers] + groups.slotted + groups.shared
    E = every[0].shape[0]
    sq = torch.zeros(E, groups.n_layers, dtype=torch.float64, device=every[0].device)  # (E, L)
    for layer, p in groups.layers:
        if (s := _sq(p, 1)) is not None:
            sq[:, layer] += s  # (E,)
    for p in groups.slotted:
        if (s := _sq(p, 2)) is not None:
            sq[:, : s.shape[1]] += s  # (E, L'): slot l is backbone layer l
    shared = None
    if groups.shared:
        shared = torch.zeros(E, dtype=torch.float64, device=sq.device)
        for p in groups.shared:
            if (s := _sq(p, 1)) is not None:
                shared += s
        shared = shared.sqrt().cpu()
    return sq.sqrt().cpu(), shared
