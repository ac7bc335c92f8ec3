"""The paper's bounds on a peft-wrapped model: the tuner's live modules seen as a stack of one member, so that
qlbench.theory.checks (what `qlbench verify` reports) runs on them unchanged.

`trace(model, x, instruction, call)` runs one forward of the wrapped model and records what the checks read: every
block's Route, each adapted layer's input, rank state, routed operator and output, and the block states. The views
below give the tuner's memory and layers the stacked shapes (a leading member dimension of 1) of qlbench's own
QueryableMemory and QueryableLinear; nothing is recomputed from the formulas.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qlbench.adapters.queryable import QueryableConfig, RoutingState
from qlbench.hf.layer import Linear
from qlbench.hf.routing import MemoryView
from qlbench.theory.bounds import Bound
from qlbench.theory.checks import check_model
from qlbench.theory.tracing import LayerCall, Trace


def _config(c) -> QueryableConfig:
    """qlbench's QueryableConfig with the tuner's sizes and temperatures."""
    return QueryableConfig(
        r=c.r, alpha=c.lora_alpha, n_blocks=c.n_blocks, n_atoms=c.n_atoms, top_k=c.top_k, d_k=c.d_k, t_attn=c.t_attn,
        t_dep=c.t_dep, t_lang=c.t_lang, tau_lang=c.tau_lang, lambda_ctx=c.lambda_ctx,
        instruction_dim=c.instruction_dim, atom_std=c.atom_std, rms_eps=c.rms_eps,
    )  # fmt: skip


class BaseView:
    """The frozen linear of an adapted layer on stacked inputs (1, ..., d_in), with its weight (1, d_out, d_in) and
    bias (1, d_out) as a StackedLinear holds them (GPT-2's Conv1D stores its weight transposed)."""

    def __init__(self, base: torch.nn.Module, d_in: int):
        self.module, self.d_in = base, d_in
        w = base.weight if isinstance(base, torch.nn.Linear) else base.weight.T
        self.weight = w.unsqueeze(0)
        self.bias = (base.bias if base.bias is not None else torch.zeros_like(w[:, 0])).unsqueeze(0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x[0]).unsqueeze(0)


class LayerView:
    """An adapted peft layer as a one-member QueryableLinear: A (1, r, d_in), B (1, d_out, r), eta (1,), its block,
    its frozen base, and `routed_update` (what qlbench.theory.tracing reads Delta W off)."""

    def __init__(self, layer: Linear, adapter: str):
        self.queryable_A = layer.queryable_A[adapter].unsqueeze(0)
        self.queryable_B = layer.queryable_B[adapter].unsqueeze(0)
        self.queryable_eta = layer.queryable_eta[adapter]
        self.scale, self.block = layer.scaling[adapter], layer.block[adapter]
        self.base = BaseView(layer.get_base_layer(), layer.in_features)

    def routed_update(self, x: torch.Tensor, s: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
        """W0 x + b0 + scale B (s + g S s) for x (1, N, [T,] d_in), s = A x, S (1, N, r, r): the layer's formula
        (layer.Linear.forward) on stacked shapes."""
        g = torch.sigmoid(self.queryable_eta)
        Ss = s @ S.transpose(-1, -2) if s.dim() == 4 else (S @ s.unsqueeze(-1)).squeeze(-1)
        return self.base(x) + self.scale * ((s + g * Ss) @ self.queryable_B[0].T)


def trace(model, x: torch.Tensor, instruction: torch.Tensor | None = None, call: Callable | None = None) -> Trace:
    """One forward of a peft-wrapped model on x (1, N, ...), recorded for the checks. `call(model, x[0], e)` runs
    the model (default: model(x[0]) with `instruction=e[0]` when given); instruction (1, d_c)."""
    tuner = model.base_model
    adapter = model.active_adapter
    routing = tuner.routing
    calls: list[LayerCall] = []
    hooks = []
    for name, layer in model.named_modules():
        if isinstance(layer, Linear) and adapter in layer.queryable_A:
            view = LayerView(layer, adapter)

            def record(mod, inputs, out, name=name, view=view):
                x_in = inputs[0]
                s = x_in @ mod.queryable_A[adapter].T
                S = routing.state.operators[adapter][view.block]
                calls.append(LayerCall(name, view, x_in.unsqueeze(0), s.unsqueeze(0), S.unsqueeze(0), out.unsqueeze(0)))

            hooks.append(layer.register_forward_hook(record))
    e = None if instruction is None else instruction[0]
    try:
        if call is not None:
            out = call(model, x[0], e)
        else:
            out = model(x[0]) if e is None else model(x[0], instruction=e)
    finally:
        for h in hooks:
            h.remove()
    states = {b: [p.unsqueeze(0) for p in ps] for b, ps in routing.last_states[adapter].items()}
    state = RoutingState(states=states, routes=dict(sorted(routing.last[adapter].items())))
    memory = MemoryView(tuner.queryable_memory[adapter])
    memory.config = _config(memory.config)  # qlbench's QueryableConfig, as the checks read it
    return Trace(memory, memory.config, instruction, out, state, calls)


def check(
    model, x: torch.Tensor, instruction: torch.Tensor | None = None, *, call: Callable | None = None, chunk: int = 200
) -> list[Bound]:
    """Every norm and Lipschitz statement of the paper on a peft-wrapped Queryable LoRA model over the samples
    x (1, N, ...) (checks.check_model: float64, in place); instruction (1, d_c) for a model that routes on one."""
    return check_model(model, x, instruction, chunk=chunk, tracer=lambda m, xc, e: trace(m, xc, e, call))
