"""Poly (Polytropon, Ponti et al. 2023, arXiv 2202.13914) and its multi-head form MHR (Caccia et al. 2022, arXiv
2211.03831): per layer, an inventory of K LoRA skills and a learned task-to-skill allocation, as peft's `poly` tuner.

    y = W0 x + b0 + (1 / r) B_t A_t x,   A_t = sum_k w_tk A_k,  B_t = sum_k w_tk B_k,
    w_t = sigmoid(z_t) / (sum_k sigmoid(z_tk) + 1e-12),   t = the sample's task (ForwardContext.task; 0 without one)

Shapes per member: skills A (K r, d_in) (skill k in rows k r .. (k + 1) r - 1), B (d_out, K r) (skill k in those
columns), allocation logits z (T, Q K) per layer (peft's one router per layer). With n_splits Q > 1 (MHR) each skill
is cut into Q blocks, A's along d_in and B's along d_out (peft's layout), and each block q has its own weights w_tq:
A_t x = sum_q sum_k w_tqk A_qk x_q, and output block q of the update is (1 / r) sum_k w_tqk B_qk (A_t x). The scale
is peft's 1 / r: there is no alpha. In a suite (T > 1) a sample's A_t and B_t are never built: A_all x (K r per
sample and token) is weighted and summed over the skills to t = A_t x (r), then w ⊗ t (K r) goes through B_all in
one matmul. With one task (a single-task run) every sample has the same allocation, so the layer is LoRA with the
mixed factors A_1, B_1 and takes LoRA's path (merged into W0 on small layers: lora.merges).

Init as peft: every A_qk ~ U(+-1/sqrt(d_in / Q)) (kaiming-uniform with a = sqrt(5) on its r x d_in / Q block), B = 0
(the adapted model equals the frozen one at step 0), z ~ U(-1e-3, 1e-3); member e draws A, then z, from generators[e].

qlbench interpretation: peft trains with a relaxed-Bernoulli sample of the allocation (temperature 1, drawn from the
global RNG at every forward in training mode) and evaluates with sigmoid(z); qlbench uses the sigmoid allocation in
training and in evaluation. A per-member seeded draw would need generator state advanced at every forward, which a
step recorded in a CUDA graph (engine/step.py) replays frozen and which makes a step depend on how many forwards ran
before it; the deterministic form keeps "same seed, same numbers" and is peft's evaluation-mode forward exactly
(tests/test_poly.py checks outputs and gradients against peft in eval mode). The logits' task axis is declared in
`task_axes`, so a task's logits are decayed only in the stages that train it (adapters.base.isolate_tasks); the
skills are shared by every task and decay in every stage.

Trainable, L layers: L (K r (d_in + d_out) + T Q K). Defaults r = 8, K = 4, Q = 1, T = 1 (a single-task run):
65,664 on the deep-narrow MLP (32 layers 32 x 32) and 524,416 on the Transformer (q, k, v, o of 8 layers,
256 x 256), 4.0 times LoRA r = 8's (16,384 and 131,072); r = 2 (K r = 8) is LoRA's size plus the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from qlbench.adapters.base import AdapterMethod, Site, check_positive_int, check_targets
from qlbench.adapters.lora import lora_linear, low_rank_update
from qlbench.adapters.lora_per_task import task_index
from qlbench.stacked import ForwardContext, StackedLinear, memberwise, param, stacked_linear, uniform_members

NAME = "poly"
EPS = 1e-12  # peft's: w = sigmoid(z) / (sum + EPS)
LOGIT_BOUND = 1e-3  # peft's router init: z ~ U(-1e-3, 1e-3)


@dataclass
class PolyConfig:
    r: int = 8  # every skill's rank
    n_skills: int = 4  # K: skills (LoRAs) per layer (peft's default)
    n_splits: int = 1  # Q: blocks per skill, each with its own allocation (Q > 1: MHR)
    tasks: int = 1  # T: the suite's task count (`qlbench suite` sets it; a single-task run has one)
    targets: tuple[str, ...] | None = None  # backbone target roles; None = the backbone's default

    def __post_init__(self):
        check_positive_int(self, "r", "n_skills", "n_splits", "tasks")
        check_targets(self)


class PolyLinear(nn.Module):
    """A frozen StackedLinear plus (1 / r) B_t A_t x, each sample's skills mixed by its task's allocation."""

    task_axes = {"poly_logits": 1}  # task t owns row t of the logits (adapters.base.isolate_tasks)

    def __init__(self, base: StackedLinear, site: Site, config: PolyConfig, generators: list[torch.Generator]):
        super().__init__()
        K, Q, r = config.n_skills, config.n_splits, config.r
        if base.d_in % Q or base.d_out % Q:
            raise ValueError(
                f"n_splits={Q} must divide every adapted layer's d_in and d_out; {site.target.path} is "
                f"{base.d_in} -> {base.d_out}"
            )
        self.base, self.scale, self.tasks = base, 1.0 / r, config.tasks
        self.r, self.n_skills, self.n_splits = r, K, Q
        bound = 1.0 / math.sqrt(base.d_in // Q)
        self.poly_A = param(uniform_members((K * r, base.d_in), bound, generators), like=base.weight)  # (E, K r, d_in)
        self.poly_B = nn.Parameter(base.weight.new_zeros(base.members, base.d_out, K * r))  # (E, d_out, K r)
        logits = uniform_members((config.tasks, Q * K), LOGIT_BOUND, generators)
        self.poly_logits = param(logits, like=base.weight)  # (E, T, Q K): task t's row, split-major as peft's

    def allocation(self) -> torch.Tensor:
        """Every task's skill weights (E, T, Q, K): the normalised sigmoid of its logits."""
        p = memberwise(torch.sigmoid, self.poly_logits).unflatten(-1, (self.n_splits, self.n_skills))  # (E, T, Q, K)
        return p / (p.sum(-1, keepdim=True) + EPS)

    def weights(self, ctx: ForwardContext, x: torch.Tensor) -> torch.Tensor:
        """Each sample's skill weights (E, N, Q, K): its task's allocation."""
        task = task_index(ctx, x)  # (E, N)
        rows = torch.arange(task.shape[0], device=task.device).unsqueeze(1)
        return self.allocation()[rows, task]  # (E, N, Q, K)

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every task's mixed A_t and B_t as A (E, T r, d_in) and B (E, d_out, T r), task t in rows (columns)
        t r .. (t + 1) r - 1; split q's blocks of d_in (d_out) mixed with its own weights."""
        K, Q, r, T = self.n_skills, self.n_splits, self.r, self.tasks
        E, w = self.poly_A.shape[0], self.allocation()  # (E, T, Q, K)
        A = torch.einsum("etqk,ekrqd->etrqd", w, self.poly_A.view(E, K, r, Q, -1))  # (E, T, r, Q, d_in / Q)
        B = torch.einsum("etqk,eqokr->eqotr", w, self.poly_B.view(E, Q, -1, K, r))  # (E, Q, d_out / Q, T, r)
        return A.reshape(E, T * r, -1), B.reshape(E, -1, T * r)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        K, Q, r = self.n_skills, self.n_splits, self.r
        if self.tasks == 1:  # one allocation for every sample: LoRA with the mixed factors (merged on small layers)
            A, B = self.factors()
            return lora_linear(x, self.base, A, B, self.scale)
        w = self.weights(ctx, x)  # (E, N, Q, K)
        if x.dim() == 4:  # (E, N, tokens, d_in): a sequence's tokens share its task's weights
            w = w.unsqueeze(2)  # (E, N, 1, Q, K)
        y = self.base(x)  # (E, N, [tokens,] d_out)
        if Q == 1:
            w = w.squeeze(-2).unsqueeze(-1)  # (E, N, [1,] K, 1)
            s = stacked_linear(x, self.poly_A).unflatten(-1, (K, r))  # (E, N, [tokens,] K, r): every A_k x
            t = (s * w).sum(-2)  # (E, N, [tokens,] r): A_t x
            return low_rank_update(y, (w * t.unsqueeze(-2)).flatten(-2), self.poly_B, self.scale)
        E = x.shape[0]
        xq = x.unflatten(-1, (Q, -1))  # (E, N, [tokens,] Q, d_in / Q)
        A = self.poly_A.unflatten(-1, (Q, -1))  # (E, K r, Q, d_in / Q)
        s = torch.einsum("e...qd,ekqd->e...qk", xq, A).unflatten(-1, (K, r))  # (E, N, [tokens,] Q, K, r)
        w = w.unsqueeze(-1)  # (E, N, [1,] Q, K, 1)
        t = (s * w).sum((-3, -2))  # (E, N, [tokens,] r): A_t x, every split's block summed
        u = (w * t.unsqueeze(-2).unsqueeze(-2)).flatten(-2)  # (E, N, [tokens,] Q, K r): w_tqk A_t x
        B = self.poly_B.view(E, Q, -1, K * r)  # (E, Q, d_out / Q, K r): output block q's skills
        return y + self.scale * torch.einsum("e...qk,eqok->e...qo", u, B).flatten(-2)  # (E, N, [tokens,] d_out)


METHOD = AdapterMethod(
    NAME,
    "Poly / MHR: K LoRA skills per layer mixed by a learned per-task allocation (peft's poly; one task: one mix)",
    PolyConfig,
    PolyLinear,
    kind="task",
)
