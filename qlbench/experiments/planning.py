"""Plan checks every workload's plan runs before any work: dtypes, settings, seeds, hyper-parameter overrides, a
shapes-only build of every method, and a memory estimate against what the device has. Each raises ValueError with
the valid choices (the commands turn it into one line and exit code 2)."""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import torch

from qlbench import adapters, engine, stacked, zoo
from qlbench.backbones import DEFAULT_INIT, build_backbone
from qlbench.records.store import check_writable
from qlbench.seeding import generator
from qlbench.settings import DTYPES

FLOAT32_EPS_FLOOR = 1e-20  # below it, in float32, Adam's v = g^2 underflows for the tiny gradients eps matters for


def caveats(plan) -> list[str]:
    """One-line warnings about valid but known-bad settings of a plan (a Plan or a multitask.SuitePlan: its dtype and
    eps), printed before any work (none for the defaults).

    float32 with eps below FLOAT32_EPS_FLOOR: the gradients such an eps is meant to stop swamping (about 1e-22 in the
    deep-narrow backbone's early layers) square to below float32's smallest normal (1.2e-38), which flush-denormal
    zeroes, so the step is about lr * m / eps and blows up (measured: every seed of LoRA, DoRA and Queryable LoRA
    diverged at eps 1e-30 on two functions, quick budget). Not refused: that divergence is itself a measurement."""
    out = []
    if plan.dtype == "float32" and plan.eps < FLOAT32_EPS_FLOOR:
        out.append(
            f"eps {plan.eps:g} in float32: a tiny gradient's square underflows and the step divides by eps, so "
            f"training is expected to diverge; use --dtype float64 for eps below {FLOAT32_EPS_FLOOR:g}"
        )
    return out


# Where `--methods-at-once auto` trains every method's stack at once: on CUDA, the backbones whose captured steps are
# bound by launching small kernels (on a data-centre GPU, deep-narrow's nine trained methods at the paper's 45
# members run x1.35 faster at once, its quick sweep and quick run take x0.74 and x0.61 of the time, records
# identical; measured: docs/speed.md). The Transformer's steps keep the device busy (92 to 98%), so it trains one
# stack at a time.
AT_ONCE_ARCHS = ("deep-narrow",)


def resolve_at_once(methods_at_once, arch: str, device: torch.device, methods: int, compile: str, local: bool) -> int:
    """How many methods' stacks train at once: an integer as given; "auto": all of them (`methods`) where the stacks
    train on this machine (`local`: not on Ray's workers), on CUDA, for an arch of AT_ONCE_ARCHS, and `compile` is
    not "on"; else 1 (the CPU's cores are already the stacks', and its numbers stay those of one at a time)."""
    if methods_at_once != "auto":
        return methods_at_once
    together = local and device.type == "cuda" and arch in AT_ONCE_ARCHS and compile != "on"
    return methods if together else 1


@dataclasses.dataclass(kw_only=True)
class Resolved:
    """What every plan (experiment.Plan, multitask.SuitePlan) resolves the same way from a Protocol and an
    Execution before any work: `resolve` makes it."""

    arch: str
    seeds: list[int]
    budget: engine.Budget
    device: torch.device
    dtype: str
    out_dir: Path
    capture: bool = False  # record the training step in CUDA graphs (engine/step.py; CUDA only; not hashed)
    threads: int | None = None  # intra-op threads; None: engine.auto_threads
    force: bool = False  # re-run units that already have a finished record of the same config
    backbone_init: str = DEFAULT_INIT  # backbones.INITS; hashed only when not the default
    eps: float = adapters.EPS  # the adaptation optimiser's epsilon; hashed only when not the default


def resolve(protocol, execution, device: torch.device, *, capture: str | None = None) -> dict:
    """The fields of Resolved from a settings.Protocol and a settings.Execution (settings.py imports this module's
    checks, so not annotated here) on `device` (`engine.resolve_device`; resolved first, for the memory checks that
    come before the seeds are listed): the results folder checked writable (ValueError in one line), capture
    resolved for the device from `capture` (default: the execution's)."""
    check_writable(Path(execution.out_dir))
    return dict(
        arch=protocol.arch,
        seeds=protocol.seed_list,
        budget=protocol.schedule,
        device=device,
        dtype=protocol.dtype,
        out_dir=Path(execution.out_dir),
        capture=engine.use_capture(execution.capture if capture is None else capture, device),
        threads=execution.threads,
        force=execution.force,
        backbone_init=protocol.backbone_init,
        eps=protocol.eps,
    )


def chosen(given: list[str] | None, default: list[str], valid: str) -> list[str]:
    """The methods (or rows) a plan trains: `given`, else `default`; ValueError when none is given or one is given
    twice (`valid` names the choices)."""
    names = list(default if given is None else given)
    if not names:
        raise ValueError(f"no method given; valid: {valid}")
    if len(set(names)) != len(names):
        raise ValueError(f"method listed twice in {','.join(names)}")
    return names


def make_config(unit: str, method: str, settings: dict) -> object:
    """`method`'s validated config from `settings`; ValueError naming the unit (a method or a suite's row)."""
    try:
        return adapters.get(method).make_config(**settings)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{unit}: {err}") from None


def check_overrides(overrides: dict | None, methods: list[str], reserved: dict[str, str] | None = None) -> dict:
    """Hyper-parameter overrides, each a field of at least one of the methods' configs; `reserved` maps a field
    that is not the user's to set to the reason (ValueError naming the valid ones otherwise)."""
    overrides, reserved = dict(overrides or {}), reserved or {}
    known = {f.name for m in methods for f in dataclasses.fields(adapters.get(m).config_cls)} - set(reserved)
    if taken := sorted(set(overrides) & set(reserved)):
        raise ValueError(f"{taken[0]} is {reserved[taken[0]]}, not a setting")
    if unknown := sorted(set(overrides) - known):
        raise ValueError(
            f"unknown hyper-parameter(s) {', '.join(unknown)} for methods {','.join(methods)}; "
            f"valid: {', '.join(sorted(known)) or 'none'}"
        )
    return overrides


def dry_build(arch: str, configs: dict[str, object]) -> dict[str, tuple[int, int]]:
    """Build every method on a one-member backbone on the meta device (shapes only, no memory, no arithmetic), so
    a config that cannot be built on this arch (targets it lacks, more blocks than layers ...) fails before any
    work, as a ValueError naming the method. Returns method -> (numbers held per member, of them trainable)."""
    backbone = build_backbone(arch, [("dry-build", 0)], device="meta")
    y = torch.zeros(1, 1, device="meta")
    sizes = {}
    for name, config in configs.items():
        try:
            with stacked.shapes_only():
                model = adapters.get(name).build(copy.deepcopy(backbone), config, [generator("dry-build", name)], y)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{name}: {err}") from None
        tensors = [*model.parameters(), *model.buffers()]
        sizes[name] = (sum(t.numel() for t in tensors), sum(p.numel() for p in model.parameters() if p.requires_grad))
    return sizes


DATA_PER_MEMBER = 2 * (zoo.SOURCE_SIZE + zoo.TARGET_SIZE) * 3  # numbers: source and target (x, y), with copies
MEMORY_FACTOR = 4  # a trainable number is held 4 times (weight, gradient, Adam's two moments)


def plan_bytes(sizes: dict[str, tuple[int, int]], members: int, dtype: str, tasks: int = 1) -> int:
    """A lower estimate of the memory one stacked method of a plan needs, for its largest method: every number the
    model holds, each trainable one MEMORY_FACTOR times, and the data of `tasks` tasks, for `members` members
    (activations and the allocator's overhead not counted)."""
    model = max(held + (MEMORY_FACTOR - 1) * trainable for held, trainable in sizes.values())
    per_member = model + DATA_PER_MEMBER * tasks
    return per_member * members * DTYPES[dtype].itemsize


def available_bytes(device: torch.device) -> int | None:
    """Memory a plan may use: free CUDA memory, or the CPU's available memory (/proc/meminfo's MemAvailable, else
    the physical memory); None when it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def cells_per_stack(
    sizes: dict[str, tuple[int, int]], per_cell: int, cells: int, dtype: str, device: torch.device
) -> int:
    """How many cells of `per_cell` members (a function's seeds) one stack may hold on this machine: all `cells` when
    they fit its memory (or it cannot be read), else as many as fit, so a plan wider than the memory trains in
    narrower stacks (a stack equals separate runs: the numbers do not change). ValueError (one line, the estimate
    and the limit) when not even one cell fits: refused before anything is allocated."""
    have = available_bytes(device)
    if have is None or plan_bytes(sizes, per_cell * cells, dtype) <= have:
        return cells
    check_memory(sizes, per_cell, dtype, device)  # one cell must fit
    return max(1, min(cells, have // plan_bytes(sizes, per_cell, dtype)))


def check_memory(
    sizes: dict[str, tuple[int, int]], members: int, dtype: str, device: torch.device, tasks: int = 1
) -> None:
    """ValueError (one line, the estimate and the limit) when a plan's largest stacked method cannot fit this
    machine's memory: refused before anything is allocated. qlbench interpretation: the whole stack is estimated,
    as the local executor trains it; a Ray plan is not checked (its workers are other machines)."""
    need, have = plan_bytes(sizes, members, dtype, tasks), available_bytes(device)
    if have is not None and need > have:
        raise ValueError(
            f"this plan needs at least {need / 2**30:,.1f} GiB ({members:,} stacked member(s)) but {device} has "
            f"{have / 2**30:,.1f} GiB available; use fewer seeds or functions, or smaller sizes (--hp)"
        )
