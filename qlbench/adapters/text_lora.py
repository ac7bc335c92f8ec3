"""Text-to-LoRA (Charakorn et al. 2025, arXiv 2506.06105, "Text-to-LoRA: Instant Transformer Adaption"): one
hypernetwork, shared by every adapted layer, generates each layer's LoRA factors from the task's instruction
embedding e(c) (T2L's "L" variant: one head gives A and B at once).

    z_l = [LN(P e + p) ; LN(E_layer[l]) ; LN(E_role[role])]      (LN: layer norm without affine parameters)
    h_l = silu(W1 z_l + b1)                                       (d_h = `hidden`)
    A_l = (W_A h_l + b_A).view(r, d_in),  B_l = (W_B h_l + b_B).view(d_out, r)
    y = W0 x + b0 + s B_l A_l x,   s = alpha / r                  (as LoRA)

Kept from T2L: the frozen sentence encoder's e(c) through a learned task encoder (linear, then layer norm), learned
layer-depth and module-type embeddings (each layer-normed) concatenated with it, an MLP with SiLU, heads that emit
A and B flattened, and T2L's LoRA-matching initialisation (bias-HyperInit: head weights zero, the A head's bias
LoRA's initial A, the B head's bias zero), so the adapted model starts as the frozen one and every layer of a shape
starts with the same LoRA A. The task code is twice as wide as each embedding, as in T2L (latent 128: 64, 32, 32);
here at half its latent size (32, 16, 16).

qlbench interpretation (docs/methods.md):
- the trunk is one hidden layer of width d_h = 32 (T2L: a mixer and residual MLP blocks into a 512-wide head
  input), with no dropout, and the layer norms have no affine parameters;
- one head pair (W_A, b_A, W_B, b_B) per layer shape (d_out x d_in), shared by the roles of that shape, which the
  role embedding tells apart (T2L: one head per module type). The Transformer's q, k, v and o (256 x 256) share one
  head; fc1 and fc2 (with `targets` naming them) each have their own. With one head per role the heads alone would
  be 4 x 33 x 4,096 = 540,672 parameters on the Transformer, 18 times LoRA's; sharing keeps the method within 10%
  of instruct-queryable's count on both backbones (1.059 and 1.035);
- it trains end to end on the suite's (or the single task's) regression loss, not by reconstructing trained LoRAs
  nor by SFT over hundreds of tasks; so it is a task-conditioned adapter of the suite's tasks, and its zero-shot
  reading (a new sentence, a new task) is what the suite's held-out schedule measures;
- e(c) is all-MiniLM-L6-v2's 384-d unit vector (T2L: gte-large-en-v1.5), optionally through instruct's frozen
  compressed projection (`instruction_dim` below 384, `instruct.router_input`).

Instructions (the contract `qlbench suite` and `qlbench bench` rely on): the shared module keeps a bound table,
`bind_instruction(e)` with e (E, d_c), one per member, or (E, T, d_c), one per task of a suite; a forward's
ctx.instruction ((E, d_c) or (E, T, d_c)) overrides it; with T rows each sample uses its task's (ctx.task; task 0
when None), a one-row table serves every sample. The factors of all (member, task) pairs are generated once per
forward per (role, shape) key, (E, L, T r, d_in) and (E, L, d_out, T r), and kept in ctx.scratch for the key's other
layers (generated.py's pattern). `TextLora.bind` gives each member its function card's e(c) (instruct's rule, the
"random" source included), so a single-task `qlbench run --methods text-lora` works.

Suite rows (multitask.VARIANTS): `text-lora-code` reads a seeded random vector per task instead of e(c) (identity
without language; a held-out task's code was never trained, so it cannot transfer by construction), and
`text-lora-params` reads each task's parameter code (parametric.codes: a fixed linear projection of the task's true
parameters, parametric suites only), the oracle descriptor: an upper bound on what a sentence that states those
parameters could give the hypernetwork.

Trainable, with R roles, S shapes, n backbone layers, d_t = task_dim, d_e = embed_dim:
    d_t (d_c + 1) + (n + R) d_e + d_h (d_t + 2 d_e + 1) + sum over shapes (d_h + 1) r (d_in + d_out)
(31,824 on the deep-narrow MLP and 149,760 on the Transformer's q, k, v, o at the defaults.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from qlbench import instructions
from qlbench.adapters import instruct
from qlbench.adapters.base import AdapterMethod, Site, check_positive_int
from qlbench.adapters.generated import cached, key_slots, role_shape_key
from qlbench.adapters.lora import lora_linear, low_rank_update
from qlbench.adapters.lora_per_task import TaskConfig, task_index, task_mask
from qlbench.stacked import (
    ForwardContext,
    StackedLinear,
    bmm_add,
    memberwise,
    normal_members,
    param,
    stacked_linear,
    uniform_members,
    zero_members,
)

NAME = "text-lora"
FAMILY = "text_lora"  # parameter prefix and model.shared key (a method name with a hyphen is no attribute name)
# the instruction sources that need nothing but a function card (instruct.SOURCES less "text"); a suite row takes
# "card", "random" or the suite's own "params" (multitask.SUITE_SOURCES: set by multitask past these checks)
SOURCES = ("card", "generic", "shuffled", "adversarial", "random")
# up to this many tasks in a forward's table, a layer generates every task's factors and masks a rank-T r product
# (cheaper for a suite's few tasks); above it, it works from the trunk's output and never forms a factor
# (`through_hidden`: its cost does not grow with T). Deep-narrow training steps, 5 members, one thread, masked vs
# through-hidden: 34 vs 45 ms with 20 tasks bound, 66 vs 51 ms with 32, 159 vs 53 ms with 80 (docs/speed.md)
MASKED_TASKS = 24


@dataclass
class TextLoraConfig(TaskConfig):
    hidden: int = 32  # d_h, the hypernetwork's hidden width
    task_dim: int = 32  # d_t, the task code P e's width
    embed_dim: int = 16  # d_e, the layer and role embeddings' width
    instruction_dim: int = instructions.DIM  # d_c of e(c); below 384 a frozen projection compresses it
    instruction_source: str = "card"  # see SOURCES

    def __post_init__(self):
        super().__post_init__()  # r, alpha, targets, tasks (T does not change any shape)
        check_positive_int(self, "hidden", "task_dim", "embed_dim")
        dim = self.instruction_dim
        if isinstance(dim, bool) or not (isinstance(dim, int) and 1 <= dim <= instructions.DIM):
            raise ValueError(
                f"instruction_dim must be an integer from 1 to {instructions.DIM} (the encoder's dimension; below it "
                f"a frozen projection compresses e(c)), got {dim!r}"
            )
        if self.instruction_source not in SOURCES:
            raise ValueError(f"instruction_source must be one of {', '.join(SOURCES)}, got {self.instruction_source!r}")


def shape_key(d_in: int, d_out: int) -> str:
    """A head's name: the layer shape d_out x d_in, e.g. "256x256"."""
    return f"{d_out}x{d_in}"


class Head(nn.Module):
    """One layer shape's heads: W_A (E, r d_in, d_h), b_A (E, r d_in), W_B (E, d_out r, d_h), b_B (E, d_out r).
    T2L's LoRA-matching init: weights zero, b_A LoRA's initial A (U(+-1/sqrt(d_in))), b_B zero."""

    def __init__(self, d_in: int, d_out: int, config: TextLoraConfig, generators, like: torch.Tensor):
        super().__init__()
        E, r, h = len(generators), config.r, config.hidden
        self.d_in, self.d_out = d_in, d_out
        self.A_weight = param(zero_members((r * d_in, h), E), like=like)
        self.A_bias = param(uniform_members((r * d_in,), 1.0 / math.sqrt(d_in), generators), like=like)
        self.B_weight = param(zero_members((d_out * r, h), E), like=like)
        self.B_bias = param(zero_members((d_out * r,), E), like=like)


class TextLoraHyperNetwork(nn.Module):
    """The shared module: the task encoder (P, p), the layer and role embeddings, the trunk (W1, b1) and one Head
    per layer shape; and the bound instruction table. Draws, member by member: P, p, E_layer, E_role, W1, b1, then
    each shape's b_A in forward order."""

    layer_slots = ("layer_emb",)  # E_layer is per layer: slot l of dim 1 is backbone layer l (gradients.py)

    def __init__(
        self,
        model: nn.Module,
        sites: list[Site],
        config: TextLoraConfig,
        generators: list[torch.Generator],
        like: torch.Tensor,
    ):
        super().__init__()
        c, d_c = config, config.instruction_dim
        self.r, self.d_c = c.r, d_c
        groups = key_slots(model, sites)  # (role, shape) key -> its sites, backbone layers 0 .. L-1
        roles = list(dict.fromkeys(s.target.role for s in sites))  # forward order of first appearance
        self.keys: dict[str, tuple[int, str, int]] = {}  # key -> (role index, head name, layers L)
        shapes: dict[str, tuple[int, int]] = {}
        for key, group in groups.items():
            base = model.get_submodule(group[0].target.path)
            head = shape_key(base.d_in, base.d_out)
            shapes.setdefault(head, (base.d_in, base.d_out))
            self.keys[key] = (roles.index(group[0].target.role), head, len(group))
        d_z = c.task_dim + 2 * c.embed_dim
        self.task_proj = param(uniform_members((c.task_dim, d_c), 1.0 / math.sqrt(d_c), generators), like=like)
        self.task_bias = param(uniform_members((c.task_dim,), 1.0 / math.sqrt(d_c), generators), like=like)
        self.layer_emb = param(normal_members((sites[0].n_layers, c.embed_dim), 1.0, generators), like=like)
        self.role_emb = param(normal_members((len(roles), c.embed_dim), 1.0, generators), like=like)
        self.W1 = param(uniform_members((c.hidden, d_z), 1.0 / math.sqrt(d_z), generators), like=like)
        self.b1 = param(uniform_members((c.hidden,), 1.0 / math.sqrt(d_z), generators), like=like)
        self.heads = nn.ModuleDict({name: Head(*dims, c, generators, like) for name, dims in shapes.items()})
        # frozen e(c) bound to the members: (E, d_c) one per member, or (E, T, d_c) one per task of a suite
        self.register_buffer("instruction", None)

    def bind_instruction(self, e: torch.Tensor) -> None:
        """Keep the members' frozen instruction embeddings, used when a forward is given none: e (E, d_c), one per
        member, or (E, T, d_c), one per task of a suite (each sample then uses its own task's row, by the forward's
        task indices)."""
        E = self.task_proj.shape[0]
        if e.dim() not in (2, 3) or e.shape[0] != E or e.shape[-1] != self.d_c:
            raise ValueError(
                f"text-lora binds e (E={E}, d_c={self.d_c}) or (E={E}, T, d_c={self.d_c}), got {tuple(e.shape)}"
            )
        self.instruction = e.detach().to(self.task_proj).contiguous()

    def table(self, instruction: torch.Tensor | None = None) -> torch.Tensor:
        """The forward's instruction table (E, T, d_c): `instruction` ((E, d_c) or (E, T, d_c)) if given, else the
        bound one; an (E, d_c) is a table of one row."""
        e = instruction if instruction is not None else self.instruction
        if e is None:
            raise ValueError(
                "text-lora generates every layer's LoRA factors from the task's instruction embedding e(c), and this "
                "forward has none: bind one (the method's bind, or model.shared['text_lora'].bind_instruction(e) with "
                "e (E, d_c) or (E, T, d_c)) or pass the forward an instruction"
            )
        return e.unsqueeze(1) if e.dim() == 2 else e

    def hidden(self, key: str, table: torch.Tensor) -> torch.Tensor:
        """The trunk's output h (E, T L, d_h) for every member, task of `table` (E, T, d_c) and layer of the key:
        row t L + l is task t, layer l."""
        role, name, L = self.keys[key]
        E, T = table.shape[:2]
        d_t, d_e = self.task_proj.shape[1], self.layer_emb.shape[2]
        code = F.layer_norm(bmm_add(self.task_bias.unsqueeze(1), table, self.task_proj.transpose(1, 2)), (d_t,))
        depth = F.layer_norm(self.layer_emb[:, :L], (d_e,))  # (E, L, d_e): the key's layers are 0 .. L-1
        kind = F.layer_norm(self.role_emb[:, role], (d_e,))  # (E, d_e)
        z = torch.cat(
            [
                code.unsqueeze(2).expand(E, T, L, d_t),
                depth.unsqueeze(1).expand(E, T, L, d_e),
                kind.view(E, 1, 1, d_e).expand(E, T, L, d_e),
            ],
            dim=-1,
        ).reshape(E, T * L, -1)  # row t L + l: task t, layer l
        return memberwise(F.silu, bmm_add(self.b1.unsqueeze(1), z, self.W1.transpose(1, 2)))  # (E, T L, d_h)

    def forward(self, key: str, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The factors of the key's L layers for every member and task of `table` (E, T, d_c): A (E, L, T r, d_in)
        with task t's A_l in rows t r .. (t + 1) r - 1, and B (E, L, d_out, T r) with its B_l in those columns (the
        layout of one rank-T r LoRA, as lora-per-task's). One trunk and head evaluation over the E T L inputs."""
        _, name, L = self.keys[key]
        head, r = self.heads[name], self.r
        E, T = table.shape[:2]
        h = self.hidden(key, table)  # (E, T L, d_h)
        A = bmm_add(head.A_bias.unsqueeze(1), h, head.A_weight.transpose(1, 2))  # (E, T L, r d_in)
        B = bmm_add(head.B_bias.unsqueeze(1), h, head.B_weight.transpose(1, 2))  # (E, T L, d_out r)
        A = A.view(E, T, L, r, head.d_in).transpose(1, 2).reshape(E, L, T * r, head.d_in)
        B = B.view(E, T, L, head.d_out, r).permute(0, 2, 3, 1, 4).reshape(E, L, head.d_out, T * r)
        return A, B


class TextLoraLinear(nn.Module):
    """A frozen StackedLinear plus s B_l A_l x, with (A_l, B_l) this layer's slot of what the shared hypernetwork
    generates from each sample's task instruction. No parameters of its own."""

    def __init__(self, base: StackedLinear, site: Site, config: TextLoraConfig, generators: list[torch.Generator]):
        super().__init__()
        self.base, self.scale, self.r = base, config.scale, config.r
        self.key, self.layer = role_shape_key(site, base), site.target.layer

    def factors(self, shared: nn.ModuleDict, instruction=None, scratch: dict | None = None):
        """This layer's A (E, T r, d_in) and B (E, d_out, T r), T the table's tasks (`instruction` or the bound
        one); `scratch` the forward's ctx.scratch (None: generate afresh, e.g. to materialise the factors)."""
        net = shared[FAMILY]
        cache = None if scratch is None else scratch.setdefault(FAMILY, {})
        A, B = cached(cache, self.key, lambda: net(self.key, net.table(instruction)))
        return A[self.layer], B[self.layer]

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        net = ctx.shared[FAMILY]
        if net.table(ctx.instruction).shape[1] > MASKED_TASKS:
            return self.through_hidden(x, ctx)
        A, B = self.factors(ctx.shared, ctx.instruction, ctx.scratch)
        T = A.shape[1] // self.r
        if T == 1:  # one row serves every sample: plain LoRA (merged on the deep-narrow, as lora's)
            return lora_linear(x, self.base, A, B, self.scale)
        # A batch mixing T tasks: every task's A_t x at once, (E, N, [tokens,] T r), masked to the sample's own r
        # slots, then one B matmul over all tasks (lora-per-task's form). It costs T r (d_in + d_out) per row in
        # two batched matmuls; gathering each sample's factors would cost r (d_in + d_out) per row but materialise
        # N r (d_in + d_out) numbers per layer (and their gradients) and run N small products. For a suite's few
        # tasks (T = 4) the masked form is the cheaper one.
        s = stacked_linear(x, A)
        mask = task_mask(task_index(ctx, x), T, self.r, s)  # (E, N, T r)
        if s.dim() == 4:  # the Transformer's tokens share their sequence's task
            mask = mask.unsqueeze(2)
        return low_rank_update(self.base(x), s * mask, B, self.scale)

    def through_hidden(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The same update for a table of many tasks, without generating any factor: with h the sample's trunk
        output (d_h), A x = reshape(W_A h + b_A) x = sum_k h_k (W_A[.., k] x) + b_A x and B s likewise, so each
        layer costs 2 N r d_h (d_in + d_out) whatever T (the masked form: T r (d_in + d_out) per row, plus
        generating every task's factors)."""
        net = ctx.shared[FAMILY]
        _, name, L = net.keys[self.key]
        head, r = net.heads[name], self.r
        cache = ctx.scratch.setdefault(FAMILY, {})
        if (self.key, "h") not in cache:
            table = net.table(ctx.instruction)
            cache[self.key, "h"] = net.hidden(self.key, table).view(table.shape[0], table.shape[1], L, -1).unbind(2)
        h_l = cache[self.key, "h"][self.layer]  # (E, T, d_h): this layer's trunk output per task
        E, d_h = h_l.shape[0], h_l.shape[-1]
        task = task_index(ctx, x)  # (E, N)
        h = torch.gather(h_l, 1, task.unsqueeze(-1).expand(-1, -1, d_h))  # (E, N, d_h): each sample its task's
        flat = x.reshape(E, -1, x.shape[-1])  # (E, N [tokens], d_in)
        if x.dim() == 4:  # the Transformer's tokens share their sequence's task
            h = h.unsqueeze(2).expand(-1, -1, x.shape[2], -1).reshape(E, -1, d_h)
        W_A = head.A_weight.view(E, r, head.d_in, d_h).permute(0, 2, 1, 3).reshape(E, head.d_in, r * d_h)
        u = torch.bmm(flat, W_A).view(E, -1, r, d_h)  # (E, M, r, d_h): W_A[.., k] x for every k
        s = (u * h.unsqueeze(2)).sum(-1) + torch.bmm(flat, head.A_bias.view(E, r, head.d_in).transpose(1, 2))
        outer = (s.unsqueeze(-1) * h.unsqueeze(2)).reshape(E, -1, r * d_h)  # (E, M, r d_h)
        W_B = head.B_weight.view(E, head.d_out, r * d_h).transpose(1, 2)  # (E, r d_h, d_out)
        delta = torch.bmm(outer, W_B) + torch.bmm(s, head.B_bias.view(E, head.d_out, r).transpose(1, 2))
        return self.base(x) + self.scale * delta.view(*x.shape[:-1], head.d_out)


class TextLora(AdapterMethod):
    def __init__(self):
        super().__init__(
            NAME,
            "Text-to-LoRA: one hypernetwork shared by all layers generates each layer's LoRA factors from the "
            "task instruction's embedding e(c) (suites; qlbench interpretation)",
            TextLoraConfig,
            TextLoraLinear,
            shared_cls=TextLoraHyperNetwork,
            family=FAMILY,
            kind="task",
        )

    def bind(self, model, members: list[tuple[str, int]], config: TextLoraConfig) -> None:
        """Each member its own function's instruction e(c) (E, d_c), by instruct-queryable's rule (a card's
        sentence, or for "random" a seeded random vector of the sentence embedding's norm)."""
        model.shared[self.family].bind_instruction(instruct.METHOD.instructions(members, config))


METHOD = TextLora()
