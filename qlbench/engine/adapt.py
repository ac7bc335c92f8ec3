"""Adaptation: a method built on a fresh copy of a pretrained stack, trained on every member's target, evaluated."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from qlbench import adapters, gradients, zoo
from qlbench.engine.budgets import Budget
from qlbench.engine.cache import Pretrained
from qlbench.engine.loop import Curves, Member, StackedData, Stage, evaluate, fit, padded
from qlbench.engine.runtime import flush_denormals
from qlbench.engine.snapshot import Snapshots
from qlbench.seeding import generator


@dataclass
class AdaptResult:
    """What one stacked adaptation produced, per member."""

    members: list[Member]
    curves: Curves
    trainable_params: int
    total_params: int
    wall_time_s: float
    model: nn.Module  # the adapted stack, final state (members first; a padded stack's copies after them)
    source_test_mse_after: list[float]  # each member's source-task test MSE after adaptation, final state


def build_model(
    pretrained: Pretrained, method_name: str, config, *, device, dtype, noise: str = zoo.DEFAULT_NOISE
) -> tuple[nn.Module, StackedData]:
    """`method` built on a fresh copy of the pretrained stack (member e's new parameters seeded by its function
    and seed, its instruction bound when the method routes on one), and the members' target data (labels noised
    by `noise`, zoo.NOISES)."""
    arch, members = pretrained.arch, pretrained.members
    data = StackedData.build(members, "target", device=device, dtype=dtype, noise=noise)
    init = [generator("init", method_name, arch, f, s) for f, s in members]
    method = adapters.get(method_name)
    model = method.build(pretrained.model(device=device, dtype=dtype), config, init, data.y_train)
    method.bind(model, members, config)
    return model, data


@dataclass(frozen=True)
class Adaptation:
    """What a stack is adapted with: the method and its config, the budget (its adapt phase and evaluation cadence),
    the optimiser's epsilon (AdamW's, or SOAP's for full-soap) and the target labels' noise (zoo.NOISES)."""

    method: str
    config: object
    budget: Budget
    eps: float = adapters.EPS
    noise: str = zoo.DEFAULT_NOISE


@dataclass(frozen=True)
class Runtime:
    """Where and how the step runs: the device, the dtype, and whether the step is compiled or captured in CUDA
    graphs (engine.fit)."""

    device: torch.device | str
    dtype: torch.dtype = torch.float32
    compile: bool = False
    capture: bool = False


@flush_denormals()
def adapt(
    pretrained: Pretrained,
    adaptation: Adaptation,
    runtime: Runtime,
    *,
    progress: Callable[[int], None] | None = None,
    diagnostics: bool = True,
    prepare: Callable[[nn.Module], None] | None = None,
    snapshots: Snapshots | None = None,
) -> AdaptResult:
    """Build the adaptation's method on a fresh copy of the pretrained stack and adapt every member to its target;
    with `diagnostics`, record per-layer gradient norms at the evaluation cadence (gradients.py). `prepare(model)`,
    if given, is called on the built stack before any training (a stacked Pareto grid sets each member's k there,
    qlbench/experiments/pareto_stack.py); `snapshots`: the training state saved as it goes, and a stopped run's
    restored (engine/snapshot.py). The wall time counts the earlier processes' training up to the snapshot resumed
    from."""
    method_name, config, budget = adaptation.method, adaptation.config, adaptation.budget
    eps, noise = adaptation.eps, adaptation.noise
    device, dtype, compile, capture = runtime.device, runtime.dtype, runtime.compile, runtime.capture
    method = adapters.get(method_name)
    arch, members = pretrained.arch, pretrained.members
    t0 = time.perf_counter()
    if len(padded(members)) > len(members):  # trained as a stack of at least MIN_STACK (select copies the state)
        pretrained = pretrained.select(padded(members))
    model, data = build_model(pretrained, method_name, config, device=device, dtype=dtype, noise=noise)
    if prepare is not None:
        prepare(model)
    if method.trains:
        optimizer = lambda: method.optimizer(model, config, budget.adapt.lr, budget.adapt.weight_decay, eps)
        order = [generator("order", "adapt", arch, f, s) for f, s in pretrained.members]
        diagnose = None
        if diagnostics:
            groups = gradients.param_groups(model)
            diagnose = lambda: gradients.grad_norms(groups)
        stage = Stage(data, budget.adapt, optimizer, order, budget.eval_every)
        (curves,) = fit(
            model, [stage], progress=progress, compile=compile, capture=capture, diagnose=diagnose, snapshots=snapshots
        )
    else:
        tr = evaluate(model, data.x_train, data.y_train).cpu()
        te = evaluate(model, data.x_test, data.y_test).cpu()
        finite = (torch.isfinite(tr) & torch.isfinite(te)).tolist()  # a non-finite score is a divergence, reported
        curves = Curves([0], tr.unsqueeze(1), te.unsqueeze(1), [None if ok else 0 for ok in finite])
    wall_time_s = time.perf_counter() - t0 + curves.earlier_s
    # how much of the source task the adaptation kept: the final model on the source test set (not timed)
    source = StackedData.build(pretrained.members, "source", device=device, dtype=dtype, noise=noise)
    source_after = evaluate(model, source.x_test, source.y_test).cpu()[: len(members)]
    return AdaptResult(
        members,
        curves.first(len(members)),
        adapters.trainable_parameter_count(model),
        adapters.total_parameter_count(model),
        wall_time_s,
        model,
        source_after.tolist(),
    )
