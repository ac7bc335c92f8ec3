"""The training loop every stack runs: stacked data, the training step, `fit` over its stages, evaluation and curves.

A stack trains E members at once (seeds, or functions x seeds), each with its own data, data order, initialisation
and metrics; their parameters are stacked on a leading dimension and one batched forward/backward serves them all.
The per-member loss is the member's own batch mean and the stack minimises their sum, so each member receives
exactly the gradient it would get alone (a stacked run equals E separate runs; tests/test_engine.py checks it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from qlbench import zoo
from qlbench.engine.budgets import Phase
from qlbench.engine.runtime import compiled
from qlbench.engine.snapshot import Snapshots, trainable
from qlbench.engine.step import CapturedEvaluation, Step
from qlbench.engine.step import build as build_step

Member = tuple[str, int]  # (function name, seed)

# Stack independence. A member's numbers must not depend on what else is in its stack (a cell run alone, inside a
# sweep, in another Ray group or after a resume). Measured on CPU (float32, both backbones, every stack width from 2
# to 17, one and two threads): every per-member kernel gives the same bits at any width E >= 2, but at E = 1 a
# batched matmul with one output column (the regression head) takes a matrix-vector path whose last bits differ, and
# training amplifies them (a 1e-3 weight difference after one Transformer epoch). So no stack is narrower than
# MIN_STACK: a single member trains beside a copy of itself, whose results are dropped (twice the work, only for a
# one-member stack; docs/speed.md). tests/test_stack_independence.py checks every method.
MIN_STACK = 2


def padded(members: list[Member]) -> list[Member]:
    """`members`, with copies of the first appended up to MIN_STACK (the copies' results are dropped)."""
    return list(members) + [members[0]] * (MIN_STACK - len(members)) if members else list(members)


# qlbench interpretation of the paper's "inf": a member diverged when an evaluated MSE is non-finite or grows past
# this factor times the larger of its own epoch-0 train MSE (where every method starts) and the variance of its
# training labels (what predicting the mean scores). Relative, not the paper's absolute 1e5: the zoo's labels are
# in raw units whose MSE scales differ by orders of magnitude.
DIVERGENCE_FACTOR = 100.0


@dataclass
class StackedData:
    """Per-member datasets stacked on a leading dimension: x (E, N, 2), y (E, N); in a multi-task suite also each
    sample's task index, task (E, N) long (None: one task)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    task_train: torch.Tensor | None = None
    task_test: torch.Tensor | None = None

    @classmethod
    def build(cls, members: list[Member], which: str, *, device, dtype, noise: str = zoo.DEFAULT_NOISE) -> StackedData:
        """The members' "source" or "target" datasets, labels noised by the construction `noise` (zoo.NOISES)."""
        splits = [getattr(zoo.task(f, noise), f"{which}_data")(seed, dtype=dtype, device=device) for f, seed in members]
        return cls.stack(splits)

    @classmethod
    def stack(
        cls, splits: list[zoo.Split], tasks: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    ) -> StackedData:
        """One member per split; `tasks`: per member its (train, test) task indices (N,), or None."""
        data = [torch.stack([getattr(s, k) for s in splits]) for k in ("x_train", "y_train", "x_test", "y_test")]
        if tasks is not None:
            data += [torch.stack([t[i] for t in tasks]).to(data[0].device) for i in (0, 1)]
        return cls(*data)


@dataclass
class Curves:
    """Per-member evaluation history: train and test MSE (E, n_evals) at `epochs`, NaN after divergence."""

    epochs: list[int]
    train_mse: torch.Tensor
    test_mse: torch.Tensor
    diverged_epoch: list[int | None]  # first evaluated epoch at which the member was non-finite
    # gradient diagnostics (gradients.py), from the last step of each evaluated epoch > 0; NaN after divergence
    grad_epochs: list[int] = field(default_factory=list)
    grad_layers: torch.Tensor | None = None  # (E, n_grad_epochs, L) per-layer gradient norms
    grad_shared: torch.Tensor | None = None  # (E, n_grad_epochs) the shared parameters' norm (None: none)
    # a stage resumed from its snapshot (engine/snapshot.py): the epoch it was taken at, and the seconds the earlier
    # processes had trained until then (None, 0.0: trained in one go)
    resumed_epoch: int | None = None
    earlier_s: float = 0.0

    def first(self, n: int) -> Curves:
        """The curves of the first n members (drops a padded stack's copies)."""
        cut = lambda t: None if t is None else t[:n]
        return Curves(
            self.epochs,
            self.train_mse[:n],
            self.test_mse[:n],
            self.diverged_epoch[:n],
            self.grad_epochs,
            cut(self.grad_layers),
            cut(self.grad_shared),
            self.resumed_epoch,
            self.earlier_s,
        )

    def member_summary(self, e: int) -> dict:
        """Best train MSE, best test MSE (test-selected, as the paper reports) and the test MSE at the
        best-train epoch (selection that does not peek at the test set)."""
        tr, te = self.train_mse[e], self.test_mse[e]
        ok = torch.isfinite(tr) & torch.isfinite(te)
        if not ok.any():
            return dict(
                best_train_mse=None,
                best_train_epoch=None,
                best_test_mse=None,
                best_test_epoch=None,
                test_at_best_train=None,
            )
        idx = torch.nonzero(ok).squeeze(1)
        i_tr = idx[tr[idx].argmin()].item()
        i_te = idx[te[idx].argmin()].item()
        return dict(
            best_train_mse=tr[i_tr].item(),
            best_train_epoch=self.epochs[i_tr],
            best_test_mse=te[i_te].item(),
            best_test_epoch=self.epochs[i_te],
            test_at_best_train=te[i_tr].item(),
        )


@torch.no_grad()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, instruction=None, chunk: int = 1024, task=None
) -> torch.Tensor:
    """Per-member MSE (E,) of model on x (E, N, 2), y (E, N), in chunks of samples to bound memory; `task` (E, N)
    long: each sample's task in a suite (None: one task)."""
    return squared_errors(model, x, y, instruction, chunk, task).mean(dim=1)


@torch.no_grad()
def squared_errors(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, instruction=None, chunk: int = 1024, task=None
) -> torch.Tensor:
    """Per-sample squared errors (E, N) of model on x (E, N, 2), y (E, N), in chunks of samples."""
    cut = lambda t, i: None if t is None else t[:, i : i + chunk]
    return torch.cat(
        [
            (model(x[:, i : i + chunk], instruction, task=cut(task, i)) - y[:, i : i + chunk]).pow(2)
            for i in range(0, x.shape[1], chunk)
        ],
        dim=1,
    )


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
    epochs, train_hist, test_hist = [], [], []
    running = torch.zeros(E, device=device, dtype=data.y_train.dtype)
    rows = torch.arange(E, device=device).unsqueeze(1)
    n_batches = -(-N // phase.batch_size)

    # the scale divergence is measured against (E,): the larger of the epoch-0 train MSE and what predicting the
    # mean label scores (a model that starts near-perfect must not be called diverged for a small wobble)
    initial: list[torch.Tensor] = []
    on_train = lambda: evaluate(model, data.x_train, data.y_train, instruction, task=data.task_train)  # (E,)
    on_test = lambda: evaluate(model, data.x_test, data.y_test, instruction, task=data.task_test)  # (E,)
    captured = [CapturedEvaluation(fn, device) for fn in (on_train, on_test)] if step.captured else []
    if captured:  # recorded once per stage and replayed, as the step is (engine/step.py)
        on_train, on_test = captured

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

    grads: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    history = {"epochs": epochs, "train": train_hist, "test": test_hist, "diverged": diverged, "initial": initial,
               "grads": grads}  # fmt: skip
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
