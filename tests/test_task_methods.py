"""The task channel: lora-per-task and task-lora against plain LoRA oracles, per-sample instructions, and a mixed
multi-task batch against one forward per task (same loss and gradients) for every method that reads the task."""

from __future__ import annotations

import zlib

import pytest
import torch

from qlbench import adapters, instructions
from qlbench.backbones import DeepNarrowMLP, RegressionTransformer
from qlbench.settings import Execution, Protocol

from helpers import F64, TINY_DEEP_NARROW, TINY_TRANSFORMER, gens

T = 3
ARCHS = {
    "deep-narrow": lambda: DeepNarrowMLP(gens("bb", members=2), TINY_DEEP_NARROW, dtype=F64),
    "transformer": lambda: RegressionTransformer(gens("bb", members=2), TINY_TRANSFORMER, dtype=F64),
}


def build(method: str, arch: str, **overrides) -> torch.nn.Module:
    m = adapters.get(method)
    model = m.build(ARCHS[arch](), m.make_config(**overrides), gens("init", members=2), torch.zeros(2, 1, dtype=F64))
    return model


def perturb(model: torch.nn.Module, tag: str) -> None:
    """Every trainable tensor moved by seeded noise (B leaves zero, cores leave the identity)."""
    g = torch.Generator().manual_seed(zlib.crc32(tag.encode()))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def inputs(n: int = 12):
    g = torch.Generator().manual_seed(5)
    x = torch.rand(2, n, 2, generator=g, dtype=F64) * 4 - 2  # (E, N, 2)
    task = torch.randint(0, T, (2, n), generator=g)  # (E, N)
    return x, task


def lora_with(arch: str, factors) -> torch.nn.Module:
    """A plain LoRA stack on the same (identically seeded) backbone whose layers' (A, B) are factors(path)."""
    lora = build("lora", arch)
    with torch.no_grad():
        for name, module in lora.named_modules():
            if hasattr(module, "lora_A"):
                A, B = factors(name)
                module.lora_A.copy_(A)
                module.lora_B.copy_(B)
    return lora


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_per_task_with_one_task_is_lora(arch):
    a, b = build("lora-per-task", arch), build("lora", arch)
    pa = dict(a.named_parameters())
    for name, p in b.named_parameters():
        if "lora_A" in name:
            torch.testing.assert_close(pa[name.replace("lora_A", "lora_per_task_A")], p, rtol=0, atol=0)
    perturb(a, "one")
    with torch.no_grad():
        for name, module in b.named_modules():
            if hasattr(module, "lora_B"):
                other = a.get_submodule(name)
                module.lora_A.copy_(other.lora_per_task_A)
                module.lora_B.copy_(other.lora_per_task_B)
    x, _ = inputs()
    torch.testing.assert_close(a(x), b(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_per_task_routes_each_sample_through_its_tasks_factors(arch):
    """Oracle: for task t, a plain LoRA carrying task t's slices of A and B gives the samples of task t."""
    model = build("lora-per-task", arch, tasks=T)
    perturb(model, "per-task")
    x, task = inputs()
    out = model(x, task=task)  # (E, N)
    r = 8
    for t in range(T):

        def factors(path, t=t):
            layer = model.get_submodule(path)
            return layer.lora_per_task_A[:, t * r : (t + 1) * r], layer.lora_per_task_B[:, :, t * r : (t + 1) * r]

        expected = lora_with(arch, factors)(x)
        mask = task == t
        torch.testing.assert_close(out[mask], expected[mask], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("arch", ARCHS)
def test_task_lora_is_lora_with_b_times_the_tasks_core(arch):
    """Oracle: s B C_t A x is LoRA with factors (A, B C_t); with every core at the identity, LoRA itself."""
    model = build("task-lora", arch, tasks=T)
    x, task = inputs()
    perturb(model, "task-lora")
    out = model(x, task=task)
    for t in range(T):

        def factors(path, t=t):
            layer = model.get_submodule(path)
            return layer.task_lora_A, layer.task_lora_B @ layer.task_lora_C[:, t]

        expected = lora_with(arch, factors)(x)
        mask = task == t
        torch.testing.assert_close(out[mask], expected[mask], rtol=1e-12, atol=1e-12)
    fresh = build("task-lora", arch, tasks=T)
    assert all(
        torch.equal(m.task_lora_C[0, 1], torch.eye(8, dtype=F64)) for m in fresh.modules() if hasattr(m, "task_lora_C")
    )


def bind_tasks(model, method: str):
    """An instruction method gets a (E, T, 384) table: task t's row is the embedding of its own sentence."""
    if method == "instruct-queryable":
        texts = ["A bowl.", "Ripples around a well.", "Four basins."]
        table = instructions.embed(texts).to(F64)  # (T, 384)
        model.shared["queryable"].bind_instruction(table.expand(2, -1, -1))


READERS = ["lora-per-task", "task-lora", "instruct-queryable"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", READERS)
def test_a_mixed_batch_equals_one_forward_per_task(method, arch):
    """The loss of a batch mixing tasks, and its gradients, equal the task-by-task forwards weighted by each task's
    share of the batch: no sample sees another task's parameters or instruction."""
    overrides = {"n_blocks": 2} if method == "instruct-queryable" else {"tasks": T}
    model = build(method, arch, **overrides)
    bind_tasks(model, method)
    perturb(model, method)
    x, task = inputs()
    y = torch.sin(x.sum(-1))
    params = [p for p in model.parameters() if p.requires_grad]
    mixed = (model(x, task=task) - y).pow(2).mean(1).sum()
    g_mixed = torch.autograd.grad(mixed, params)
    split = 0
    for t in range(T):
        for e in range(2):
            keep = task[e] == t
            if not keep.any():
                continue
            xe = x[e : e + 1, keep].expand(2, -1, -1)  # member e's samples of task t (the other member unused)
            out = model(xe, task=torch.full(xe.shape[:2], t))[e]
            split = split + (out - y[e, keep]).pow(2).sum() / x.shape[1]
    g_split = torch.autograd.grad(split, params)
    torch.testing.assert_close(split, mixed, rtol=1e-12, atol=1e-12)
    for a, b in zip(g_mixed, g_split):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_per_sample_instructions_change_only_their_own_samples():
    """Routing reads each sample's own task's instruction: changing task 1's sentence moves task 1's outputs and
    leaves every other sample's bits alone."""
    model = build("instruct-queryable", "deep-narrow", n_blocks=2)
    bind_tasks(model, "instruct-queryable")
    perturb(model, "shuffle")
    x, task = inputs(30)
    before = model(x, task=task)
    memory = model.shared["queryable"]
    table = memory.instruction.clone()
    table[:, 1] = instructions.embed(["A flat plane."]).to(F64)[0]
    memory.bind_instruction(table)
    after = model(x, task=task)
    assert torch.equal(before[task != 1], after[task != 1])
    assert (before[task == 1] - after[task == 1]).abs().max() > 1e-6


@pytest.mark.parametrize("method", ["lora", "queryable"])
def test_methods_without_a_task_channel_ignore_the_task(method):
    model = build(method, "deep-narrow", **({"n_blocks": 2} if method == "queryable" else {}))
    perturb(model, method)
    x, task = inputs()
    assert torch.equal(model(x, task=task), model(x))


def test_task_methods_count_their_parameters():
    """lora-per-task: T LoRAs; task-lora: one LoRA plus T r x r cores per layer."""
    lora = adapters.trainable_parameter_count(build("lora", "deep-narrow"))
    layers = TINY_DEEP_NARROW.depth
    assert adapters.trainable_parameter_count(build("lora-per-task", "deep-narrow", tasks=T)) == T * lora
    assert adapters.trainable_parameter_count(build("task-lora", "deep-narrow", tasks=T)) == lora + layers * T * 64


def slices(model: torch.nn.Module, task: int) -> list[torch.Tensor]:
    """Copies of one task's own blocks of every task-owned parameter (the oracle reads the layers' layout: block
    t of r along lora-per-task's A rows and B columns, core t of task-lora's cores)."""
    out = []
    for module in model.modules():
        if hasattr(module, "lora_per_task_A"):
            r = module.r
            out += [module.lora_per_task_A[:, task * r : (task + 1) * r].clone()]
            out += [module.lora_per_task_B[:, :, task * r : (task + 1) * r].clone()]
        if hasattr(module, "task_lora_C"):
            out += [module.task_lora_C[:, task].clone()]
    return out


def train_one_task(model: torch.nn.Module, task: int, isolate: bool) -> None:
    """Ten AdamW steps (lr 1e-2, weight decay 0.01, as a stage's fresh optimiser) on samples of one task only."""
    opt = adapters.get("lora").optimizer(model, None, lr=1e-2, weight_decay=0.01)
    if isolate:
        opt = adapters.base.isolate_tasks(opt, model, [task])
    x, _ = inputs()
    tasks = torch.full(x.shape[:2], task)
    for _ in range(10):
        model(x, task=tasks).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("method", ["lora-per-task", "task-lora"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_stage_moves_only_its_own_tasks_parameters(method, arch):
    """With a real learning rate and AdamW's weight decay, training task 1 leaves tasks 0 and 2's own parameters
    bit for bit and moves task 1's. The planted bug (AdamW's decay on every task's block, the code before
    isolate_tasks) changes the untrained blocks, so this check can fail."""
    for isolate in (True, False):
        model = build(method, arch, tasks=T)
        perturb(model, method)  # B away from zero so that decay and gradients reach every block
        before = {t: slices(model, t) for t in range(T)}
        train_one_task(model, 1, isolate)
        after = {t: slices(model, t) for t in range(T)}
        untouched = all(torch.equal(a, b) for t in (0, 2) for a, b in zip(before[t], after[t]))
        assert untouched == isolate
        assert not any(torch.equal(a, b) for a, b in zip(before[1], after[1]))


def test_a_stage_of_every_task_keeps_the_plain_optimiser():
    """A stage that trains every task (joint) decays every block as AdamW does: isolate_tasks changes nothing."""
    model = build("lora-per-task", "deep-narrow", tasks=T)
    opt = adapters.get("lora").optimizer(model, None, lr=1e-2, weight_decay=0.01)
    assert adapters.base.isolate_tasks(opt, model, list(range(T))) is opt and len(opt.param_groups) == 1


# ----------------------------------------------------------------------------------------------------------------
# nearest-task: lora-per-task with each held-out task evaluated through its nearest training task's factors


def routed_mse_by_hand(model, x, y, task, t: int, through: int) -> torch.Tensor:
    """(E,) the MSE of task t's samples, every one run with task index `through` (one forward per member)."""
    out = []
    for e in range(x.shape[0]):
        keep = task[e] == t
        xe = x[e : e + 1, keep].expand(x.shape[0], -1, -1)
        pred = model(xe, task=torch.full(xe.shape[:2], through))[e]
        out.append((pred - y[e, keep]).pow(2).mean())
    return torch.stack(out)


def test_a_routed_task_is_evaluated_through_its_routes_factors():
    """suite_tasks.task_mse with route (0, 1, 0): task 2's samples go through task 0's LoRA (by hand: one forward with
    task index 0), grouped as task 2's MSE; tasks 0 and 1 as without a route. A route to task 1 instead (a planted
    wrong choice) gives another number, so the comparison can fail."""
    from qlbench import engine
    from qlbench.experiments import suite_tasks

    model = build("lora-per-task", "deep-narrow", tasks=T)
    perturb(model, "route")
    x, task = inputs(30)
    y = torch.sin(x.sum(-1))
    data = engine.StackedData(x, y, x, y, task, task)
    plain = suite_tasks.task_mse(model, data, T)
    routed = suite_tasks.task_mse(model, data, T, route=torch.tensor([0, 1, 0]))
    assert torch.equal(routed[:, :2], plain[:, :2])
    torch.testing.assert_close(routed[:, 2], routed_mse_by_hand(model, x, y, task, 2, 0), rtol=1e-12, atol=0)
    assert (routed[:, 2] - plain[:, 2]).abs().min() > 1e-6
    assert (routed[:, 2] - routed_mse_by_hand(model, x, y, task, 2, 1)).abs().min() > 1e-6


def test_nearest_task_trains_as_lora_per_task_and_reports(tmp_path, capsys):
    """A smoke held-out run of lora-per-task and nearest-task on param-sin-cos-4-n50 (a fixed-n suite): the same
    training, so every trained task's MSE is equal bit for bit; a held-out task is lora-per-task's frozen backbone
    (its factors never trained) but nearest-task's nearest training task's LoRA. The record's config carries the
    route (its own hash), and the report writes the fixed-n design's own held-out table."""
    import pandas as pd

    from qlbench import cli, parametric
    from qlbench.experiments import multitask, runner, suite_tasks
    from qlbench.records import results

    suite = parametric.suite_name(4, parametric.FIXED_N)
    p = multitask.plan(
        suite=suite,
        schedule="held-out",
        methods=["lora-per-task", "nearest-task"],
        protocol=Protocol(arch="deep-narrow", budget="smoke", seeds=2),
        execution=Execution(out_dir=tmp_path / "r", threads=1),
    )
    assert p.cell_config("nearest-task")["held_out_route"] == "nearest"
    assert "held_out_route" not in p.cell_config("lora-per-task")
    runner.run(p, progress=False, log=lambda m: None)
    seeds = {r: results.read_record(p.record_path(r))["train_info"]["per_seed"] for r in p.rows}
    held = list(p.suite.held_out)
    route = suite_tasks.held_out_routes(p.suite, "held-out", "nearest")
    assert all(route[h] < 4 for h in held)
    for own, near in zip(seeds["lora-per-task"], seeds["nearest-task"]):
        R_own, R_near = own["stage_task_mse"][-1], near["stage_task_mse"][-1]
        assert R_own[:4] == R_near[:4]  # trained tasks: bit for bit
        assert [R_own[h] for h in held] == [own["initial_task_mse"][h] for h in held]
        assert all(R_near[h] != R_own[h] for h in held)
    assert cli.main(["report", str(tmp_path / "r"), "--out", str(tmp_path / "out"), "--format", "md,csv",
                     "--no-figures"]) == 0  # fmt: skip
    capsys.readouterr()
    folder = tmp_path / "out" / "heldout" / "deep-narrow" / "smoke" / "held-out-n50"
    table = pd.read_csv(folder / "table.csv")
    assert set(table["method"]) == {"lora-per-task", "nearest-task"} and (table["per task"] == 50).all()
    assert "### Held-out tasks: param-sin-cos-T-n50, held-out" in (folder / "table.md").read_text()
    assert not (tmp_path / "out" / "heldout" / "deep-narrow" / "smoke" / "held-out").exists()
