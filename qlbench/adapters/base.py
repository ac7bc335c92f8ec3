"""What a method is: how it turns a pretrained backbone into the model that is adapted, and how it is optimised.

Every row of a comparison table is a `Method` in the registry (adapters/__init__.py): adapters (LoRA and its
relatives) wrap target linears through `inject`; full fine-tuning unfreezes the backbone; the reference rows
(`frozen`, `mean`) do not train. The engine only ever calls `build` and `optimizer`, never branches on names.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn as nn

from qlbench.backbones import Target


@dataclass
class NoConfig:
    """For methods without hyper-parameters."""


@dataclass
class Site:
    """Where an adapter layer sits: the backbone target plus its order among all adapted layers."""

    target: Target
    index: int  # 0 .. n_sites - 1 in forward order
    n_layers: int  # number of backbone layers (the units routing blocks are made of)


def check_positive_int(config, *names: str) -> None:
    """Config fields that must be integers >= 1 (a bool is not accepted, though Python counts it as an int)."""
    for name in names:
        v = getattr(config, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")


def _number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def check_positive(config, *names: str) -> None:
    """Config fields that must be finite numbers > 0."""
    for name in names:
        v = getattr(config, name)
        if not (_number(v) and v > 0):
            raise ValueError(
                f"{name} must be > 0, got {v!r}" if _number(v) else f"{name} must be a finite number > 0, got {v!r}"
            )


def check_nonnegative(config, *names: str) -> None:
    """Config fields that must be finite numbers >= 0."""
    for name in names:
        v = getattr(config, name)
        if not (_number(v) and v >= 0):
            raise ValueError(
                f"{name} must be >= 0, got {v!r}" if _number(v) else f"{name} must be a finite number >= 0, got {v!r}"
            )


def check_targets(config) -> None:
    """A config's `targets`: None (the backbone's default) or a non-empty tuple of role names; a comma-separated
    string (from --hp) is split. Normalised to a tuple in place."""
    if isinstance(config.targets, str):
        config.targets = tuple(t.strip() for t in config.targets.split(","))
    if config.targets is not None and (
        not isinstance(config.targets, (tuple, list))
        or not config.targets
        or not all(isinstance(t, str) for t in config.targets)
    ):
        raise ValueError(f"targets must be a non-empty tuple of role names such as ('q', 'v'), got {config.targets!r}")
    if config.targets is not None:
        config.targets = tuple(config.targets)


EPS = 1e-8  # the optimisers' epsilon (AdamW's and SOAP's default; `qlbench run --eps` sets another, recorded)


def adamw(params, lr: float, weight_decay: float, eps: float = EPS) -> torch.optim.Optimizer:
    """AdamW as pretraining and every element-wise method use it, exact on stacked leaves (member e's update is the
    one it would get alone) in both implementations it picks:

    - on CUDA, fused (one kernel over all tensors; every element takes the same arithmetic) and capturable (its step
      count on the device, so the engine can record the update in a CUDA graph: engine/step.py);
    - elsewhere, foreach. PyTorch's fused CPU kernel is not position independent: it splits each tensor into
      cache-line units, vectorises inside them and finishes a short tail with scalar code whose last bits differ,
      so a member's update would depend on how many members its stack holds (the (E, 1) head bias of a stack of 18
      or more takes the vector path, a narrower stack's the scalar one; measured, docs/speed.md "Stack independence").
    """
    params = list(params)
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(
        params, lr=lr, weight_decay=weight_decay, eps=eps, fused=fused, foreach=not fused, capturable=fused
    )


def task_owned(model: nn.Module) -> list[tuple[nn.Parameter, int, int]]:
    """The parameters whose slices each belong to one task of a suite, as (parameter, task axis, T): a layer
    declares them in `task_axes` (attribute name -> the axis along which its T tasks' equal blocks lie) and holds
    its task count in `tasks` (lora-per-task's A and B, task-lora's cores)."""
    return [
        (getattr(m, name), dim, m.tasks)
        for m in model.modules()
        for name, dim in getattr(m, "task_axes", {}).items()
        if getattr(m, name).requires_grad
    ]


def isolate_tasks(optimizer: torch.optim.Optimizer, model: nn.Module, trained: list[int]) -> torch.optim.Optimizer:
    """Restrict decoupled weight decay on task-owned parameters (`task_owned`) to the tasks a stage trains.

    AdamW decays every parameter at every step, trained or not (p *= 1 - lr wd), so a task's own factors would shrink in
    stages that never see the task, and lora-per-task would forget the tasks trained before it (docs/methods.md,
    "Schedules"). Here those parameters move to a group of their own without decay, and a step pre-hook applies AdamW's
    decay, p *= 1 - lr wd, to the trained tasks' blocks only. An untrained task's block then gets no gradient, so a
    fresh optimiser's moments stay 0 and its update is exactly 0: the block stays bit for bit. Call before the first
    step (the optimiser holds no state). A stage that trains every task keeps the plain optimiser (the same decay
    everywhere, numbers unchanged)."""
    owned = task_owned(model)
    if not owned or all(set(range(T)) <= set(trained) for _, _, T in owned):
        return optimizer
    ids = {id(p) for p, _, _ in owned}
    (group,) = [g for g in optimizer.param_groups if any(id(p) in ids for p in g["params"])]
    wd = group["weight_decay"]
    group["params"] = [p for p in group["params"] if id(p) not in ids]
    optimizer.add_param_group({**{k: v for k, v in group.items() if k != "params"}, "params": [p for p, _, _ in owned]})
    optimizer.param_groups[-1]["weight_decay"] = 0.0
    masks = []
    for p, dim, T in owned:  # 1 on the trained tasks' blocks along `dim`, 0 elsewhere, broadcastable to p
        width = p.shape[dim] // T
        on = torch.zeros(p.shape[dim], dtype=torch.bool, device=p.device)
        for t in trained:
            on[t * width : (t + 1) * width] = True
        masks.append(on.view([-1 if d == dim else 1 for d in range(p.dim())]))
    keep: dict[float, list[torch.Tensor]] = {}  # lr -> per-parameter factors, built once per learning rate

    def decay(opt, args, kwargs) -> None:
        lr = group["lr"]  # read at each step as AdamW reads it
        if lr not in keep:  # AdamW's decoupled decay on the trained blocks, 1 elsewhere
            keep[lr] = [
                torch.where(on, torch.tensor(1.0 - lr * wd, dtype=p.dtype), 1.0) for (p, _, _), on in zip(owned, masks)
            ]
        with torch.no_grad():
            for (p, _, _), factor in zip(owned, keep[lr]):
                p.mul_(factor)

    optimizer.register_step_pre_hook(decay)
    return optimizer


# What a method is, as every table, test and benchmark groups it (display order: this order).
KINDS = {
    "full": "full fine-tuning (every backbone weight trains)",
    "static": "static adapter (one fixed update per layer)",
    "task": "task-conditioned adapter (a separate or conditioned update per task of a suite)",
    "routed": "routed adapter (the update depends on the input through a router)",
    "reference": "reference row (no training: what the shift and a collapsed model score)",
}


class Method:
    """One comparison row. Subclasses set `name`, `summary`, `kind` and `config_cls` and implement `build`."""

    name: str
    summary: str  # one line, shown by `qlbench run --help`
    kind: str  # one of KINDS: how statistics, reports, diagnostics and the benchmark group the method
    config_cls: type = NoConfig
    trains: bool = True  # False for rows that are evaluated without any training (frozen, mean)
    stream: str | None = None  # the method whose random stream seeds its new parameters (None: its own name)

    def init_stream(self) -> str:
        """The name under which member e's init generator is seeded (`generator("init", <this>, ...)`): the method's
        own, unless it is another method written elsewhere (peft:lora is lora, and draws lora's start)."""
        return self.stream or self.name

    def build(self, backbone: nn.Module, config, generators: list[torch.Generator], y_train: torch.Tensor) -> nn.Module:
        """The model to adapt, built from (and possibly modifying) `backbone`; sets requires_grad.

        generators[e] seeds member e's new parameters; y_train (E, N) are the target training labels.
        """
        raise NotImplementedError

    def optimizer(
        self, model: nn.Module, config, lr: float, weight_decay: float, eps: float = EPS
    ) -> torch.optim.Optimizer:
        """AdamW over the trainable parameters: element-wise, so exact on stacked leaves."""
        return adamw((p for p in model.parameters() if p.requires_grad), lr, weight_decay, eps)

    def bind(self, model: nn.Module, members: list[tuple[str, int]], config) -> None:
        """Attach what depends on the members (function, seed) beyond their data, once the model is built: the
        instruction embedding e(c) of each member for a method that routes on one. Nothing for most methods."""

    def make_config(self, **overrides) -> object:
        """The method's config with `overrides` applied to the fields it has (others are ignored)."""
        names = {f.name for f in dataclasses.fields(self.config_cls)}
        return self.config_cls(**{k: v for k, v in overrides.items() if k in names})


class AdapterMethod(Method):
    """A low-rank adapter: wraps the backbone's target linears with `layer_cls` (see `inject`).

    Its `family` (the method's own name, unless it reuses another method's layers, as instruct-queryable reuses
    queryable's) starts the names of every trainable parameter it adds (`<family>_A` in a layer,
    `shared.<family>.` for its shared module) and keys its state in ctx.scratch, so freezing, counting and saving
    work by name.
    """

    def __init__(
        self,
        name: str,
        summary: str,
        config_cls: type,
        layer_cls: type,
        shared_cls: type | None = None,
        family: str | None = None,
        kind: str = "static",
    ):
        self.name, self.summary, self.config_cls, self.kind = name, summary, config_cls, kind
        self.layer_cls, self.shared_cls, self.family = layer_cls, shared_cls, family or name

    def build(self, backbone, config, generators, y_train):
        return inject(backbone, self, config, generators)


def inject(model: nn.Module, method: AdapterMethod, config, generators: list[torch.Generator]) -> nn.Module:
    """Freeze `model`, then wrap each target linear with `method.layer_cls` (in place; returns `model`).

    Shared modules (routing memory, generator networks, hypernetworks) are built first and registered once under
    `model.shared[method.family]`; layers reach them through the ForwardContext, never through hidden references.
    Randomness is drawn member by member from `generators`, shared module first, then layers in forward order.
    """
    for p in model.parameters():
        p.requires_grad_(False)
    targets = model.adapter_targets(getattr(config, "targets", None))
    sites = [Site(t, i, model.n_layers) for i, t in enumerate(targets)]
    like = next(model.parameters())
    if method.shared_cls is not None:
        model.shared[method.family] = method.shared_cls(model, sites, config, generators, like)
    for site in sites:
        parent_path, _, child = site.target.path.rpartition(".")
        parent = model.get_submodule(parent_path)
        base = getattr(parent, child)
        layer = method.layer_cls(base, site, config, generators)
        setattr(parent, child, layer)  # ModuleList children are addressed by their index string
    return model


def trainable_parameter_count(model: nn.Module) -> int:
    """Trainable parameters of ONE member (the stack shares shapes; the leading dimension is E)."""
    return sum(p[0].numel() for p in model.parameters() if p.requires_grad)


def total_parameter_count(model: nn.Module) -> int:
    """All parameters of one member, frozen included."""
    return sum(p[0].numel() for p in model.parameters())
