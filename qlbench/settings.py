"""The two settings objects every plan takes whole, each validated once when it is made (ValueError naming the valid
choices):

    Protocol   what changes the numbers: the arch, the budget (and its adaptation learning rate), the seeds, the
               dtype, the optimiser's eps, the label noise, the backbone's init and whether a validation set is
               scored. Two runs under equal protocols (and equal methods) give equal records.
    Execution  what must not change them: the device, torch.compile, CUDA-graph capture, threads, stacks trained at
               once, snapshots, the results folder, --force, progress, and where the training machines are.

    protocol = Protocol(arch="deep-narrow", budget="smoke", seeds=2)
    plan = experiment.plan(functions=["matyas"], methods=["lora"], protocol=protocol, execution=Execution(out_dir=d))

The command line builds both from one declaration of each option (commands/options.py); their defaults are the
command line's defaults.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from qlbench import adapters, engine, zoo
from qlbench.backbones import ARCHS, DEFAULT_INIT, check_init

SWITCHES = ("auto", "on", "off")  # --compile and --capture
MAX_LR = 1.0  # an adaptation learning rate above it is a typo, not a setting

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def check_settings(*, eps=None, dtype: str | None = None, threads=None) -> None:
    """The optimiser's epsilon, the dtype and the thread count (those given), as every plan validates them
    (ValueError)."""
    bad_eps = isinstance(eps, bool) or not isinstance(eps, int | float) or not (math.isfinite(eps) and eps > 0)
    if eps is not None and bad_eps:
        raise ValueError(f"eps (the optimiser's epsilon) must be a finite number > 0, got {eps!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be an integer >= 1, got {threads!r}")


def check_snapshot_every(value) -> None:
    """ValueError (one line) unless `value` is None (no snapshots) or a finite number of seconds >= 0."""
    ok = value is None or (isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < math.inf)
    if not ok:
        raise ValueError(f"--snapshot-every must be a number of seconds >= 0, or off; got {value!r}")


def check_at_once(methods_at_once, compile: str) -> None:
    """ValueError naming the valid values unless `methods_at_once` is "auto" or an integer >= 1 that `compile`
    allows: torch.compile is not used with stacks trained at once (its caches are the process's, and each training
    run resets them)."""
    if methods_at_once == "auto":
        return
    if isinstance(methods_at_once, bool) or not isinstance(methods_at_once, int) or methods_at_once < 1:
        raise ValueError(f"methods at once must be an integer >= 1 or auto, got {methods_at_once!r}")
    if methods_at_once > 1 and compile == "on":
        raise ValueError(
            "--compile on trains one method at a time (torch.compile's caches are the process's); "
            "valid with --methods-at-once above 1: --compile auto or off"
        )


def seed_count(budget: engine.Budget, seeds: int | None) -> int:
    """The number of seeds: the budget's, or `seeds` (an integer >= 1; ValueError otherwise)."""
    n = budget.seeds if seeds is None else seeds
    if isinstance(n, bool) or not (isinstance(n, int) and n >= 1):
        raise ValueError(f"seeds must be an integer >= 1, got {n!r}")
    return n


@dataclass(frozen=True, kw_only=True)
class Protocol:
    """What changes the numbers. `budget`: a name of engine.BUDGETS[arch]; `seeds`: 0..seeds-1 (None: the budget's);
    `eps`: the adaptation optimiser's epsilon (a non-default value is part of a cell's config hash); `noise`:
    zoo.NOISES; `backbone_init`: backbones.INITS."""

    arch: str = "deep-narrow"
    budget: str = "quick"
    seeds: int | None = None
    dtype: str = "float32"
    eps: float = adapters.EPS
    noise: str = zoo.DEFAULT_NOISE
    backbone_init: str = DEFAULT_INIT
    lr: float | None = None  # the adaptation's learning rate (None: the budget's); part of the budget a record holds
    validation: bool = False  # evaluate the target's validation set too (zoo.Task.validation_data; single-task runs)

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; valid: {', '.join(ARCHS)}")
        check_init(self.arch, self.backbone_init)
        check_settings(eps=self.eps, dtype=self.dtype, threads=None)
        zoo.check_noise(self.noise)
        if self.lr is not None:
            if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not 0 < self.lr <= MAX_LR:
                raise ValueError(f"lr must be a number in (0, {MAX_LR:g}], got {self.lr!r}")
            object.__setattr__(self, "lr", float(self.lr))
        seed_count(self.schedule, self.seeds)
        object.__setattr__(self, "eps", float(self.eps))

    @property
    def schedule(self) -> engine.Budget:
        """The budget's epochs, learning rates and evaluation cadence for this arch (its adaptation at `lr` when
        given)."""
        b = engine.budget(self.budget, self.arch)
        return b if self.lr is None else dataclasses.replace(b, adapt=dataclasses.replace(b.adapt, lr=self.lr))

    @property
    def n_seeds(self) -> int:
        """How many seeds (0..n_seeds-1): `seeds`, or the budget's (checked before a plan builds anything of that
        size: a plan refuses more than the memory holds)."""
        return seed_count(self.schedule, self.seeds)

    @property
    def seed_list(self) -> list[int]:
        return list(range(self.n_seeds))


@dataclass(frozen=True, kw_only=True)
class Execution:
    """What must not change the numbers. `device`: auto (CUDA when present), cpu or cuda; `compile`, `capture`:
    SWITCHES (engine/runtime.py decides auto); `threads`: intra-op threads (None: engine.auto_threads);
    `methods_at_once`: methods' stacks trained at once, or "auto" (planning.resolve_at_once); `snapshot_every_s`:
    seconds between a stack's snapshots (0: each evaluation; None: none); `force`: re-run finished records; `cuda`:
    whether the machines that train have CUDA (None: this machine; a Ray cluster's plan says)."""

    device: str = "auto"
    compile: str = "auto"
    capture: str = "auto"
    threads: int | None = None
    methods_at_once: int | str = 1
    snapshot_every_s: float | None = engine.SNAPSHOT_EVERY_S
    out_dir: Path = Path("results")
    force: bool = False
    progress: bool = True
    cuda: bool | None = None

    def __post_init__(self):
        for name in ("compile", "capture"):
            if getattr(self, name) not in SWITCHES:
                raise ValueError(f"unknown {name} setting {getattr(self, name)!r}; valid: {', '.join(SWITCHES)}")
        check_settings(threads=self.threads)
        check_at_once(self.methods_at_once, self.compile)
        check_snapshot_every(self.snapshot_every_s)
        object.__setattr__(self, "out_dir", Path(self.out_dir))


DEFAULT_PROTOCOL = Protocol()  # the command line's defaults, as a plan's default argument
DEFAULT_EXECUTION = Execution()
