"""A Pareto grid's points that differ in k alone, trained as one stack.

On one function, the points of a routed method with the same r and M (and every other setting) have the same
parameter shapes: only k, the atoms or experts mixed per input, differs. `StackedPoints` trains them together, each
(point, seed) a member of one stack with its own k (`routing.topk_softmax` routes each member with its k), and writes
each point's record exactly as the point's own plan would: the same config, hash and path, and the same numbers bit
for bit, since every member's initialisation, data, order and arithmetic are its own (tests/test_pareto_stack.py).
A GPU runs a stack of 4 points at about the cost of one; on the CPU a wider stack also trains more member-steps per
second (docs/speed.md).

It is a runner workload (experiments/runner.py): a unit is a point, its record the point's plan's cell record, so a
grid resumes point by point and a stacked run and a point run alone find each other's records.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch.nn as nn

from qlbench import adapters, engine, zoo
from qlbench.experiments import experiment, runner
from qlbench.progress import bar as progress_bar


def member_top_k(model: nn.Module, ks: tuple[int, ...]) -> None:
    """Give every router of the stack (the queryable family's shared memory, moe-lora's gates) one k per member."""
    routers = [m for m in model.modules() if hasattr(m, "member_top_k")]
    if not routers:
        raise ValueError(f"{type(model).__name__} has no router whose k could be set per member")
    for m in routers:
        m.member_top_k = tuple(ks)


def groups(pairs: list[tuple[object, experiment.Plan]]) -> list[list[tuple[object, experiment.Plan]]]:
    """The (point, plan) pairs of one method's grid on one function, grouped by everything but k, in grid order;
    a point without a k axis is a group of its own."""
    out: dict[tuple, list] = {}
    for pt, plan in pairs:
        rest = tuple((a, v) for a, v in pt.values.items() if a != "k")
        key = rest if "k" in pt.values else (id(pt),)
        out.setdefault(key, []).append((pt, plan))
    return list(out.values())


@dataclass
class StackedPoints:
    """Points of one method on one function that differ in k alone (`groups`), one `experiment.Plan` each, trained
    as one stack (runner.Workload; a unit is a point's index)."""

    plans: list[experiment.Plan]
    ks: list[int]
    noun = "grid point"

    def __post_init__(self):
        first = self.plans[0]
        if any(len(p.functions) != 1 or len(p.methods) != 1 for p in self.plans):
            raise ValueError("a stacked grid point is one method on one function")
        if len({json.dumps(_but_k(p), sort_keys=True, default=str) for p in self.plans}) != 1:
            raise ValueError("stacked grid points must differ in k alone (config, seeds, device, results folder)")
        self.out_dir, self.force = first.out_dir, first.force

    def units(self) -> list[int]:
        return list(range(len(self.plans)))

    def _cell(self, i: int) -> tuple[str, str]:
        return self.plans[i].units()[0]

    def unit_path(self, i: int) -> Path:
        return self.plans[i].unit_path(self._cell(i))

    def unit_config(self, i: int) -> dict:
        return self.plans[i].unit_config(self._cell(i))

    def unit_cards(self, i: int) -> dict[str, str]:
        return self.plans[i].unit_cards(self._cell(i))

    read = staticmethod(runner.read_result)

    def intact(self, record: Path, rec: dict, log) -> bool:
        return self.plans[0].intact(record, rec, log)

    def train(self, units: list[int], progress: bool, log) -> None:
        """Pretrain the function's seeds once (cached), adapt the points' members as one stack, then write each
        point's record (its cost measured with its own config)."""
        first = self.plans[units[0]]
        if len(units) == 1:  # nothing to stack with: the point's own plan
            return first.train(first.units(), progress, log)
        (method,), (function,) = first.methods, first.functions
        seeds = [(function, s) for s in first.seeds]
        members = [m for _ in units for m in seeds]  # point-major: point j's seeds are rows j S .. (j + 1) S - 1
        ks = tuple(self.ks[i] for i in units for _ in seeds)
        with engine.num_threads(experiment.threads(first, len(members))):
            alone = experiment.pretrained(first, seeds, progress, log)  # the function's seeds, once
            pre = alone.select(members)
            total = engine.steps(first.budget.adapt, zoo.TARGET_TRAIN)
            label = f"adapt {method} k={','.join(str(self.ks[i]) for i in units)} x{len(members)}"
            with progress_bar(total=total, desc=label, unit="step", disable=not progress) as bar:
                work = lambda: engine.adapt(
                    pre, first.adaptation(method), first.runtime, progress=bar.update,
                    prepare=lambda model: member_top_k(model, ks),
                )  # fmt: skip
                failed = lambda message, wall_s: [
                    experiment.write_failed(self.plans[i], method, [function], message, wall_s) for i in units
                ]
                if (res := runner.attempt(method, work, failed, log)) is None:
                    return
            S = len(seeds)
            for j, i in enumerate(units):
                p = self.plans[i]
                costs = experiment.measure_cost(p, method, alone, log)  # with the point's own k
                experiment.commit_cell(p, method, function, res, list(range(j * S, (j + 1) * S)), pre, costs, log)


def _but_k(p: experiment.Plan) -> dict:
    """What a point's plan is, k left out: its one cell's config and the settings that decide how it trains."""
    config = p.unit_config(p.units()[0])
    config = config | {"method_config": {k: v for k, v in config["method_config"].items() if k != "top_k"}}
    return config | {"run": [p.out_dir, p.device, p.compile, p.capture, p.threads, p.force, p.stack_functions]}


def stackable(method: str) -> bool:
    """Whether the method's points can share a stack across k (a router that takes a k per member)."""
    return adapters.kind_of(method) == "routed" and method in ("moe-lora", *adapters.of_family("queryable"))
