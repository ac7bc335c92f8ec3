"""The training loop every stack runs, and a method's adaptation through it: the step built (eager, compiled or
captured), `fit` over a stack's stages (pretraining, adaptation, suite stages and the real models all train through
it), a stage's snapshots, and `adapt`: a method built on a fresh copy of a pretrained stack and trained on every
member's target.

The per-member loss is the member's own batch mean and the stack minimises their sum, so each member receives
exactly the gradient it would get alone (a stacked run equals E separate runs; tests/test_engine.py checks it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from qlbench import adapters, gradients, zoo
from qlbench.engine.budgets import Budget, Phase
from qlbench.engine.rates import member_rates
from qlbench.engine.runtime import compiled, flush_denormals
from qlbench.engine.snapshot import Snapshots, trainable
from qlbench.engine.stack import DIVERGENCE_FACTOR, Curves, Member, Pretrained, StackedData, evaluate, padded
from qlbench.engine.step import CapturedEvaluation, Step
from qlbench.engine.step import build as build_step
from qlbench.seeding import generator


def make_step(
    model: nn.Module,
    optimizer,
    instruction: torch.Tensor | None = None,
    *,
    compile: bool = False,
    capture: bool = False,
    compile_update: bool | None = None,
) -> Step:
    """The training step every method and the benchmarks run: step(xb (E, b, 2), yb (E, b)) -> loss (E,) (`Step`),
    over the model's forward (`compile`: through torch.compile, and the optimiser's update too where that pays,
    unless `compile_update` is False), captured in a CUDA graph when `capture` (CUDA)."""
    update = compile if compile_update is None else compile_update
    return build_step(
        compiled(model) if compile else model, optimizer, instruction, capture=capture, compile_update=update
    )


@dataclass
class Stage:
    """One stretch of training of a stack: its data, its phase (epochs, learning rate, batch size), each member's
    data-order generator, and the optimiser, built by `optimizer()` when the stage starts (each stage starts a fresh
    one). Pretraining and a single-task adaptation are one stage; a sequential suite has one per task. `after()`, if
    given, is called once the stage has trained (a suite evaluates every task there)."""

    data: StackedData
    phase: Phase
    optimizer: Callable[[], torch.optim.Optimizer]
    order: list[torch.Generator]
    eval_every: int
    after: Callable[[], None] | None = None


def fit(
    model: nn.Module,
    stages: list[Stage],
    *,
    instruction: torch.Tensor | None = None,
    progress: Callable[[int], None] | None = None,
    compile: bool = False,
    diagnose: Callable[[], tuple[torch.Tensor, torch.Tensor | None]] | None = None,
    capture: bool = False,
    snapshots: Snapshots | None = None,
) -> list[Curves]:
    """The training loop of qlbench: train `model` through `stages` in order, one Curves per stage.

    Within a stage every member shuffles its own data with its order generator every epoch and trains on minibatches
    of the stage's batch size (the last one smaller), then calls the stage's `after()`. With `compile`, the forward is
    compiled once for all stages (and each stage's optimiser update where that pays, engine/step.py `updates_compile`);
    with `capture` (CUDA), each stage's step is recorded in a CUDA graph per batch shape and replayed (engine/step.py).
    `snapshots` (a fit of one stage): its training state is saved at evaluation epochs, and a snapshot of the same
    key left by a stopped run is restored before the first step (engine/snapshot.py).

    Nothing inside an epoch waits for the device: each epoch's order is drawn by the members' own generators on the
    host (qlbench interpretation of "drawn on the device": the same draw as on CPU, so a CUDA run trains on the
    very order a CPU run does and the two agree to rounding) and copied to the device without blocking; the running
    loss stays on the device; divergence checks and metrics are read back at evaluation epochs only.

    `diagnose()` (gradients.grad_norms over the model's groups), if given, is called after backward of the last
    step of every evaluated epoch > 0 and its (E, L) per-layer and (E,) shared gradient norms are returned in the
    curves; it only reads .grad, so the training numbers are the same with or without it.

    Evaluates train and test MSE before training and every `eval_every` epochs (and after the last). A member is
    marked diverged at the first evaluation where its loss or metrics are non-finite or its train or test MSE
    exceeds DIVERGENCE_FACTOR times the larger of its epoch-0 train MSE and its label variance; it keeps its slot
    (the stack's shapes do not change) but its metrics from then on are NaN, and no other member is affected (no op
    mixes members).
    """
    if snapshots is not None and len(stages) != 1:
        raise ValueError(f"snapshots resume a fit of one stage, not of {len(stages)}")
    forward = compiled(model) if compile and stages else model
    curves = []
    for stage in stages:
        step = build_step(forward, stage.optimizer(), instruction, capture=capture, compile_update=compile)
        curves.append(_train(model, step, stage, instruction, progress, diagnose, snapshots))
        step.close()
        if stage.after is not None:
            stage.after()
    return curves


def _train(model: nn.Module, step: Step, stage: Stage, instruction, progress, diagnose, snapshots) -> Curves:
    """One stage of `fit`: its epochs of minibatch steps, with evaluations at its cadence (and snapshots)."""
    data, phase, order, eval_every = stage.data, stage.phase, stage.order, stage.eval_every
    E, N = data.y_train.shape
    device = data.y_train.device
    diverged: list[int | None] = [None] * E
    epochs, train_hist, test_hist, val_hist = [], [], [], []
    running = torch.zeros(E, device=device, dtype=data.y_train.dtype)
    rows = torch.arange(E, device=device).unsqueeze(1)
    n_batches = -(-N // phase.batch_size)

    # the scale divergence is measured against (E,): the larger of the epoch-0 train MSE and what predicting the
    # mean label scores (a model that starts near-perfect must not be called diverged for a small wobble)
    initial: list[torch.Tensor] = []
    on_train = lambda: evaluate(model, data.x_train, data.y_train, instruction, task=data.task_train)  # (E,)
    on_test = lambda: evaluate(model, data.x_test, data.y_test, instruction, task=data.task_test)  # (E,)
    on_val = None if data.x_val is None else lambda: evaluate(model, data.x_val, data.y_val, instruction)  # (E,)
    captured = [CapturedEvaluation(fn, device) for fn in (on_train, on_test, on_val) if fn] if step.captured else []
    if captured:  # recorded once per stage and replayed, as the step is (engine/step.py)
        on_train, on_test, on_val = (captured + [None])[:3]

    def record(epoch: int) -> None:
        model.eval()
        tr, te = on_train(), on_test()
        model.train()
        if not initial:
            initial.append(torch.maximum(tr, data.y_train.var(dim=1, unbiased=False)))
        bad = ~(torch.isfinite(tr) & torch.isfinite(te) & torch.isfinite(running))
        bad |= (tr > DIVERGENCE_FACTOR * initial[0]) | (te > DIVERGENCE_FACTOR * initial[0])
        for e in torch.nonzero(bad).flatten().tolist():
            diverged[e] = epoch if diverged[e] is None else diverged[e]
        dead = torch.tensor([d is not None for d in diverged], device=device)
        epochs.append(epoch)
        train_hist.append(torch.where(dead, torch.nan, tr))
        test_hist.append(torch.where(dead, torch.nan, te))
        if on_val is not None:  # reported, not watched for divergence (train and test are)
            val_hist.append(torch.where(dead, torch.nan, on_val()))

    grads: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    history = {"epochs": epochs, "train": train_hist, "test": test_hist, "diverged": diverged, "initial": initial,
               "grads": grads, "val": val_hist}  # fmt: skip
    t0, start, earlier_s = time.perf_counter(), 0, 0.0
    model.train()
    snap = None if snapshots is None else snapshots.load(device)
    if snap is not None and (why := _fits(snap, model, order)) is not None:
        snap = snapshots.reject(why)
    if snap is not None:
        start, earlier_s = _restore(snap, model, step.optimizer, order, history)
        snapshots.log(f"resumed at epoch {start} of {phase.epochs} from {snapshots.path}")
        if progress is not None:
            progress(n_batches * start)
    else:
        record(0)
    if snapshots is not None:
        snapshots.start()
    for epoch in range(start + 1, phase.epochs + 1):
        perm = torch.stack([torch.randperm(N, generator=g) for g in order])  # (E, N), on the host
        perm = perm.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else perm.to(device)
        xs, ys = data.x_train[rows, perm], data.y_train[rows, perm]  # this epoch's order, (E, N, 2), (E, N)
        ts = None if data.task_train is None else data.task_train[rows, perm]  # (E, N)
        evaluated = epoch % eval_every == 0 or epoch == phase.epochs
        for i in range(0, N, phase.batch_size):
            last = evaluated and diagnose is not None and i + phase.batch_size >= N
            inspect = (lambda: grads.append(diagnose())) if last else None
            batch = slice(i, i + phase.batch_size)
            tb = None if ts is None else ts[:, batch]
            running += step(xs[:, batch], ys[:, batch], inspect, task=tb)  # (E, b, 2)
        if progress is not None:
            progress(n_batches)
        if evaluated:
            record(epoch)
            running.zero_()
            if snapshots is not None and epoch < phase.epochs and snapshots.due():
                elapsed = earlier_s + time.perf_counter() - t0
                snapshots.save(training_state(epoch, elapsed, model, step.optimizer, order, history))
    for evaluation in captured:
        evaluation.close()
    curves = Curves(epochs, torch.stack(train_hist, 1).cpu(), torch.stack(test_hist, 1).cpu(), diverged)
    if val_hist:
        curves.val_mse = torch.stack(val_hist, 1).cpu()
    if start:
        curves.resumed_epoch, curves.earlier_s = start, earlier_s
    if grads:
        curves.grad_epochs = epochs[1:]
        dead = torch.tensor([[d is not None and d <= t for t in epochs[1:]] for d in diverged])  # (E, T)
        curves.grad_layers = torch.stack([g for g, _ in grads], 1).masked_fill(dead.unsqueeze(-1), torch.nan)
        if grads[0][1] is not None:
            curves.grad_shared = torch.stack([s for _, s in grads], 1).masked_fill(dead, torch.nan)
    return curves


def training_state(epoch: int, elapsed_s: float, model: nn.Module, optimizer, order, history: dict) -> dict:
    """What a snapshot holds after evaluation epoch `epoch` (the running loss is zero there): the trainable
    parameters, the optimiser's state, each member's data-order generator and the stage's history so far."""
    return {
        "epoch": epoch,
        "elapsed_s": elapsed_s,
        "params": trainable(model),
        "optimizer": optimizer.state_dict(),
        "order": [g.get_state() for g in order],
        "history": history,
    }


def _fits(snap: dict, model: nn.Module, order) -> str | None:
    """What keeps a snapshot (of the stage's key) from being this stage's, checked before anything is restored: its
    parameters' names and shapes, and one generator per member; None when it fits."""
    params, saved = trainable(model), snap.get("params", {})
    if saved.keys() != params.keys():
        return f"its parameters ({len(saved)}) are not the model's ({len(params)})"
    if bad := [n for n, p in params.items() if saved[n].shape != p.shape]:
        return f"its {bad[0]} is {tuple(saved[bad[0]].shape)}, not {tuple(params[bad[0]].shape)}"
    if len(snap.get("order", [])) != len(order):
        return f"it holds {len(snap.get('order', []))} members' data orders, not {len(order)}"
    return None


def _restore(snap: dict, model: nn.Module, optimizer, order, history: dict) -> tuple[int, float]:
    """Put a snapshot's state back (`training_state`), in place; returns its epoch and the seconds trained by
    then."""
    params = trainable(model)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(snap["params"][name])
    optimizer.load_state_dict(snap["optimizer"])
    for g, state in zip(order, snap["order"], strict=True):
        g.set_state(state.cpu())
    for key, value in snap["history"].items():
        history[key][:] = value
    return snap["epoch"], snap["elapsed_s"]


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
    pretrained: Pretrained,
    method_name: str,
    config,
    *,
    device,
    dtype,
    noise: str = zoo.DEFAULT_NOISE,
    validation: bool = False,
) -> tuple[nn.Module, StackedData]:
    """`method` built on a fresh copy of the pretrained stack (member e's new parameters seeded by its function
    and seed, its instruction bound when the method routes on one), and the members' target data (labels noised
    by `noise`, zoo.NOISES; with `validation`, their validation sets too)."""
    arch, members = pretrained.arch, pretrained.members
    data = StackedData.build(members, "target", device=device, dtype=dtype, noise=noise, validation=validation)
    method = adapters.get(method_name)
    init = [generator("init", method.init_stream(), arch, f, s) for f, s in members]
    model = method.build(pretrained.model(device=device, dtype=dtype), config, init, data.y_train)
    method.bind(model, members, config)
    return model, data


@dataclass(frozen=True)
class Adaptation:
    """What a stack is adapted with: the method and its config, the budget (its adapt phase and evaluation cadence),
    the optimiser's epsilon (AdamW's, or SOAP's for full-soap), the target labels' noise (zoo.NOISES) and whether
    each evaluation scores the target's validation set too (a learning rate is chosen on it)."""

    method: str
    config: object
    budget: Budget
    eps: float = adapters.EPS
    noise: str = zoo.DEFAULT_NOISE
    validation: bool = False
    lrs: tuple[float, ...] | None = None  # member e's learning rate (engine/rates.py); None: the budget's for all

    def rates(self, members: int, stacked: int) -> list[float]:
        """The learning rate of each of `stacked` members: `members` members padded to `stacked` by copies of the
        first (engine.padded), which take its rate."""
        lrs = list(self.lrs) if self.lrs is not None else [self.budget.adapt.lr] * members
        if len(lrs) != members:
            raise ValueError(f"{len(lrs)} learning rates for a stack of {members} members")
        return lrs + [lrs[0]] * (stacked - members)


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
    model, data = build_model(
        pretrained, method_name, config, device=device, dtype=dtype, noise=noise, validation=adaptation.validation
    )
    if prepare is not None:
        prepare(model)
    if method.trains:
        build = lambda lr: method.optimizer(model, config, lr, budget.adapt.weight_decay, eps)
        optimizer = lambda: member_rates(build, adaptation.rates(len(members), len(pretrained.members)))
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
        if data.x_val is not None:
            curves.val_mse = evaluate(model, data.x_val, data.y_val).cpu().unsqueeze(1)
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
