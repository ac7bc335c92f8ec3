"""Experiments: a grid of cells (function, arch, method) over seeds, run on the stacked engine, one record per cell.

All functions x seeds of a run are stacked into one ensemble per method: for a single function that is its seeds,
for the full table it is nine functions x five seeds in one batched step. Cells whose record already exists with
the same config hash are skipped, so an interrupted run resumes where it stopped; a stack stopped mid-stage goes on
from its last snapshot (engine/snapshot.py).

About 500 lines: a plan's validation, the training of its cells (one stack per method, or several at once) and the
writing and reloading of their records change together, and each part is short; the checks of single settings live
in planning.py.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from pathlib import Path

from qlbench import adapters, cost, engine, instances, protocols, zoo
from qlbench.adapters import member, outside
from qlbench.backbones import DEFAULT_INIT
from qlbench.experiments import adapted, runner
from qlbench.experiments.planning import (
    Resolved,
    cells_per_stack,
    check_overrides,
    chosen,
    dry_build,
    make_config,
    resolve,
    resolve_at_once,
)
from qlbench.progress import bar as progress_bar  # `progress` is the functions' on/off argument
from qlbench.records import record, results
from qlbench.records.store import (
    Store,
    save_torch,
    stable_hash,
    write_json,
)
from qlbench.settings import DEFAULT_EXECUTION, DEFAULT_PROTOCOL, DTYPES, Execution, Protocol


@dataclass(kw_only=True)
class Plan(Resolved):
    """A validated experiment: everything resolved before any work starts, so bad input fails fast (the settings
    every plan shares: planning.Resolved)."""

    functions: list[str]
    methods: list[str]
    configs: dict[str, object]  # method -> its validated config
    compile: bool = False  # torch.compile the training step (an execution choice, like the device: not hashed)
    noise: str = zoo.DEFAULT_NOISE  # zoo.NOISES: how labels are noised; hashed unless zoo.LEGACY_NOISE
    validation: bool = False  # score the targets' validation sets too (hashed when on)
    stack_functions: int | None = None  # functions per stack where all do not fit the memory (None: all; not hashed)
    methods_at_once: int = 1  # methods' stacks trained at once, each in its own thread and CUDA stream (not hashed)
    snapshot_every_s: float | None = engine.SNAPSHOT_EVERY_S  # between a stack's snapshots (0: each evaluation;
    # None: none; not hashed)

    noun = "cell"  # runner.Workload: a unit is a (method, function) cell

    @property
    def store(self) -> Store:
        return Store(self.out_dir)

    def units(self) -> list[tuple[str, str]]:
        """Every (method, function) cell, method by method (runner.Workload)."""
        return [(m, f) for m in self.methods for f in self.functions]

    def unit_path(self, unit: tuple[str, str]) -> Path:
        return self.record_path(unit[1], unit[0])

    def unit_config(self, unit: tuple[str, str]) -> dict:
        return self.cell_config(unit[1], unit[0])

    def unit_cards(self, unit: tuple[str, str]) -> dict[str, str]:
        """The version of the function's card the cell's data is made from (zoo.card_digest; runner.Workload), under
        the card's name (a task variant's data is made from its card)."""
        return {zoo.card_name(unit[1]): zoo.card_digest(unit[1])}

    read = staticmethod(runner.read_result)  # a record of the schema (results.read_record)

    def intact(self, record: Path, rec: dict, log) -> bool:
        """Whether the adapter weights a finished record relies on are there and readable (runner.finished)."""
        return adapted.model_intact(record, rec, log)

    def train(self, units: list[tuple[str, str]], progress: bool, log) -> None:
        """Train the given cells in this process (runner.run), in groups of functions that fit the memory (one group
        unless the plan is wider): every member pretrained once (cached), then each method adapted on its stack of
        the group's unfinished cells and its records written (`train_method`): one method after another, or
        `methods_at_once` at a time (`engine.concurrently`: their costs, which time forwards and read the device's
        memory peak, are measured first, one at a time, while nothing else runs)."""
        todo = by_method(self, units)
        functions = [f for f in self.functions if any(f in fs for fs in todo.values())]
        width = self.stack_functions or len(functions) or 1
        for i in range(0, len(functions), width):
            group = functions[i : i + width]
            if width < len(functions):
                log(f"stack {i // width + 1} of {-(-len(functions) // width)}: {', '.join(group)} (memory)")
            part = {m: [f for f in fs if f in group] for m, fs in todo.items() if any(f in group for f in fs)}
            with engine.num_threads(threads(self, len(group) * len(self.seeds))):
                pre = pretrained(self, [(f, s) for f in group for s in self.seeds], progress, log)
                stack = lambda m, pre=pre, part=part: pre.select([(f, s) for f in part[m] for s in self.seeds])
                trained = [m for m in part if adapters.get(m).trains]
                total = engine.steps(self.budget.adapt, zoo.TARGET_TRAIN) * len(trained)
                with progress_bar(total=total, desc="adapt", unit="step", disable=not progress) as bar:
                    if self.methods_at_once <= 1:
                        for m in part:
                            bar.set_description(f"adapt {m} x{len(part[m]) * len(self.seeds)}")
                            train_method(self, m, stack(m), bar.update if m in trained else None, log)
                    else:
                        at_once(self, list(part), stack, bar, log)

    def record_path(self, function: str, method: str) -> Path:
        """Where the cell's record lives: keyed by budget and config hash, so other configs never collide."""
        return self.store.record_path(
            self.arch, function, method, self.budget.name, stable_hash(self.cell_config(function, method))
        )

    @property
    def backbones(self) -> engine.Backbones:
        """The plan's pretrained backbones: its arch, pretraining phase, dtype, backbone init and label noise."""
        return engine.Backbones(self.arch, self.budget.pretrain, DTYPES[self.dtype], self.backbone_init, self.noise)

    def pretrain_needed(self, members: list[engine.Member]) -> bool:
        """Whether `pretrain(members)` will train anything (some member's backbone is not in the store's cache)."""
        return self.backbones.needed(members, self.store)

    def pretrain(self, members: list[engine.Member], **kwargs) -> engine.Pretrained:
        """The members' source-pretrained backbones with this plan's settings, store, device and compile setting
        (cached; `engine.pretrain`); kwargs: progress, log. Every executor pretrains through here, so none can drop
        one of these settings."""
        return engine.pretrain(
            self.backbones,
            members,
            device=self.device,
            store=self.store,
            compile=self.compile,
            capture=self.capture,
            **kwargs,
        )

    def adaptation(self, method: str) -> engine.Adaptation:
        """What `method`'s stack is adapted with under this plan (engine.adapt)."""
        return engine.Adaptation(method, self.configs[method], self.budget, self.eps, self.noise, self.validation)

    @property
    def runtime(self) -> engine.Runtime:
        """Where and how this plan's steps run (engine.adapt)."""
        return engine.Runtime(self.device, DTYPES[self.dtype], self.compile, self.capture)

    @property
    def chosen(self) -> dict:
        """The settings beyond the config that every record states, defaults included (record.settings)."""
        return {
            "eps": self.eps,
            "backbone_init": self.backbone_init,
            "noise": self.noise,
            "capture": self.capture,
            "methods_at_once": self.methods_at_once,
        }

    def cell_config(self, function: str, method: str) -> dict:
        """The fully resolved config of one cell; its hash decides whether a finished record can be reused.

        A non-default backbone init adds a "backbone_init" key, a non-default optimiser epsilon an "eps" key, a
        label noise other than the legacy "absolute" a "noise" key and a validation set a "validation" key; the
        records written before these settings existed (default init and eps, absolute noise) add none, so their
        hashes stay valid."""
        extra = {} if self.backbone_init == DEFAULT_INIT else {"backbone_init": self.backbone_init}
        extra |= {} if self.eps == adapters.EPS else {"eps": self.eps}
        extra |= {} if self.noise == zoo.LEGACY_NOISE else {"noise": self.noise}
        extra |= {"validation": True} if self.validation else {}
        return extra | {
            "function": function,
            "arch": self.arch,
            "method": method,
            "method_config": dataclasses.asdict(self.configs[method]),
            "budget": dataclasses.asdict(self.budget) | {"seeds": len(self.seeds)},
            "seeds": self.seeds,
            "dtype": self.dtype,
            "schema": results.SCHEMA,
        }


def plan(
    functions: list[str],
    methods: list[str] | None = None,
    *,
    protocol: Protocol = DEFAULT_PROTOCOL,
    execution: Execution = DEFAULT_EXECUTION,
    overrides: dict | None = None,
) -> Plan:
    """Validate every choice (ValueError with the valid options on bad input) and resolve defaults: the functions'
    cells of each method (None: adapters.DEFAULT_METHODS), with hyper-parameter `overrides` for every method that
    has the field. Execution's `methods_at_once` "auto" resolves through `planning.resolve_at_once` (every method on
    CUDA for deep-narrow, else 1); above 1, `compile` auto does not compile (torch.compile's caches are the
    process's)."""
    arch = protocol.arch
    if not functions:
        raise ValueError(f"no function given; valid: {', '.join(zoo.names())}")
    for f in functions:
        zoo.card(f)  # raises with the valid names
    if len(set(functions)) != len(functions):
        raise ValueError(f"function listed twice in {','.join(functions)}")
    given = adapters.DEFAULT_METHODS if methods is None else methods
    # canonical names first (loads peft:<type> and package.module:NAME, one line if not): two spellings are one method
    methods = chosen([adapters.canonical(m) for m in given], [], ", ".join(adapters.names()))
    overrides = check_overrides(overrides, methods)
    configs = {m: make_config(m, m, overrides) for m in methods}
    sizes = dry_build(arch, configs)
    capture, compile, cuda = execution.capture, execution.compile, execution.cuda
    if capture == "auto" and any(isinstance(adapters.get(m), adapters.MemberMethod) for m in methods):
        capture = "off"  # code written for one member (peft's, a user's) is not vouched for inside a CUDA graph
    dev = engine.resolve_device(execution.device, cuda)
    methods_at_once = resolve_at_once(execution.methods_at_once, arch, dev, len(methods), compile, local=cuda is None)
    width = None
    if cuda is None:  # trains on this machine (a Ray plan's workers are elsewhere): every stack at once must fit
        at_once = min(methods_at_once, len(methods))
        width = cells_per_stack(sizes, protocol.n_seeds * at_once, len(functions), protocol.dtype, dev)
    shared = resolve(protocol, execution, dev, capture=capture)
    use_compile = compile == "on" or (
        compile == "auto" and methods_at_once == 1 and engine.compile_by_default(dev, protocol.schedule.name)
    )
    return Plan(
        **shared,
        functions=list(functions),
        methods=methods,
        configs=configs,
        compile=use_compile,
        noise=protocol.noise,
        validation=protocol.validation,
        stack_functions=width if width is not None and width < len(functions) else None,
        methods_at_once=methods_at_once,
        snapshot_every_s=execution.snapshot_every_s,
    )


def by_method(p: Plan, units: list[tuple[str, str]]) -> dict[str, list[str]]:
    """method -> the functions of the given (method, function) cells, in the plan's order."""
    return {m: [f for f in p.functions if (m, f) in units] for m in p.methods}


def threads(p: Plan, members: int) -> int | None:
    """Intra-op threads for a stack of `members`: the plan's, else `engine.auto_threads`."""
    return engine.auto_threads(p.arch, members, p.threads)


def record_paths(p: Plan) -> list[Path]:
    """The record path of every cell of the plan, method by method."""
    return [p.unit_path(u) for u in p.units()]


def at_once(p: Plan, methods: list[str], stack, bar, log) -> None:
    """Every method's stack (`stack(m)` builds it) trained `p.methods_at_once` at a time (`engine.concurrently`),
    each committing its records as it ends; their costs are measured first, one at a time, while nothing else
    runs."""
    costs = {m: measure_cost(p, m, stack(m), log) for m in methods}
    bar.set_description(f"adapt {len(methods)} methods, {min(p.methods_at_once, len(methods))} at once")
    lock = threading.Lock()

    def update(n: int) -> None:
        with lock:
            bar.update(n)

    def job(m: str) -> None:
        train_method(p, m, stack(m), update if adapters.get(m).trains else None, log, costs[m])

    engine.concurrently([lambda m=m: job(m) for m in methods], p.methods_at_once, p.device)


def pretrained(p: Plan, members: list[engine.Member], progress: bool, log) -> engine.Pretrained:
    """The members' pretrained backbones (`Plan.pretrain`: cached), with a progress bar while any trains."""
    with progress_bar(
        total=engine.steps(p.budget.pretrain, zoo.SOURCE_TRAIN) * (1 if p.pretrain_needed(members) else 0),
        desc=f"pretrain {p.arch} x{len(members)}",
        unit="step",
        disable=not progress,
        leave=False,
    ) as bar:
        return p.pretrain(members, progress=bar.update, log=log)


def write_failed(p: Plan, method: str, functions: list[str], message: str, wall_time_s: float) -> None:
    """A `failed` record (no measurement, the message) for each of the method's cells on `functions`: the table
    shows it as a row, the command reports it and exits 1, and the next run retries it (`_finished`)."""
    for f in functions:
        chosen = p.chosen | {"cards": p.unit_cards((method, f))}
        run = record.RunInfo(p.cell_config(f, method), p.seeds, p.device, p.compile, chosen)
        rec = record.make_record(run, record.TrainInfo("failed", message, wall_time_s))
        write_json(rec, p.record_path(f, method))


def measure_cost(p: Plan, method: str, pre: engine.Pretrained, log) -> dict | None:
    """The method's cost on this plan (qlbench/cost.py), measured once per stack and shared by its cells (the
    architecture, method and config fix it); None, said through `log`, if the measurement fails: the cell's
    results are not lost for it."""
    b = p.budget
    measure = lambda: cost.measure(
        pre, method, p.configs[method], batch_size=b.adapt.batch_size, device=p.device, dtype=DTYPES[p.dtype],
        repeats=cost.repeats_for(b.name),
    )  # fmt: skip
    return runner.cost(method, measure, log)


def snapshots(p: Plan, method: str, pre: engine.Pretrained, log) -> engine.Snapshots | None:
    """The snapshots of `method`'s stack `pre` while it trains (engine/snapshot.py), keyed by its cells' configs, its
    members and what else changes its numbers' bits (device, compile, capture); None for a method that does not
    train, or with snapshots off."""
    if not adapters.get(method).trains:
        return None
    functions = list(dict.fromkeys(f for f, _ in pre.members))
    return stack_snapshots(p, method, [p.cell_config(f, method) for f in functions], pre.members, log)


def stack_snapshots(p: Plan, method: str, configs: list[dict], members: list, log) -> engine.Snapshots | None:
    """The snapshots of a stack of `method` holding the cells of `configs` and the `members`, keyed by them and by
    what else changes its numbers' bits (device, compile, capture); None with snapshots off."""
    if p.snapshot_every_s is None:
        return None
    key = stable_hash(
        {
            "cells": [stable_hash(c) for c in configs],
            "members": [list(m) for m in members],
            "device": p.device.type,
            "compile": p.compile,
            "capture": p.capture,
        }
    )
    found = engine.Snapshots(p.store.snapshot_path(p.arch, method, p.budget.name, key), key, p.snapshot_every_s)
    found.log = lambda message: log(f"{method}: {message}")
    return found


AFTER = "measured after training"  # train_method's cost: measured once the stack has trained


def train_method(p: Plan, method: str, pre: engine.Pretrained, progress, log, cost=AFTER) -> None:
    """Adapt `method` on the stack `pre` (its members: functions x the plan's seeds) and commit one record per
    function, its adapter weights first, with `cost` (AFTER: measured once it has trained; `measure_cost`); a
    failure is recorded as failed cells (`runner.failures_recorded`). A trained method's stack snapshots as it goes
    and resumes a stopped run's snapshot (`snapshots`; with `p.force`, a stopped run's is removed first: the stack
    starts from its first epoch). Both executors call this."""
    functions = list(dict.fromkeys(f for f, _ in pre.members))
    saved = snapshots(p, method, pre, log)
    if saved is not None and p.force:
        saved.clear()
    failed = lambda message, wall_time_s: write_failed(p, method, functions, message, wall_time_s)
    with runner.failures_recorded(method, failed, log) as outcome:
        res = engine.adapt(pre, p.adaptation(method), p.runtime, progress=progress, snapshots=saved)
    if not outcome.failed:
        commit_method(p, method, pre, res, measure_cost(p, method, pre, log) if cost is AFTER else cost, log)


def commit_method(p: Plan, method: str, pre: engine.Pretrained, res: engine.AdaptResult, costs, log) -> None:
    """The records of `method`'s cells from its adapted stack `res`, with its measured `costs` (`measure_cost`);
    then the stack's snapshot, if any, is removed."""
    for f in dict.fromkeys(f for f, _ in pre.members):
        commit_cell(p, method, f, res, [i for i, (g, _) in enumerate(res.members) if g == f], pre, costs, log)
    if (saved := snapshots(p, method, pre, log)) is not None:
        saved.clear()


def commit_cell(
    p: Plan, method: str, f: str, res: engine.AdaptResult, idx: list[int], pre: engine.Pretrained, costs, log
) -> None:
    """Write the record of the cell (f, method) of plan `p` from the members `idx` of the adapted stack `res`
    (pretrained as `pre`, members alike), its adapter weights first."""
    c = res.curves
    per_seed = []
    for i in idx:
        seed = res.members[i][1]
        per_seed.append(
            {
                "seed": seed,
                "status": "ok" if c.diverged_epoch[i] is None else "diverged",
                "diverged_epoch": c.diverged_epoch[i],
                **c.member_summary(i),
                "backbone_digest": instances.digest({k: v[i] for k, v in pre.state.items()}),
                "source_train_mse": pre.source_train_mse[i],
                "source_test_mse": pre.source_test_mse[i],
                "source_test_mse_after": res.source_test_mse_after[i],
                "train_curve": c.train_mse[i].tolist(),
                "test_curve": c.test_mse[i].tolist(),
                **record.gradient_fields(c, i),
            }
        )
    bad = [s["seed"] for s in per_seed if s["status"] == "diverged"]
    message = f"diverged seeds: {bad}" if bad else ""
    if bad:
        rest = "the other seeds completed" if len(bad) < len(per_seed) else "every seed diverged"
        log(
            f"{method} on {f}: seed(s) {bad} diverged (non-finite MSE, or above "
            f"{engine.DIVERGENCE_FACTOR:g}x the epoch-0 train MSE); {rest}"
        )
    config = p.cell_config(f, method)
    cards = p.unit_cards((method, f))
    under = protocols.of_config(config, cards)  # the benchmark protocol the cell was made under, if any (protocols.py)
    chosen = (
        p.chosen
        | {"cards": cards}
        | {"backbone_commits": pre.select([res.members[i] for i in idx]).commits()}
        | member.recorded(res.model)
        | outside.provenance(adapters.get(method))
        | ({"protocol": under} if under else {})
    )
    train = record.TrainInfo(
        status="diverged" if bad else "ok",
        message=message,
        wall_time_s=res.wall_time_s,
        stacked_members=len(res.members),
        trainable_params=res.trainable_params,
        total_params=res.total_params,
        eval_epochs=c.epochs,
        grad_epochs=c.grad_epochs,
        per_seed=per_seed,
        cost=costs,
        resumed_epoch=c.resumed_epoch,
    )
    rec = record.make_record(record.RunInfo(config, p.seeds, p.device, p.compile, chosen), train)
    if adapters.get(method).trains and res.trainable_params < res.total_params:  # adapter weights first:
        save_torch(
            {
                "config_hash": rec["run_info"]["config_hash"],
                "members": [res.members[i] for i in idx],
                "state": adapted.trainable_state(res.model, idx),
            },
            Store.model_of(p.record_path(f, method)),
        )
    write_json(rec, p.record_path(f, method))  # the record commits
