"""A learning-rate grid as one workload: a plan per rate (the plans differ in the rate alone), each method's whole grid
trained as one stack where its optimiser allows.

A unit is (rate, method, function): the cell of `plans[rate]`, recorded exactly as that plan records it (the same
path, config and hash), so a grid run and a run at one rate (`--lr`) resume each other's records. A method whose
optimiser takes a rate per member (torch's AdamW: every method but full-soap; engine/rates.py) trains every
pending cell of every rate as one stack, rate-major: its members are (function, seed) once per rate, and member e
trains at its cell's rate. Each member equals the one trained in its rate's own stack, bit for bit on CPU
(tests/test_rates.py). Any other method trains rate by rate, through its plan. The records of a grid stack state
the stack's size (train_info.stacked_members) and its whole wall time.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from qlbench import adapters, engine, zoo
from qlbench.adapters.base import Method
from qlbench.experiments import adapted, experiment, runner
from qlbench.experiments.experiment import Plan
from qlbench.progress import bar as progress_bar

Unit = tuple[float, str, str]  # (learning rate, method, function)


def one_stack(method: str) -> bool:
    """Whether `method` trains its whole grid as one stack: it trains, with the optimiser every method has unless it
    brings its own (full-soap's SOAP takes one rate per stack)."""
    m = adapters.get(method)
    return m.trains and type(m).optimizer is Method.optimizer


class Grid:
    """runner.Workload over `plans`, one per learning rate, alike but for the rate."""

    noun = "cell"
    read = staticmethod(runner.read_result)

    def __init__(self, plans: list[Plan]):
        self.plans = {p.budget.adapt.lr: p for p in plans}
        self.first = plans[0]
        self.out_dir, self.force = self.first.out_dir, self.first.force

    def units(self) -> list[Unit]:
        """Every cell of every rate, method by method."""
        return [(lr, m, f) for m in self.first.methods for lr in self.plans for f in self.first.functions]

    def unit_path(self, unit: Unit) -> Path:
        return self.plans[unit[0]].unit_path(unit[1:])

    def unit_config(self, unit: Unit) -> dict:
        return self.plans[unit[0]].unit_config(unit[1:])

    def unit_cards(self, unit: Unit) -> dict[str, str]:
        return self.plans[unit[0]].unit_cards(unit[1:])

    def intact(self, record: Path, rec: dict, log) -> bool:
        return adapted.model_intact(record, rec, log)

    def train(self, units: list[Unit], progress: bool, log) -> None:
        """The given cells, method by method: a method's pending cells of every rate as one stack (`one_stack`), or
        rate by rate through each rate's plan."""
        for m in self.first.methods:
            cells = {lr: [f for f in self.first.functions if (lr, m, f) in units] for lr in self.plans}
            cells = {lr: fs for lr, fs in cells.items() if fs}
            if not cells:
                continue
            if one_stack(m) and len(cells) > 1:
                self.train_stack(m, cells, progress, log)
            else:
                for lr, fs in cells.items():
                    self.plans[lr].train([(m, f) for f in fs], progress, log)

    def train_stack(self, method: str, cells: dict[float, list[str]], progress: bool, log) -> None:
        """`method`'s cells {rate: functions} as one stack, rate-major; one record per cell, each of its rate's plan."""
        p = self.first
        by_rate = {lr: [(f, s) for f in fs for s in p.seeds] for lr, fs in cells.items()}  # rate -> its members
        members = [x for ms in by_rate.values() for x in ms]  # (E,), rate-major
        lrs = tuple(lr for lr, ms in by_rate.items() for _ in ms)  # (E,)
        with engine.num_threads(experiment.threads(p, len(members))):
            pre = experiment.pretrained(p, list(dict.fromkeys(members)), progress, log).select(members)
            total = engine.steps(p.budget.adapt, zoo.TARGET_TRAIN)
            desc = f"adapt {method} x{len(members)} ({len(by_rate)} rates)"
            saved = self.snapshots(method, cells, members, log)
            if saved is not None and p.force:
                saved.clear()

            def failed(message: str, wall_time_s: float) -> None:
                for lr, fs in cells.items():
                    experiment.write_failed(self.plans[lr], method, fs, message, wall_time_s)

            adaptation = dataclasses.replace(p.adaptation(method), lrs=lrs)
            with progress_bar(total=total, desc=desc, unit="step", disable=not progress) as bar:
                with runner.failures_recorded(method, failed, log) as outcome:
                    res = engine.adapt(pre, adaptation, p.runtime, progress=bar.update, snapshots=saved)
            if outcome.failed:
                return
            first = next(iter(by_rate.values()))
            costs = experiment.measure_cost(
                p, method, pre.select(first), log
            )  # one rate's stack: the rate costs nothing
            start = 0
            for lr, ms in by_rate.items():
                for f in cells[lr]:
                    idx = [start + i for i, (g, _) in enumerate(ms) if g == f]
                    experiment.commit_cell(self.plans[lr], method, f, res, idx, pre, costs, log)
                start += len(ms)
            if saved is not None:
                saved.clear()

    def snapshots(self, method: str, cells: dict[float, list[str]], members: list, log) -> engine.Snapshots | None:
        """The grid stack's snapshots (experiment.stack_snapshots, keyed by every rate's cells)."""
        configs = [self.plans[lr].cell_config(f, method) for lr, fs in cells.items() for f in fs]
        return experiment.stack_snapshots(self.first, method, configs, members, log)
