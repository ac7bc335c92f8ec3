"""One engine for every method: pretrain a stack of backbones on the source, adapt it to the target, evaluate.

A run trains E members at once (seeds, or functions x seeds), each with its own data, data order, initialisation
and metrics; their parameters are stacked on a leading dimension and one batched forward/backward serves them all.
The per-member loss is the member's own batch mean and the stack minimises their sum, so each member receives
exactly the gradient it would get alone (a stacked run equals E separate runs; tests/test_engine.py checks it).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from qlbench import adapters, gradients, results, suites, zoo
from qlbench.adapters.base import adamw
from qlbench.backbones import build_backbone
from qlbench.seeding import generator
from qlbench.store import DamagedFile, Store, load_torch, save_torch, set_aside, stable_hash


@dataclass(frozen=True)
class Phase:
    """One optimisation phase: AdamW-style hyper-parameters and the epoch count."""

    epochs: int
    lr: float
    batch_size: int = 64
    weight_decay: float = 0.01  # AdamW's default (the paper does not state one)


@dataclass(frozen=True)
class Budget:
    name: str
    seeds: int
    pretrain: Phase
    adapt: Phase
    eval_every: int  # epochs between evaluations of train and test MSE (the best-epoch metrics use these)


# The paper's protocol: pretrain 300 epochs at lr 3e-3, adapt 5,000 epochs at lr 5e-4, batch 64, 5 seeds.
_PAPER = Budget("paper", 5, Phase(300, 3e-3), Phase(5000, 5e-4), eval_every=10)
BUDGETS: dict[str, dict[str, Budget]] = {
    "deep-narrow": {
        "paper": _PAPER,
        "quick": Budget("quick", 3, Phase(100, 3e-3), Phase(400, 5e-4), eval_every=10),
        "smoke": Budget("smoke", 2, Phase(3, 3e-3), Phase(4, 5e-4), eval_every=2),
    },
    "transformer": {
        "paper": _PAPER,
        "quick": Budget("quick", 2, Phase(10, 3e-3), Phase(20, 5e-4), eval_every=5),
        "smoke": Budget("smoke", 2, Phase(1, 3e-3), Phase(2, 5e-4), eval_every=1),
    },
}


def budget(name: str, arch: str) -> Budget:
    if arch not in BUDGETS:
        raise ValueError(f"unknown arch {arch!r}; valid: {', '.join(BUDGETS)}")
    if name not in BUDGETS[arch]:
        raise ValueError(f"unknown budget {name!r}; valid: {', '.join(BUDGETS[arch])}")
    return BUDGETS[arch][name]


def resolve_device(device: str, cuda: bool | None = None) -> torch.device:
    """'auto' -> CUDA when present, else CPU; 'cpu' and 'cuda[:i]' as given. `cuda`: whether the machines that
    train have CUDA (None: this one; the Ray executor passes whether its cluster has GPUs)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if device == "auto":
        return torch.device("cuda" if cuda else "cpu")
    if device.startswith("cuda") and not cuda:
        raise ValueError(f"device {device!r} requested but CUDA is not available; valid: auto, cpu")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"unknown device {device!r}; valid: auto, cpu, cuda")
    return torch.device(device)


def check_threads(threads) -> None:
    """A user's intra-op thread count for work on this machine: None (the default) or an integer from 1 to the cores
    present (ValueError otherwise; the commands check it before any work, a Ray sweep against its largest node).
    More threads than cores oversubscribe the machine: 999 once drove a 2-core machine's load to 170."""
    cores = os.cpu_count() or 1
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= cores):
        raise ValueError(f"threads must be an integer from 1 to {cores} (the cores present), got {threads!r}")


def auto_threads(arch: str, members: int, requested: int | None = None) -> int | None:
    """Intra-op threads for a stack: `requested` if given (a user's --threads), else one for the deep-narrow MLP
    below 16 members, else PyTorch's default (None).

    Its 32-wide layers at batch 64 are too small to split across cores, and a second thread stalls whenever another
    process holds a core; from about 16 members, and for the Transformer, more threads help (docs/speed.md).
    """
    if requested is not None:
        return requested
    return 1 if arch == "deep-narrow" and members < 16 else None


def _denormals_flushed() -> bool:
    """Whether this thread flushes denormals (PyTorch has no getter: a denormal times one reads back as 0)."""
    return (torch.tensor([1e-39], dtype=torch.float32) * 1.0).item() == 0.0


@contextlib.contextmanager
def flush_denormals():
    """Flush denormal floats to zero on the CPU inside the block, then restore the previous setting.

    float32 training that drifts into denormals (tiny gradients of a deep MLP) runs several times slower
    otherwise. The engine's entry points (`pretrain`, `adapt`) and the benchmarks run inside it. PyTorch's switch
    is per thread, one more reason small stacks run on one thread."""
    before = _denormals_flushed()
    torch.set_flush_denormal(True)  # a no-op (returning False) on CPUs without the feature
    try:
        yield
    finally:
        if not before:
            torch.set_flush_denormal(False)


@contextlib.contextmanager
def num_threads(n: int | None):
    """Run a block with n intra-op threads (None: leave the setting as it is)."""
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


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


def compiled(model: nn.Module) -> nn.Module:
    """torch.compile for the training forward: CUDA graphs ("reduce-overhead") on a GPU, Inductor's default on CPU.

    It shares the model's parameters; evaluation keeps calling the eager model (its batch shapes vary). Whether
    `--compile auto` uses it depends on the device and budget (`compile_by_default`). `qlbench bench` also times
    no-grad forwards through it. Call it before the first call of anything compiled earlier: the reset below drops
    compiled code (which then recompiles on its next call).
    """
    on_cuda = next(model.parameters()).device.type == "cuda"
    # a fresh in-process cache per training run: every method's model re-enters the same forward code, and past
    # torch._dynamo's recompile limit (8 per code object) a sweep's later methods would silently run eager. The
    # on-disk Inductor cache survives the reset, so a model seen before still compiles in seconds.
    torch._dynamo.reset()
    return torch.compile(model, mode="reduce-overhead" if on_cuda else None, dynamic=False)


# Budgets whose training step `--compile auto` compiles, per device type. On CPU the measured cold warm-up (about 16 s
# for LoRA, 57 s for Queryable LoRA on the deep-narrow stack; seconds when Inductor's cache is warm) is repaid only by
# the paper budget's 35,000 steps per member, not by a quick run's 2,800 (docs/speed.md). On CUDA, where CUDA graphs
# remove per-kernel launch cost, every budget but smoke (seconds long, where the warm-up would dominate); not
# measured on this project's machines, which have no GPU.
COMPILE_BUDGETS = {"cpu": ("paper",), "cuda": ("paper", "quick")}


def compile_by_default(device: torch.device, budget_name: str) -> bool:
    """Whether `--compile auto` compiles the training step for this device and budget (COMPILE_BUDGETS)."""
    return budget_name in COMPILE_BUDGETS.get(torch.device(device).type, ())


def make_step(
    model: nn.Module, optimizer, instruction: torch.Tensor | None = None, *, compile: bool = False
) -> Callable:
    """The training step every method and the benchmarks run: step(xb (E, b, 2), yb (E, b)) -> loss (E,).

    Each member's loss is its own batch mean and the stack minimises their sum, so member e's gradient is the one
    it would get alone. `step(xb, yb, inspect)` calls inspect() after backward and before the optimizer step (the
    gradients are in .grad; outside the compiled forward), e.g. to record gradient norms. `step(..., task=tb)`
    passes each sample's task index tb (E, b) in a multi-task suite.
    """
    forward = compiled(model) if compile else model

    def step(
        xb: torch.Tensor,
        yb: torch.Tensor,
        inspect: Callable[[], None] | None = None,
        task: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = forward(xb, instruction) if task is None else forward(xb, instruction, task=task)
        loss = (out - yb).pow(2).mean(dim=1)  # (E,)
        loss.sum().backward()
        if inspect is not None:
            inspect()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def fit(
    model: nn.Module,
    optimizer,
    data: StackedData,
    phase: Phase,
    eval_every: int,
    order: list[torch.Generator],
    *,
    instruction: torch.Tensor | None = None,
    progress: Callable[[int], None] | None = None,
    compile: bool = False,
    diagnose: Callable[[], tuple[torch.Tensor, torch.Tensor | None]] | None = None,
) -> Curves:
    """Minibatch training of a stack: member e shuffles its own data with order[e] every epoch.

    `diagnose()` (gradients.grad_norms over the model's groups), if given, is called after backward of the last
    step of every evaluated epoch > 0 and its (E, L) per-layer and (E,) shared gradient norms are returned in the
    curves; it only reads .grad, so the training numbers are the same with or without it.

    Evaluates train and test MSE before training and every `eval_every` epochs (and after the last). A member is
    marked diverged at the first evaluation where its loss or metrics are non-finite or its train or test MSE
    exceeds DIVERGENCE_FACTOR times the larger of its epoch-0 train MSE and its label variance; it keeps its slot
    (the stack's shapes do not change) but its metrics from then on are NaN, and no other member is affected (no op
    mixes members).
    """
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

    def record(epoch: int) -> None:
        model.eval()
        tr = evaluate(model, data.x_train, data.y_train, instruction, task=data.task_train)
        te = evaluate(model, data.x_test, data.y_test, instruction, task=data.task_test)
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

    step = make_step(model, optimizer, instruction, compile=compile)
    grads: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    model.train()
    record(0)
    for epoch in range(1, phase.epochs + 1):
        perm = torch.stack([torch.randperm(N, generator=g) for g in order]).to(device)  # (E, N)
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
    curves = Curves(epochs, torch.stack(train_hist, 1).cpu(), torch.stack(test_hist, 1).cpu(), diverged)
    if grads:
        curves.grad_epochs = epochs[1:]
        dead = torch.tensor([[d is not None and d <= t for t in epochs[1:]] for d in diverged])  # (E, T)
        curves.grad_layers = torch.stack([g for g, _ in grads], 1).masked_fill(dead.unsqueeze(-1), torch.nan)
        if grads[0][1] is not None:
            curves.grad_shared = torch.stack([s for _, s in grads], 1).masked_fill(dead, torch.nan)
    return curves


def steps(phase: Phase, n_train: int) -> int:
    """Optimizer steps in a phase (for progress bars)."""
    return phase.epochs * -(-n_train // phase.batch_size)


# ---------------------------------------------------------------------------------------------------------------
# Pretraining, with an on-disk cache shared by every method (and every stacking) of the same members.


@dataclass
class Pretrained:
    """A stack of source-pretrained backbones: the stacked state and each member's source metrics."""

    arch: str
    members: list[Member]
    state: dict[str, torch.Tensor]  # stacked state_dict, CPU
    source_train_mse: list[float]
    source_test_mse: list[float]
    # the code each member's backbone was trained by ({commit, dirty}; None: a cache file written before it was
    # recorded). The cache is keyed by settings, not by code, so a record states which code made its backbones.
    git: list[dict | None] = field(default_factory=list)

    def select(self, members: list[Member]) -> Pretrained:
        """The sub-stack of the given members."""
        idx = [self.members.index(m) for m in members]
        return Pretrained(
            self.arch,
            list(members),
            {k: v[idx] for k, v in self.state.items()},
            [self.source_train_mse[i] for i in idx],
            [self.source_test_mse[i] for i in idx],
            [self.git[i] for i in idx] if self.git else [],
        )

    def commits(self) -> list[str]:
        """The distinct commits that trained these backbones, "unknown" for a cache file without one and a
        "+dirty" suffix for a dirty tree (records' run_info.settings.backbone_commits)."""
        names = {
            "unknown" if not g or not g.get("commit") else g["commit"] + ("+dirty" if g.get("dirty") else "")
            for g in self.git or [None]
        }
        return sorted(names)

    def model(self, *, device, dtype) -> nn.Module:
        """A fresh copy of the pretrained stack (methods modify their backbone in place)."""
        model = build_backbone(self.arch, self.members, device=device, dtype=dtype)
        model.load_state_dict(self.state)
        return model


def _cache_paths(
    arch: str,
    members: list[Member],
    phase: Phase,
    dtype,
    store: Store | None,
    init: str = "default",
    noise: str = zoo.DEFAULT_NOISE,
    suite: bool = False,
) -> list[Path | None]:
    """Cache files keyed by everything the weights depend on; a non-default backbone init and a label noise other
    than the legacy one join the key (so the caches written before either setting existed keep their keys); a
    suite's backbone (members (suite card, seed), suites.py) is keyed as one."""
    if store is None:
        return [None] * len(members)
    extra = {} if init == "default" else {"init": init}
    extra |= {} if noise == zoo.LEGACY_NOISE else {"noise": noise}
    extra |= {"suite_source": True} if suite else {}
    return [
        store.backbone_path(
            arch, f, s, stable_hash(dict(arch=arch, function=f, seed=s, phase=asdict(phase), dtype=str(dtype)) | extra)
        )
        for f, s in members
    ]


def pretrain_needed(
    arch: str,
    members: list[Member],
    phase: Phase,
    dtype,
    store: Store | None,
    init: str = "default",
    noise: str = zoo.DEFAULT_NOISE,
    suite: bool = False,
) -> bool:
    """Whether `pretrain` will train anything (some member is not in the cache)."""
    paths = _cache_paths(arch, members, phase, dtype, store, init, noise, suite)
    return any(p is None or not p.exists() for p in paths)


@functools.cache
def _member_shapes(arch: str) -> dict[str, tuple[int, ...]]:
    """One member's weight names and shapes, from a shapes-only build on the meta device (they do not depend on
    the init), computed once per arch."""
    meta = build_backbone(arch, [("shape", 0)], device="meta").state_dict()
    return {k: tuple(v.shape[1:]) for k, v in meta.items()}


def _read_backbone(path: Path, arch: str) -> dict:
    """A cached member, checked by content: DamagedFile (one line) unless it holds a state with exactly the
    backbone's weight names and per-member shapes (from a shapes-only build on the meta device) and its two source
    MSEs as numbers."""
    saved = load_torch(path)
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
        raise DamagedFile(f"{path} is damaged (not a backbone file: no state)")
    want = _member_shapes(arch)
    got = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in saved["state"].items()}
    if wrong := sorted(set(want) ^ set(got)) or [k for k in want if got[k] != want[k]]:
        raise DamagedFile(f"{path} is damaged ({wrong[0]}: not the {arch} backbone's weights)")
    if not all(isinstance(saved.get(k), float) for k in ("source_train_mse", "source_test_mse")):
        raise DamagedFile(f"{path} is damaged (no source MSEs)")
    return saved


@flush_denormals()
def pretrain(
    arch: str,
    members: list[Member],
    phase: Phase,
    *,
    device,
    dtype=torch.float32,
    store: Store | None = None,
    progress: Callable[[int], None] | None = None,
    compile: bool = False,
    log: Callable[[str], None] = lambda message: None,
    init: str = "default",
    noise: str = zoo.DEFAULT_NOISE,
    suite: bool = False,
) -> Pretrained:
    """Source-pretrained backbones for `members`. Members found in the store's backbone cache are loaded; the
    rest are trained together and cached one file per member, so any later stacking of the same members reuses
    them. A damaged cache file is reported through `log`, set aside and retrained. `init`: the backbone
    initialisation (backbones.INITS); `noise`: the source labels' noise (zoo.NOISES); both part of the cache key.
    `suite`: the members are (suite card, seed) and train on the suite's standardised source (suites.py)."""
    paths = _cache_paths(arch, members, phase, dtype, store, init, noise, suite)
    cached = {}
    for i, path in enumerate(paths):
        if path is not None and path.exists():
            try:
                cached[i] = _read_backbone(path, arch)
            except DamagedFile as err:
                log(f"{err}; {set_aside(path)}, retraining that backbone")
    todo = [i for i in range(len(members)) if i not in cached]
    if todo:
        sub = padded([members[i] for i in todo])  # trained as a stack of at least MIN_STACK
        model = build_backbone(arch, sub, device=device, dtype=dtype, init=init)
        if suite:
            data = StackedData.stack([suites.get(n).source_data(s, dtype=dtype, device=device) for n, s in sub])
        else:
            data = StackedData.build(sub, "source", device=device, dtype=dtype, noise=noise)
        optimizer = adamw(model.parameters(), phase.lr, phase.weight_decay)
        order = [generator("order", "pretrain", arch, f, s) for f, s in sub]
        curves = fit(
            model, optimizer, data, phase, eval_every=phase.epochs, order=order, progress=progress, compile=compile
        )
        state = model.state_dict()
        for j, i in enumerate(todo):
            cached[i] = dict(
                state={k: v[j].detach().cpu().clone() for k, v in state.items()},
                source_train_mse=curves.train_mse[j, -1].item(),
                source_test_mse=curves.test_mse[j, -1].item(),
                git=results.git_info(),  # which code trained it (the cache key does not say)
            )
            if paths[i] is not None:
                save_torch(cached[i], paths[i])
    state = {k: torch.stack([cached[i]["state"][k] for i in range(len(members))]) for k in cached[0]["state"]}
    return Pretrained(
        arch,
        list(members),
        state,
        [cached[i]["source_train_mse"] for i in range(len(members))],
        [cached[i]["source_test_mse"] for i in range(len(members))],
        [cached[i].get("git") for i in range(len(members))],
    )


# ---------------------------------------------------------------------------------------------------------------


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


@flush_denormals()
def adapt(
    pretrained: Pretrained,
    method_name: str,
    config,
    budget: Budget,
    *,
    device,
    dtype=torch.float32,
    progress: Callable[[int], None] | None = None,
    compile: bool = False,
    diagnostics: bool = True,
    eps: float = adapters.EPS,
    noise: str = zoo.DEFAULT_NOISE,
) -> AdaptResult:
    """Build `method` on a fresh copy of the pretrained stack and adapt every member to its target; with
    `diagnostics`, record per-layer gradient norms at the evaluation cadence (gradients.py). `eps`: the optimiser's
    epsilon (AdamW's, or SOAP's for full-soap); `noise`: the target labels' noise (zoo.NOISES)."""
    method = adapters.get(method_name)
    arch, members = pretrained.arch, pretrained.members
    t0 = time.perf_counter()
    if len(members) < MIN_STACK:  # trained as a stack of at least MIN_STACK (select copies the stacked state)
        pretrained = pretrained.select(padded(members))
    model, data = build_model(pretrained, method_name, config, device=device, dtype=dtype, noise=noise)
    if method.trains:
        optimizer = method.optimizer(model, config, budget.adapt.lr, budget.adapt.weight_decay, eps)
        order = [generator("order", "adapt", arch, f, s) for f, s in pretrained.members]
        diagnose = None
        if diagnostics:
            groups = gradients.param_groups(model)
            diagnose = lambda: gradients.grad_norms(groups)
        curves = fit(
            model,
            optimizer,
            data,
            budget.adapt,
            budget.eval_every,
            order,
            progress=progress,
            compile=compile,
            diagnose=diagnose,
        )
    else:
        tr = evaluate(model, data.x_train, data.y_train).cpu()
        te = evaluate(model, data.x_test, data.y_test).cpu()
        curves = Curves([0], tr.unsqueeze(1), te.unsqueeze(1), [None] * len(pretrained.members))
    wall_time_s = time.perf_counter() - t0
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
