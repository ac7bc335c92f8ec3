"""LoRA per task: a separate rank-r LoRA for every task of a suite, each sample through its own task's (the
separate-adapters reference of the multi-task suites; T times LoRA's parameters).

    y = W0 x + b0 + s B_t A_t x,   t = the sample's task (ForwardContext.task; task 0 when there is none)

All T factors of a layer are one matmul of rank T r: the rank-space state A_all x (E, N, T r) is masked to the
sample's own task's r entries before B_all, so task t's factors get gradient from task t's samples only. Each
task's A_t starts as LoRA's A (U(+-1/sqrt(d_in)), drawn task by task) and B_t at zero; with one task the method is
LoRA, number for number (tests/test_task_methods.py).

A held-out task (one no stage of a suite trains) keeps its initial factors (B_t = 0: the frozen backbone). The
suite row `nearest-task` (multitask.VARIANTS) is this method with every such task evaluated through the factors
of its nearest trained task in parameter space instead (suite_tasks.held_out_routes, parametric suites): the
nearest-neighbour baseline of the held-out experiment, which transfers without words. qlbench interpretation: the
routing is a rule of the evaluation (the forward reads the routed task index), so the method itself is unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from qlbench.adapters.base import AdapterMethod, Site, check_positive_int
from qlbench.adapters.lora import LoraConfig, low_rank_update
from qlbench.stacked import ForwardContext, StackedLinear, param, stacked_linear, uniform_members

NAME = "lora-per-task"


@dataclass
class TaskConfig(LoraConfig):
    tasks: int = 1  # T: the suite's task count (`qlbench suite` sets it; a single-task run has one)

    def __post_init__(self):
        super().__post_init__()
        check_positive_int(self, "tasks")


def task_index(ctx: ForwardContext, x: torch.Tensor) -> torch.Tensor:
    """Each sample's task (E, N) long: the forward's, or task 0 for every sample when it has none."""
    if ctx.task is not None:
        return ctx.task
    return torch.zeros(x.shape[0], x.shape[1], dtype=torch.long, device=x.device)


def task_mask(task: torch.Tensor, tasks: int, r: int, like: torch.Tensor) -> torch.Tensor:
    """(E, N, T r): 1 on the r rank slots of each sample's task, 0 elsewhere (like's dtype and device)."""
    one_hot = torch.nn.functional.one_hot(task, tasks).to(like)  # (E, N, T)
    return one_hot.repeat_interleave(r, dim=-1)


class LoraPerTaskLinear(nn.Module):
    """A frozen StackedLinear plus T rank-r updates, one per task."""

    task_axes = {"lora_per_task_A": 1, "lora_per_task_B": 2}  # task t owns block t of r along these axes

    def __init__(self, base: StackedLinear, site: Site, config: TaskConfig, generators: list[torch.Generator]):
        super().__init__()
        T, r = config.tasks, config.r
        self.base, self.scale, self.tasks, self.r = base, config.scale, T, r
        bound = 1.0 / math.sqrt(base.d_in)
        self.lora_per_task_A = param(uniform_members((T * r, base.d_in), bound, generators), like=base.weight)
        self.lora_per_task_B = nn.Parameter(
            torch.zeros(base.members, base.d_out, T * r, device=base.weight.device, dtype=base.weight.dtype)
        )  # (E, d_out, T r): task t's B_t in columns t r .. (t + 1) r - 1, its A_t in rows of A (E, T r, d_in)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        s = stacked_linear(x, self.lora_per_task_A)  # (E, N, [tokens,] T r)
        mask = task_mask(task_index(ctx, x), self.tasks, self.r, s)  # (E, N, T r)
        if s.dim() == 4:  # the Transformer's tokens share their sequence's task
            mask = mask.unsqueeze(2)
        return low_rank_update(self.base(x), s * mask, self.lora_per_task_B, self.scale)


METHOD = AdapterMethod(
    NAME,
    "LoRA per task: a separate rank-r LoRA for every task, each sample through its own task's",
    TaskConfig,
    LoraPerTaskLinear,
    family="lora_per_task",  # its parameters' prefix (a name with a hyphen is not an attribute name)
    kind="task",
)
