"""Task-LoRA: one shared LoRA whose rank space is turned by a learned r x r core per task (task conditioning
without routing over shared atoms; the control that separates "knows the task" from "routes among atoms").

    y = W0 x + b0 + s B C_t A x,   t = the sample's task (ForwardContext.task; task 0 when there is none)

A and B start as LoRA's (B = 0) and every core C_t at the identity, so the model starts as the frozen one and,
with one task, is LoRA with one extra r x r matrix. Trainable: LoRA's L r (d_in + d_out) plus L T r^2 (on the
deep-narrow's 32 x 32 layers at r = 8 and T = 4, 1.5 times LoRA; on the Transformer's 256-wide projections
1.06 times).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from qlbench.adapters.base import AdapterMethod, Site
from qlbench.adapters.lora import lora_factors, low_rank_update
from qlbench.adapters.lora_per_task import TaskConfig, task_index
from qlbench.stacked import ForwardContext, StackedLinear, rank_project

NAME = "task-lora"


class TaskLoraLinear(nn.Module):
    """A frozen StackedLinear plus s B C_t A x with a per-task core C_t (E, T, r, r)."""

    task_axes = {"task_lora_C": 1}  # task t owns core t (adapters.base.isolate_tasks)

    def __init__(self, base: StackedLinear, site: Site, config: TaskConfig, generators: list[torch.Generator]):
        super().__init__()
        self.base, self.scale, self.tasks = base, config.scale, config.tasks
        self.task_lora_A, self.task_lora_B = lora_factors(base, config.r, generators)
        eye = torch.eye(config.r, device=base.weight.device, dtype=base.weight.dtype)
        self.task_lora_C = nn.Parameter(eye.expand(base.members, config.tasks, -1, -1).clone())  # (E, T, r, r)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        s = rank_project(x, self.task_lora_A)  # (E, N, [tokens,] r)
        task = task_index(ctx, x)  # (E, N)
        rows = torch.arange(task.shape[0], device=task.device).unsqueeze(1)
        C = self.task_lora_C[rows, task]  # (E, N, r, r): each sample its task's core
        if s.dim() == 3:
            t = (C @ s.unsqueeze(-1)).squeeze(-1)  # (E, N, r)
        else:  # (E, N, tokens, r): a sequence's tokens share its task's core
            t = s @ C.transpose(-1, -2)
        return low_rank_update(self.base(x), t, self.task_lora_B, self.scale)


METHOD = AdapterMethod(
    NAME,
    "Task-LoRA: one LoRA with a learned r x r core per task, s B C_t A (task conditioning, no routing)",
    TaskConfig,
    TaskLoraLinear,
    family="task_lora",  # its parameters' prefix (a name with a hyphen is not an attribute name)
    kind="task",
)
