"""The adapted linear of the peft tuner: y = W0 x + b0 + s B (I_r + g S_b) A x, g = sigmoid(eta).

S_b comes from the tuner's router (`model.Routing.operator`): the layer hands it its rank state s = A x and its
block, and gets the block's routed operator, one per sequence (or per sample for inputs without a token axis), or
one per token with causal routing.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers.pytorch_utils import Conv1D


def features(base: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of an nn.Linear or a transformers Conv1D (weight (in, out))."""
    if isinstance(base, nn.Linear):
        return base.in_features, base.out_features
    if isinstance(base, Conv1D):
        return base.weight.shape[0], base.weight.shape[1]
    raise TypeError(f"queryable_lora adapts nn.Linear and transformers Conv1D layers, not {type(base).__name__}")


class QueryableLoraLayer(BaseTunerLayer):
    adapter_layer_names = ("queryable_A", "queryable_B", "queryable_eta")
    other_param_names = ("r", "scaling", "block", "queryable_dropout", "routing_key")

    def __init__(self, base_layer: nn.Module, **kwargs) -> None:
        self.base_layer = base_layer
        self.r: dict[str, int] = {}
        self.scaling: dict[str, float] = {}
        self.block: dict[str, int] = {}  # the adapter's block of this layer, set by the tuner after injection
        self.queryable_A = nn.ParameterDict({})  # (r, d_in)
        self.queryable_B = nn.ParameterDict({})  # (d_out, r)
        self.queryable_eta = nn.ParameterDict({})  # (1,): the gate g = sigmoid(eta)
        self.queryable_dropout = nn.ModuleDict({})  # on x before A (LoRA's lora_dropout)
        self.routing_key: dict[str, str] = {}  # the layer's name in the model: its route sums' key in a KV cache
        self.routing = None  # the tuner's Routing (a plain object: not a submodule, so saved once, by the tuner)
        self._disable_adapters = False
        self.merged_adapters = []
        self.kwargs = kwargs
        self.in_features, self.out_features = features(self.get_base_layer())

    def update_layer(self, adapter_name: str, config) -> None:
        """Add the adapter's A ~ U(+-1/sqrt(d_in)), B = 0, eta = 0 (qlbench's initialisation); with `init_weights`
        False, B ~ U(+-1/sqrt(r)) too (peft's convention: a random, non-identity start)."""
        r = config.r
        self.r[adapter_name], self.scaling[adapter_name] = r, config.scaling
        bound = 1.0 / math.sqrt(self.in_features)
        self.queryable_A[adapter_name] = nn.Parameter(torch.empty(r, self.in_features).uniform_(-bound, bound))
        B = torch.zeros(self.out_features, r)
        if not config.init_weights:
            B.uniform_(-1.0 / math.sqrt(r), 1.0 / math.sqrt(r))
        self.queryable_B[adapter_name] = nn.Parameter(B)
        p = config.lora_dropout
        self.queryable_dropout[adapter_name] = nn.Dropout(p) if p > 0 else nn.Identity()
        self.queryable_eta[adapter_name] = nn.Parameter(torch.zeros(1))
        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)


class Linear(nn.Module, QueryableLoraLayer):
    def __init__(self, base_layer: nn.Module, adapter_name: str, config, **kwargs) -> None:
        super().__init__()
        QueryableLoraLayer.__init__(self, base_layer, **kwargs)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise NotImplementedError("queryable_lora's update depends on the input (its routes): it cannot be merged")

    def unmerge(self) -> None:
        raise NotImplementedError("queryable_lora's update depends on the input (its routes): it cannot be merged")

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not self.disable_adapters and self.routing.call is None:  # called directly, not in a forward of the model
            with self.routing.alone():
                return self.forward(x, *args, **kwargs)
        result = self.base_layer(x, *args, **kwargs)  # (..., d_out)
        if self.disable_adapters:
            return result
        rows = self.routing.rows  # None, or a mixed batch's adapter per row (model._enable_peft_forward_hooks)
        for name in self.active_adapters if rows is None else sorted(set(rows) - {"__base__"}):
            if name not in self.queryable_A:
                continue
            A, B = self.queryable_A[name], self.queryable_B[name]
            s = self.queryable_dropout[name](x.to(A.dtype)) @ A.T  # (batch, [T,] r)
            S = self.routing.operator(name, self.block[name], s, self.routing_key[name]).to(s.dtype)  # (b, [T,] r, r)
            g = torch.sigmoid(self.queryable_eta[name])
            if S.dim() == s.dim() + 1:  # an operator per sample, or per token (causal): S s
                Ss = (S @ s.unsqueeze(-1)).squeeze(-1)
            else:  # one operator per sequence, applied to each of its tokens
                Ss = s @ S.transpose(-1, -2)
            t = s + g * Ss
            update = (self.scaling[name] * (t @ B.T)).to(result.dtype)  # (batch, [T,] d_out)
            if rows is not None:  # on its own rows only (the others' are computed and dropped)
                own = self.routing.rows_of(name, update.device)  # (batch,)
                update = torch.where(own.view(-1, *[1] * (update.dim() - 1)), update, 0)
            result = result + update
        return result

    def __repr__(self) -> str:
        return "queryable_lora." + super().__repr__()
