"""Queryable LoRA (the paper's method; Section 3, Algorithms 1-2, appendix A for attention).

Per adapted layer l in block b:  y = W0 x + b0 + s B (I_r + g_l S_b(c)) A x,  g_l = sigmoid(eta_l), where the
routed operator S_b = sum_m alpha_m C_m mixes M shared r x r atoms with a top-k softmax. S_b is routed once per
block per sample (per sequence in the Transformer) from:
  - the block-entry rank state s_entry = A_{l_b} x_{l_b} (attention: the token-averaged Q, K, V rank states of the
    block's first layer, averaged over the three projections),
  - the pre-query q0 = w_b + Q_cur s_entry + lambda_ctx Q_ctx e(c),
  - an attention-style depth summary u over the means sbar_i of the completed blocks' rank states,
  - state logits zeta_m = <RMSNorm(q0 + Q_dep u), RMSNorm(k_m)> / (sqrt(d_k) T_attn),
  - and a language prior p = softmax(rho) fused as zeta + tau_lang log p.
The router itself is in routing.py (pure functions shared with the theorem checks).

qlbench choices where the paper leaves room (documented in docs/methods.md):
  - the layer prior w is kept per block (only the block-entry layer's w_l is ever used);
  - in the Transformer a layer's rank state (for block summaries) is its token-averaged Q/K/V state; O and FFN
    projections use S_b but do not feed the summaries (no circular dependence, as the paper's appendix A);
  - router matrices start N(0, 1/fan_in), the block prior N(0, 1); atoms N(0, 0.02^2), keys N(0, 1), eta = 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from qlbench.adapters.base import AdapterMethod, Site, check_nonnegative, check_positive, check_positive_int
from qlbench.adapters.lora import LoraConfig, lora_factors, low_rank_update
from qlbench.adapters.routing import Route, Router, Temperatures, route, samples_last
from qlbench.stacked import (
    ForwardContext,
    StackedLinear,
    memberwise,
    normal_members,
    param,
    rank_project,
    scaled_bmm,
)

NAME = "queryable"  # the method's name: its parameter prefix and its key in model.shared and ctx.scratch
# Eager deep-narrow layers run as one RoutedLinear autograd node. The gradient-identity tests switch it off to read
# each layer's rank-space vector t_l and dL/dt_l from autograd through the plain ops (those torch.compile runs);
# tests/test_queryable.py checks that both give the same values and gradients.
ROUTED_NODE = True
ENTRY_ROLES = ("hidden", "q", "k", "v")  # projections whose rank states feed the router


@dataclass
class QueryableConfig(LoraConfig):
    n_blocks: int = 4  # B contiguous blocks of backbone layers
    n_atoms: int = 8  # M shared r x r atoms
    top_k: int = 2  # atoms mixed per block and sample
    d_k: int = 16  # key / query dimension
    t_attn: float = 1.0  # temperature of the state logits
    t_dep: float = 1.0  # temperature of the depth-summary attention
    t_lang: float = 1.0  # temperature of the language-prior logits
    tau_lang: float = 0.0  # strength of the language prior (0: state-only routing)
    lambda_ctx: float = 0.0  # weight of the instruction in the pre-query
    instruction_dim: int | None = None  # d_c of e(c); None: no instruction channels (no Q_ctx, R_ctx)
    atom_std: float = 0.02
    rms_eps: float = 1e-6

    def __post_init__(self):
        super().__post_init__()
        check_positive_int(self, "n_blocks", "n_atoms", "d_k")
        if isinstance(self.top_k, bool) or not (isinstance(self.top_k, int) and 1 <= self.top_k <= self.n_atoms):
            raise ValueError(f"top_k must be an integer in [1, n_atoms={self.n_atoms}], got {self.top_k!r}")
        check_positive(self, "t_attn", "t_dep", "t_lang", "rms_eps")
        check_nonnegative(self, "tau_lang", "lambda_ctx", "atom_std")
        if self.instruction_dim is not None:
            check_positive_int(self, "instruction_dim")
        if self.targets is not None and not set(self.targets) & set(ENTRY_ROLES):
            raise ValueError(
                f"queryable routes from the rank states of {'/'.join(ENTRY_ROLES[1:])} (transformer) or "
                f"hidden (deep-narrow) layers: targets {self.targets} has none of them"
            )
        if (self.tau_lang or self.lambda_ctx) and self.instruction_dim is None:
            raise ValueError("tau_lang or lambda_ctx > 0 needs an instruction embedding: set instruction_dim")


def block_of(layer: int, n_layers: int, n_blocks: int) -> int:
    """Contiguous blocks: layer (0-based) of n_layers -> block in [0, n_blocks) (sizes differ by at most 1)."""
    return layer * n_blocks // n_layers


@dataclass
class RoutingState:
    """Per-forward scratch (in ctx.scratch[NAME]): rank states recorded per block, and each block's Route."""

    states: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # block -> [(E, N, r)] per layer
    routes: dict[int, Route] = field(default_factory=dict)
    means: dict[int, torch.Tensor] = field(default_factory=dict)  # completed block -> sbar (E, N, r), once each

    def summaries(self, block: int) -> torch.Tensor | None:
        """(E, N, block, r): the mean rank state sbar_i of each completed block i < block, or None.

        Each block's mean is taken once per forward and reused by every later block's summaries (a deep-narrow
        Queryable LoRA step then dispatches 30 fewer kernels, counted by `qlbench bench --only dispatch`). Its gradient
        is the later blocks' sum divided once by the block's size: at the default sizes (8 layers a block on
        deep-narrow, 2 on the Transformer) a power of two, so the bits are those of dividing each term, in the same
        order; tests/test_queryable.py checks a step's gradients against the per-block recomputation."""
        if block == 0:
            return None
        for i in range(block):
            if i not in self.means:
                self.means[i] = torch.stack(self.states[i]).mean(0)
        return torch.stack([self.means[i] for i in range(block)], dim=2)


def memory_shapes(c) -> dict[str, tuple[tuple[int, ...], float]]:
    """The shared memory's parameters, name -> (shape of one member's, std of its N(0, std^2) initialisation), in
    the order they are drawn; also the peft tuner's (qlbench.hf), which reads the same fields of its config."""
    r, d_k = c.r, c.d_k
    shapes = {
        "atoms": ((c.n_atoms, r, r), c.atom_std),  # C_m (M, r, r)
        "keys": ((c.n_atoms, d_k), 1.0),  # k_m (M, d_k)
        "block_prior": ((c.n_blocks, d_k), 1.0),  # w_b (B, d_k)
        "Q_cur": ((d_k, r), 1 / math.sqrt(r)),
        "Q_dep": ((d_k, r), 1 / math.sqrt(r)),
        "Q_dep_q": ((d_k, d_k), 1 / math.sqrt(d_k)),
        "Q_dep_k": ((d_k, r), 1 / math.sqrt(r)),
    }
    if c.instruction_dim is not None:
        shapes["Q_ctx"] = ((d_k, c.instruction_dim), 1 / math.sqrt(c.instruction_dim))
        shapes["R_ctx"] = ((d_k, c.instruction_dim), 1 / math.sqrt(c.instruction_dim))
    return shapes


class QueryableMemory(nn.Module):
    """The shared memory (atoms C_m and keys k_m) and the router's parameters, one set per member."""

    def __init__(
        self,
        model: nn.Module,
        sites: list[Site],
        config: QueryableConfig,
        generators: list[torch.Generator],
        like: torch.Tensor,
    ):
        super().__init__()
        c = config
        if c.n_blocks > model.n_layers:
            raise ValueError(f"n_blocks={c.n_blocks} exceeds the backbone's {model.n_layers} layers")
        entry_blocks = {block_of(s.target.layer, s.n_layers, c.n_blocks) for s in sites if s.target.role in ENTRY_ROLES}
        if len(entry_blocks) != c.n_blocks:
            raise ValueError(
                f"queryable routes each block from its {'/'.join(ENTRY_ROLES)} targets; blocks "
                f"{sorted(set(range(c.n_blocks)) - entry_blocks)} of {c.n_blocks} have none"
            )
        self.config = c
        self.member_top_k: tuple[int, ...] | None = None  # k per member (a stacked Pareto grid; None: config's)
        self.Q_ctx = self.R_ctx = None  # without instruction channels
        for name, (shape, std) in memory_shapes(c).items():  # each (E, *shape), drawn in this order
            setattr(self, name, param(normal_members(shape, std, generators), like=like))
        # frozen e(c) bound to the members: (E, d_c) one per member, or (E, T, d_c) one per task of a suite
        self.register_buffer("instruction", None)

    def bind_instruction(self, e: torch.Tensor) -> None:
        """Keep the members' frozen instruction embeddings, used when a forward is given none: e (E, d_c), one per
        member, or (E, T, d_c), one per task of a suite (each sample then routes with its own task's, by the
        forward's task indices)."""
        self.instruction = e.to(self.keys)

    def route(
        self,
        block: int,
        s_entry: torch.Tensor,
        summaries: torch.Tensor | None,
        instruction: torch.Tensor | None,
        task: torch.Tensor | None = None,
    ) -> Route:
        """One block's route; `instruction` (E, d_c) or (E, N, d_c) overrides the bound one; `task` (E, N) long
        picks each sample's row of a bound (E, T, d_c) table (None: task 0)."""
        c = self.config
        if instruction is None and self.instruction is not None:
            instruction = self.instruction
            if instruction.dim() == 3:  # (E, T, d_c) -> each sample its task's (E, N, d_c)
                E, N = s_entry.shape[:2]
                idx = torch.zeros(E, N, dtype=torch.long, device=s_entry.device) if task is None else task
                instruction = torch.gather(instruction, 1, idx.unsqueeze(-1).expand(E, N, instruction.shape[-1]))
        if (c.tau_lang or c.lambda_ctx) and instruction is None:
            raise ValueError("this queryable adapter uses the instruction channels: pass an instruction embedding")
        return route_with(self, block, s_entry, summaries, instruction)


def route_with(memory, block: int, s_entry, summaries, instruction) -> Route:
    """Algorithm 2 for one block from `memory`'s parameters (each (E, ...)) and its config's sizes and temperatures:
    qlbench's QueryableMemory, or the peft tuner's memory seen as a stack of one (qlbench.hf.routing.MemoryView)."""
    c = memory.config
    router = Router(
        w=memory.block_prior[:, block],
        Q_cur=memory.Q_cur,
        Q_dep=memory.Q_dep,
        Q_dep_q=memory.Q_dep_q,
        Q_dep_k=memory.Q_dep_k,
        keys=memory.keys,
        atoms=memory.atoms,
        Q_ctx=memory.Q_ctx,
        R_ctx=memory.R_ctx,
    )
    temperatures = Temperatures(
        top_k=getattr(memory, "member_top_k", None) or c.top_k,
        t_attn=c.t_attn,
        t_dep=c.t_dep,
        t_lang=c.t_lang,
        tau_lang=c.tau_lang,
        lambda_ctx=c.lambda_ctx,
        eps=c.rms_eps,
    )
    return route(s_entry, summaries, router, temperatures, instruction)


class QueryableLinear(nn.Module):
    """A frozen StackedLinear plus s B (I + g S_b) A, with S_b from the shared memory's router."""

    def __init__(self, base: StackedLinear, site: Site, config: QueryableConfig, generators: list[torch.Generator]):
        super().__init__()
        self.base, self.scale = base, config.scale
        self.queryable_A, self.queryable_B = lora_factors(base, config.r, generators)
        self.queryable_eta = nn.Parameter(torch.zeros(base.members, device=base.weight.device, dtype=base.weight.dtype))
        self.block = block_of(site.target.layer, site.n_layers, config.n_blocks)
        self.records = site.target.role in ENTRY_ROLES  # its rank state feeds routing and block summaries
        first_layer_of_block = min(
            i for i in range(site.n_layers) if block_of(i, site.n_layers, config.n_blocks) == self.block
        )
        self.entry = self.records and site.target.layer == first_layer_of_block

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.group_forward([self], x, ctx)[0]

    @staticmethod
    def group_forward(layers: list[nn.Module], x: torch.Tensor, ctx: ForwardContext) -> list[torch.Tensor]:
        """Apply layers that share the input x (E, N, [T,] d_in): one layer in the MLP; q, k, v in attention, of
        which any non-empty subset is adapted (the others are plain StackedLinears, applied as they are).

        The block state is the adapted layers' rank states, token-averaged in attention, averaged over the
        projections (a single adapted projection gives its own token-averaged state)."""
        adapted = [layer for layer in layers if isinstance(layer, QueryableLinear)]
        first = adapted[0]
        state = ctx.scratch.setdefault(NAME, RoutingState())
        s = [rank_project(x, layer.queryable_A) for layer in adapted]  # each (E, N, [T,] r)
        if first.records:
            per_sample = [si.mean(2) if x.dim() == 4 else si for si in s]  # each (E, N, r)
            joint = per_sample[0] if len(s) == 1 else torch.stack(per_sample).mean(0)  # (E, N, r)
            if first.entry:
                summaries = state.summaries(first.block)
                memory = ctx.shared[NAME]
                state.routes[first.block] = memory.route(first.block, joint, summaries, ctx.instruction, ctx.task)
            state.states.setdefault(first.block, []).append(joint)
        S = state.routes[first.block].S  # (E, N, r, r)
        updates = {id(layer): layer.routed_update(x, si, S) for layer, si in zip(adapted, s)}
        return [updates[id(layer)] if id(layer) in updates else layer(x, ctx) for layer in layers]

    def routed_update(self, x: torch.Tensor, s: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
        """W0 x + b0 + scale B t with t = s + g S s, for s = A x and the block's S (E, N, r, r)."""
        g = memberwise(torch.sigmoid, self.queryable_eta)  # (E,)
        if ROUTED_NODE and s.dim() == 3 and not torch.compiler.is_compiling():  # eager, one rank state per sample
            W0, b0 = self.base.weight, self.base.bias
            if samples_last(x):
                return RoutedLinear.apply(x, s, S.permute(0, 2, 3, 1), g, W0, b0, self.queryable_B, self.scale)
            return RoutedLinearDense.apply(x, s, S, g, W0, b0, self.queryable_B, self.scale)
        g = g.view(-1, *([1] * (s.dim() - 1)))  # (E, 1, ...)
        if s.dim() == 3:  # (E, N, r): one rank state per sample (compiled: Inductor fuses these into few kernels)
            # element-wise in a samples-last layout: on the CPU route() stores S as (E, r, r, N) in memory, so the
            # product and its gradients run over N-long contiguous rows (about 5x faster on CPU than r-long rows,
            # and faster than a batched matmul of N r x r by r x 1 blocks); elsewhere S is (E, N, r, r), which
            # Inductor reads through the same view
            s_t = s.transpose(1, 2).contiguous()  # (E, r, N)
            t = s_t + g * (S.permute(0, 2, 3, 1) * s_t.unsqueeze(1)).sum(2)  # (E, r, N): s + g S s
            t = t.transpose(1, 2)  # (E, N, r) view
        else:  # (E, N, T, r): every token of a sequence uses the sequence's S_b
            t = s + g * (s @ S.transpose(-1, -2))  # (E, N, T, r)
        return low_rank_update(self.base(x), t, self.queryable_B, self.scale)


class RoutedLinear(torch.autograd.Function):
    """y = W0 x + b0 + scale B t, t = s + g S s, with one rank state s per sample, and its gradient written out.

    x (E, N, d_in); s = A x (E, N, r); S_t (E, r, r, N), the block's S in route()'s samples-last storage; g (E,)
    the gate; W0 (E, d_out, d_in), b0 (E, d_out), B (E, d_out, r) -> y (E, N, d_out). The eager path: one node
    instead of autograd's chain of views, broadcasts and sum-reductions (faster eager, measured in docs/speed.md);
    under torch.compile the plain ops are used, which Inductor fuses better. The backward is checked against finite
    differences and the plain formula (tests/test_queryable.py).
    """

    @staticmethod
    def forward(ctx, x, s, S_t, g, W0, b0, B, scale: float):
        s_t = s.transpose(1, 2).contiguous()  # (E, r, N)
        u_t = (S_t * s_t.unsqueeze(1)).sum(2)  # (E, r, N): S s per sample, over N-long rows
        t = torch.addcmul(s_t, g.view(-1, 1, 1), u_t).transpose(1, 2)  # (E, N, r) view
        y = torch.baddbmm(b0.unsqueeze(1), x, W0.transpose(1, 2)).baddbmm_(t, B.transpose(1, 2), alpha=scale)
        ctx.save_for_backward(x, s_t, u_t, t, S_t, g, W0, B)
        ctx.scale = scale
        return y  # (E, N, d_out)

    @staticmethod
    def backward(ctx, grad_y):  # grad_y (E, N, d_out)
        x, s_t, u_t, t, S_t, g, W0, B = ctx.saved_tensors
        need = ctx.needs_input_grad
        grad_yT = grad_y.transpose(1, 2)  # (E, d_out, N)
        grad_t = torch.bmm(B.transpose(1, 2), grad_yT).mul_(ctx.scale)  # (E, r, N)
        grad_gt = grad_t * g.view(-1, 1, 1)  # g dL/dt
        grad_x = torch.bmm(grad_y, W0) if need[0] else None  # the W0 path; the A path is autograd's (s = A x)
        grad_s = (grad_t + (S_t * grad_gt.unsqueeze(2)).sum(1)).transpose(1, 2) if need[1] else None  # (1 + g S^T)
        grad_S = grad_gt.unsqueeze(2) * s_t.unsqueeze(1) if need[2] else None  # (E, r, r, N): g dL/dt s^T
        grad_g = (grad_t * u_t).sum((1, 2)) if need[3] else None  # (E,)
        grad_W0 = torch.bmm(grad_yT, x) if need[4] else None
        grad_b0 = grad_y.sum(1) if need[5] else None
        grad_B = torch.bmm(grad_yT, t).mul_(ctx.scale) if need[6] else None  # (E, d_out, r)
        return grad_x, grad_s, grad_S, grad_g, grad_W0, grad_b0, grad_B, None


class RoutedLinearDense(torch.autograd.Function):
    """RoutedLinear for S stored (E, N, r, r), route()'s layout off the CPU (routing.SAMPLES_LAST): the per-sample
    products are batched matmuls over the E N samples, and the scale rides in the matmuls (alpha), so a layer's
    forward and backward launch 11 kernels where RoutedLinear launches 18.

    x (E, N, d_in); s = A x (E, N, r); S (E, N, r, r) contiguous; g (E,); W0 (E, d_out, d_in), b0 (E, d_out),
    B (E, d_out, r) -> y (E, N, d_out). The backward is checked against finite differences and the plain formula
    (tests/test_queryable.py), and a whole model with this layout against the CPU's (tests/test_queryable.py).
    """

    @staticmethod
    def forward(ctx, x, s, S, g, W0, b0, B, scale: float):
        E, N, r = s.shape
        u = torch.bmm(S.view(E * N, r, r), s.reshape(E * N, r, 1)).view(E, N, r)  # S s per sample
        t = torch.addcmul(s, g.view(-1, 1, 1), u)  # (E, N, r): s + g S s
        y = torch.baddbmm(b0.unsqueeze(1), x, W0.transpose(1, 2)).baddbmm_(t, B.transpose(1, 2), alpha=scale)
        ctx.save_for_backward(x, s, u, t, S, g, W0, B)
        ctx.scale = scale
        return y  # (E, N, d_out)

    @staticmethod
    def backward(ctx, grad_y):  # grad_y (E, N, d_out)
        x, s, u, t, S, g, W0, B = ctx.saved_tensors
        need = ctx.needs_input_grad
        E, N, r = s.shape
        grad_t = scaled_bmm(grad_y, B, ctx.scale)  # (E, N, r)
        grad_gt = grad_t * g.view(-1, 1, 1)  # g dL/dt
        grad_x = torch.bmm(grad_y, W0) if need[0] else None  # the W0 path; the A path is autograd's (s = A x)
        grad_s = None
        if need[1]:  # (1 + g S^T) dL/dt per sample
            St = S.view(E * N, r, r).transpose(1, 2)
            grad_s = torch.baddbmm(grad_t.view(E * N, r, 1), St, grad_gt.view(E * N, r, 1)).view(E, N, r)
        grad_S = grad_gt.unsqueeze(3) * s.unsqueeze(2) if need[2] else None  # (E, N, r, r): g dL/dt s^T
        grad_g = torch.bmm(grad_t.view(E, 1, N * r), u.view(E, N * r, 1)).view(E) if need[3] else None
        grad_W0 = torch.bmm(grad_y.transpose(1, 2), x) if need[4] else None
        grad_b0 = grad_y.sum(1) if need[5] else None
        grad_B = scaled_bmm(grad_y.transpose(1, 2), t, ctx.scale) if need[6] else None  # (E, d_out, r)
        return grad_x, grad_s, grad_S, grad_g, grad_W0, grad_b0, grad_B, None


METHOD = AdapterMethod(
    NAME,
    "Queryable LoRA: s B (I + g S_b) A with S_b routed top-k over shared atoms",
    QueryableConfig,
    QueryableLinear,
    shared_cls=QueryableMemory,
    kind="routed",
)
