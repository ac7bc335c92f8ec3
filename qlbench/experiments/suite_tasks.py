"""A suite's tasks as a stack sees them: every task's data concatenated with its task index, the instruction table
(one row per task: its sentence's embedding, a seeded random code or its parameters' code), and the per-task
evaluation of a trained stack (test MSE per task, held-out routes, labels standardised on the trained tasks, atom
usage). The suite workload (multitask) trains on these."""

from __future__ import annotations

import torch

from qlbench import engine, instructions, parametric, suites, zoo
from qlbench.adapters import instruct, queryable
from qlbench.seeding import generator
from qlbench.stacked import ForwardContext

PARAMETER_SOURCE = "params"  # a suite row's instruction source: each task's parameter code (parametric.codes)


# ---------------------------------------------------------------------------------------------------------------
# Data and instructions.


def task_data(suite: suites.Suite, seeds: list[int], tasks: list[int], *, dtype, device) -> engine.StackedData:
    """The given tasks' data for each seed (member), concatenated task after task, with each sample's task index."""
    splits, ids = [], []
    for seed in seeds:
        parts = [suite.task_data(t, seed, dtype=dtype, device=device) for t in tasks]
        splits.append(zoo.Split(*(torch.cat([getattr(p, k) for p in parts]) for k in zoo.Split._fields)))
        ids.append(
            tuple(
                torch.cat([torch.full((len(getattr(p, k)),), t, dtype=torch.long) for t, p in zip(tasks, parts)])
                for k in ("y_train", "y_test")
            )
        )
    return engine.StackedData.stack(splits, ids)


def parameter_codes(suite: suites.Suite) -> torch.Tensor:
    """(T, 384) float64: each task's parameter code (parametric.codes) at the sentence embedding's dimension;
    ValueError naming the parametric suites for a suite without task parameters."""
    if suite.name not in parametric.names():
        raise ValueError(
            f"suite {suite.name!r} has no task parameters; valid: {', '.join(parametric.names())} (parametric suites)"
        )
    return parametric.codes([parametric.params(t) for t in suite.tasks], instructions.DIM)


def instruction_table(suite: suites.Suite, config, texts: list[str] | None = None) -> torch.Tensor:
    """The router's e (T, d_c) float64 for the suite's tasks: each task's sentence (or `texts[t]`) through the
    frozen encoder, or for `instruction_source` random (the task-code row) a seeded random vector per task of the
    sentence embedding's norm, or for params (param-code, text-lora-params) each task's parameter code."""
    if config.instruction_source == PARAMETER_SOURCE:
        return instruct.router_input(parameter_codes(suite), config.instruction_dim)
    texts = suite.instructions() if texts is None else texts
    raw = instructions.embed(texts).to(torch.float64)  # (T, 384)
    if config.instruction_source == "random":
        codes = torch.stack(
            [
                torch.randn(raw.shape[1], generator=generator("task-code", suites.data_name(suite.name), t.name)).to(
                    torch.float64
                )
                for t in suite.tasks
            ]
        )
        raw = codes / codes.norm(dim=1, keepdim=True) * raw.norm(dim=1, keepdim=True)
    elif config.instruction_source != "card":
        raise ValueError(
            f"a suite row reads each task's own sentence or a task code, not {config.instruction_source!r}"
        )
    return instruct.router_input(raw, config.instruction_dim)


def bind(model, table: torch.Tensor, members: int) -> None:
    """Every member conditions each sample on its task's row of `table` (T, d_c): the method's shared module that
    keeps the instruction (queryable's memory, text-lora's hypernetwork) binds it as (E, T, d_c)."""
    keepers = [m for m in model.shared.values() if hasattr(m, "bind_instruction")]
    if len(keepers) != 1:
        raise ValueError(f"expected one shared module that binds an instruction, found {len(keepers)}")
    keepers[0].bind_instruction(table.expand(members, -1, -1))


# ---------------------------------------------------------------------------------------------------------------
# Evaluation.


@torch.no_grad()
def task_mse(
    model, data: engine.StackedData, tasks: int, route: torch.Tensor | None = None, y: torch.Tensor | None = None
) -> torch.Tensor:
    """(E, T) test MSE of each task: the mean squared error over its held-out samples. `route` (T,) long: the task
    index each task's samples are run with (held_out_routes; default its own); `y` (E, N): other labels for the
    test samples (default data.y_test)."""
    model.eval()
    task = data.task_test if route is None else route.to(data.task_test.device)[data.task_test]
    sq = engine.squared_errors(model, data.x_test, data.y_test if y is None else y, task=task)  # (E, N)
    model.train()
    one_hot = torch.nn.functional.one_hot(data.task_test, tasks).to(sq)  # (E, N, T): grouped by the sample's task
    return ((sq.unsqueeze(-1) * one_hot).sum(1) / one_hot.sum(1)).cpu()


def held_out_routes(suite: suites.Suite, schedule: str, rule: str) -> torch.Tensor:
    """(T,) long: the task index each task is evaluated with under `rule` (ROUTES): its own ("own"), or for
    "nearest" each task no stage of `schedule` trains the nearest trained task in parameter space
    (parametric.closest: the first of equally near ones), the trained tasks their own."""
    T = len(suite.tasks)
    route = torch.arange(T)
    if rule == "own":
        return route
    trained = sorted({t for group in suite.schedule_stages(schedule) for t in group})
    p = [parametric.params(t) for t in suite.tasks]
    for t in sorted(set(range(T)) - set(trained)):
        route[t] = trained[parametric.closest(p[t], [p[i] for i in trained])]
    return route


def own_statistics(suite: suites.Suite) -> torch.Tensor:
    """(T, 2) float64: each task's (mean, std) of its clean function over the box, by which its labels are
    standardised (suites.Suite.standardisation)."""
    return torch.tensor([suite.standardisation(t) for t in suite.tasks], dtype=torch.float64)


def pooled_statistics(y: torch.Tensor, task: torch.Tensor, own: torch.Tensor, trained: list[int]) -> torch.Tensor:
    """(E, 2) float64: per member, the mean and the population std of the raw training labels (sd_t y + mu_t,
    `own` (T, 2)) of the samples of y (E, N) whose task (E, N) is one of `trained`, pooled over those tasks."""
    raw = own[task, 1] * y.to(torch.float64) + own[task, 0]  # (E, N)
    keep = torch.isin(task, torch.tensor(trained, device=task.device)).to(torch.float64)
    n = keep.sum(1)
    mean = (raw * keep).sum(1) / n
    var = (((raw - mean.unsqueeze(1)) ** 2) * keep).sum(1) / n
    return torch.stack([mean, var.sqrt()], 1)


def restandardise(y: torch.Tensor, task: torch.Tensor, own: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """Labels y (E, N), standardised by their task's own statistics `own` (T, 2), standardised instead by each
    member's `pooled` (E, 2) mean and std: (sd_t y + mu_t - m) / s, in float64."""
    raw = own[task, 1] * y.to(torch.float64) + own[task, 0]
    return (raw - pooled[:, :1]) / pooled[:, 1:]


@torch.no_grad()
def usage(model, data: engine.StackedData, tasks: int) -> torch.Tensor:
    """(E, T, M) block-averaged atom usage: the routing weights alpha averaged over blocks and each task's held-out
    samples (rows sum to 1)."""
    model.eval()
    ctx = ForwardContext(model.shared, None, data.task_test)
    model(data.x_test, ctx=ctx)
    model.train()
    routes = ctx.scratch[queryable.NAME].routes
    alpha = torch.stack([routes[b].alpha for b in sorted(routes)]).mean(0)  # (E, N, M)
    one_hot = torch.nn.functional.one_hot(data.task_test, tasks).to(alpha)  # (E, N, T)
    return (one_hot.transpose(1, 2) @ alpha / one_hot.sum(1).unsqueeze(-1)).cpu()
