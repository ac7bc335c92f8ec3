"""Reading the real model: one traced forward of a Queryable LoRA model.

`trace` runs the model's own forward and records the Route of every block (ctx.scratch["queryable"]) and every
QueryableLinear's input x, rank state s = A x, routed operator S_b and output. Delta W^l is read off the real
layer by feeding it basis vectors (`update_matrix`), never rebuilt from the formula.

Paper -> code indexing: the paper's block b = 1..B is the code's block index b - 1, so the number of completed blocks
(b - 1) is the code's block index.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from qlbench.adapters import queryable
from qlbench.adapters.queryable import QueryableConfig, QueryableLinear, QueryableMemory, RoutingState
from qlbench.adapters.routing import Route
from qlbench.stacked import ForwardContext, rank_project

# The QueryableLinear method that applies the routed update: (x, s = A x, S) -> W0 x + b0 + s B (s + g S s).
UPDATE_METHOD = "routed_update"


@dataclass
class LayerCall:
    """One QueryableLinear application in a traced forward (q, k and v of a block each get their own)."""

    name: str
    layer: QueryableLinear
    x: torch.Tensor  # (E, N, [T,] d_in) the layer's input
    s: torch.Tensor  # (E, N, [T,] r) its rank state A x, as the layer computed it
    S: torch.Tensor  # (E, N, r, r) the routed operator it used
    out: torch.Tensor  # (E, N, [T,] d_out) its output W0 x + b0 + Delta W x

    @property
    def role(self) -> str:
        """The projection of a Transformer layer (q, k, v, o, ... from layers.3.q), or hidden for an MLP layer."""
        last = self.name.rsplit(".", 1)[-1]
        return "hidden" if last.isdigit() else last


@dataclass
class Trace:
    """Everything one forward computed that the theory talks about."""

    memory: QueryableMemory
    config: QueryableConfig
    instruction: torch.Tensor | None  # (E, d_c)
    output: torch.Tensor
    state: RoutingState
    calls: list[LayerCall] = field(default_factory=list)

    @property
    def routes(self) -> dict[int, Route]:
        return self.state.routes

    def entry_state(self, block: int) -> torch.Tensor:
        """s_entry of a block (E, N, r): the first recorded rank state of the block (its entry layer)."""
        return self.state.states[block][0]

    def summaries(self, block: int) -> torch.Tensor | None:
        """(E, N, block, r) block means sbar_i of the completed blocks, as the router received them."""
        return self.state.summaries(block)


def queryable_layers(model: torch.nn.Module) -> list[tuple[str, QueryableLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QueryableLinear)]


def memory_of(model: torch.nn.Module) -> QueryableMemory:
    try:
        memory = model.shared[queryable.NAME]
    except (AttributeError, KeyError):
        raise ValueError(f"model has no queryable adapter (no shared[{queryable.NAME!r}] memory)") from None
    return memory


def _update_fn(layer: QueryableLinear):
    return getattr(type(layer), UPDATE_METHOD).__get__(layer)


@contextmanager
def _recording(model: torch.nn.Module, calls: list[LayerCall]):
    """Record every QueryableLinear update call (instance-level wrapper; removed on exit)."""
    layers = queryable_layers(model)
    for name, layer in layers:
        update = _update_fn(layer)

        def record(x, s, S, _name=name, _layer=layer, _fn=update):
            out = _fn(x, s, S)
            calls.append(LayerCall(_name, _layer, x, s, S, out))
            return out

        object.__setattr__(layer, UPDATE_METHOD, record)
    try:
        yield
    finally:
        for _, layer in layers:
            layer.__dict__.pop(UPDATE_METHOD, None)


def trace(model: torch.nn.Module, x: torch.Tensor, instruction: torch.Tensor | None = None) -> Trace:
    """Run model(x) once with a fresh ForwardContext and record routes, rank states and every adapted layer call.

    The forward is the model's own (autograd stays on, so tests can backpropagate through the recorded tensors)."""
    memory = memory_of(model)
    ctx = ForwardContext(model.shared, instruction)
    calls: list[LayerCall] = []
    with _recording(model, calls):
        out = model(x, instruction, ctx=ctx)
    return Trace(memory, memory.config, instruction, out, ctx.scratch[queryable.NAME], calls)


def update_apply(layer: QueryableLinear, x: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """Delta W x as the real layer computes it for input x (E, N, [T,] d_in) and routed operator S (E, N, r, r)."""
    return _update_fn(layer)(x, rank_project(x, layer.queryable_A), S) - layer.base(x)


def update_matrix(layer: QueryableLinear, S: torch.Tensor, basis: torch.Tensor | None = None) -> torch.Tensor:
    """Delta W (E, N, d_out, n) applied to the columns of `basis` (E, d_in, n), read off the real layer.

    basis None: the identity, i.e. the full matrix Delta W. `row_space_basis(layer)` gives Delta W's norm from only
    r columns: exact for any update that reads x through A x only (tests/properties check the two agree)."""
    E, N = S.shape[:2]
    d_in = layer.base.d_in
    if basis is None:
        basis = torch.eye(d_in, dtype=S.dtype, device=S.device).expand(E, d_in, d_in)
    x = basis.transpose(1, 2).unsqueeze(1).expand(E, N, basis.shape[2], d_in)  # (E, N, n, d_in): columns as tokens
    return update_apply(layer, x, S).transpose(-1, -2)


def row_space_basis(layer: QueryableLinear) -> torch.Tensor:
    """(E, d_in, r) orthonormal columns spanning the row space of A (Delta W = Delta W Q Q^T)."""
    return torch.linalg.qr(layer.queryable_A.detach().transpose(1, 2)).Q


def gate(layer: QueryableLinear) -> torch.Tensor:
    """g_l = sigmoid(eta_l) per member (E,)."""
    return torch.sigmoid(layer.queryable_eta.detach())
