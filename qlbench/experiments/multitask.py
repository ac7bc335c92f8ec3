"""Suites on the stacked engine: one backbone, T tasks, a joint, sequential or held-out schedule, the stage x task
matrix. The plan (SuitePlan: its rows, their variants and configs, validated before any work), the training of a row
through its stages and the writing of its record. The schedules, the rows and variants, the code controls and the
held-out labels' two standardisations are described in docs/design.md ("Multi-task suites"); a suite's data,
instructions and per-task evaluation are in suite_tasks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qlbench import adapters, cost, engine, parametric, suites, zoo
from qlbench.adapters import member, queryable
from qlbench.adapters.base import isolate_tasks
from qlbench.experiments import planning, runner, suite_tasks
from qlbench.experiments.suite_tasks import PARAMETER_SOURCE
from qlbench.progress import bar as progress_bar
from qlbench.records import record
from qlbench.records.store import Store, stable_hash, write_json
from qlbench.seeding import generator
from qlbench.settings import DEFAULT_EXECUTION, DEFAULT_PROTOCOL, DTYPES, Execution, Protocol

SCHEDULES = ("joint", "sequential", "held-out")
# the instruction-router ablation's structural variants: instruct-queryable's settings, run on one function
# (ablation.VARIANTS) and on a suite (`qlbench ablate --suite`)
STRUCTURAL_VARIANTS = {
    "no-instruction": {"tau_lang": 0.0, "lambda_ctx": 0.0},
    "no-language-prior": {"tau_lang": 0.0},
    "instruction-only": {"query": "instruction-only"},
}
ROUTES = ("own", "nearest")  # `held_out_route`: how a task no stage trains is evaluated (its own task index or the
# nearest trained task's); a setting multitask applies itself (no method's config has it)
VARIANTS = {  # row -> (registered method, its fixed settings)
    "task-code": ("instruct-queryable", {"instruction_source": "random"}),
    "text-lora-code": ("text-lora", {"instruction_source": "random"}),  # text-lora's identity control
    # controls that can transfer without words (module docstring): parametric suites only
    "param-code": ("instruct-queryable", {"instruction_source": PARAMETER_SOURCE}),
    "text-lora-params": ("text-lora", {"instruction_source": PARAMETER_SOURCE}),
    "nearest-task": ("lora-per-task", {"held_out_route": "nearest"}),
    **{name: ("instruct-queryable", settings) for name, settings in STRUCTURAL_VARIANTS.items()},
}
PARAMETRIC_ROWS = ("param-code", "text-lora-params", "nearest-task")  # they read each task's parameters
DEFAULT_ROWS = (
    "lora",
    "lora-matched",
    "lora-per-task",
    "task-lora",
    "queryable",
    "instruct-queryable",
    "task-code",
    "frozen",
    "mean",
)
SCHEMA = 1


def rows() -> list[str]:
    """Every valid row: the registered methods, then the variants."""
    return [*adapters.names(), *VARIANTS]


def method_of(row: str) -> tuple[str, dict]:
    """(registered method, its fixed settings) of a row; ValueError listing the valid rows."""
    if row in VARIANTS:
        return VARIANTS[row]
    if row in adapters.REGISTRY or row.startswith(adapters.peft_tuners.PREFIX):
        adapters.get(row)  # a peft tuner's name is checked here (unknown or refused: its own one-line error)
        return row, {}
    raise ValueError(f"unknown method {row!r}; valid: {', '.join(rows())}")


def reads_instruction(config) -> bool:
    """True for a config that conditions on the instruction embedding (an `instruction_dim` and an
    `instruction_source`: instruct-queryable and its variants, text-lora)."""
    return getattr(config, "instruction_dim", None) is not None and hasattr(config, "instruction_source")


@dataclass(kw_only=True)
class SuitePlan(planning.Resolved):
    """A validated suite experiment: everything resolved before any work starts (the settings every plan shares:
    planning.Resolved)."""

    suite: suites.Suite
    schedule: str
    rows: list[str]
    configs: dict[str, object]  # row -> its method's validated config
    routes: dict[str, str] = dataclasses.field(default_factory=dict)  # row -> its held_out_route ("own" if absent)

    noun = "row"  # runner.Workload: a unit is a row

    @property
    def store(self) -> Store:
        return Store(self.out_dir)

    def units(self) -> list[str]:
        return list(self.rows)

    def unit_path(self, row: str) -> Path:
        return self.record_path(row)

    def unit_config(self, row: str) -> dict:
        return self.cell_config(row)

    def unit_cards(self, row: str) -> dict[str, str]:
        """The versions of the cards the suite's data is made from (suites.cards; runner.Workload)."""
        return suites.cards(self.suite.name)

    read = staticmethod(runner.read_result)  # a record of the schema (results.read_record)

    def intact(self, record: Path, rec: dict, log) -> bool:
        return True  # a suite row saves no weights: its record is all it has

    def train(self, rows: list[str], progress: bool, log) -> None:
        """Train the given rows in this process (runner.run)."""
        _run_rows(self, rows, progress, log)

    @property
    def members(self) -> list[engine.Member]:
        """(suite card, seed): the card, since a control suite shares its card's backbone and data."""
        return [(suites.data_name(self.suite.name), s) for s in self.seeds]

    def route(self, row: str) -> str:
        """The row's held_out_route (ROUTES)."""
        return self.routes.get(row, "own")

    def cell_config(self, row: str) -> dict:
        """The row's fully resolved config. A task-owned row on a schedule with stages that leave tasks out carries
        "task_decay": "own-stages" (isolate_tasks): a record without it decayed every task in every stage and must
        not be reused; a row routing held-out tasks elsewhere carries its "held_out_route"; every other row's config
        holds neither key, so its hash does not depend on them."""
        method, _ = method_of(row)
        isolated = adapters.get(method).kind == "task" and self.schedule != "joint"
        routed = {"held_out_route": self.route(row)} if self.route(row) != "own" else {}
        return (
            ({"task_decay": "own-stages"} if isolated else {})
            | routed
            | {
                "suite": self.suite.name,
                "suite_card": suites.card_config(self.suite),
                "schedule": self.schedule,
                "arch": self.arch,
                "row": row,
                "method": method,
                "method_config": dataclasses.asdict(self.configs[row]),
                "budget": dataclasses.asdict(self.budget) | {"seeds": len(self.seeds)},
                "seeds": self.seeds,
                "dtype": self.dtype,
                "backbone_init": self.backbone_init,
                "eps": self.eps,
                "schema": SCHEMA,
            }
        )

    def record_path(self, row: str) -> Path:
        h = stable_hash(self.cell_config(row))
        return self.store.suite_record_path(self.arch, self.suite.name, self.schedule, row, self.budget.name, h)

    @property
    def backbones(self) -> engine.Backbones:
        """The suite's backbones: trained on its card's standardised source (members (suite card, seed))."""
        dtype = DTYPES[self.dtype]
        return engine.Backbones(self.arch, self.budget.pretrain, dtype, self.backbone_init, source="suite")

    def pretrain(self, **kwargs) -> engine.Pretrained:
        return engine.pretrain(
            self.backbones, self.members, device=self.device, store=self.store, capture=self.capture, **kwargs
        )


SUITE_SOURCES = ("card", "random", PARAMETER_SOURCE)  # the instruction sources a suite row takes (instruction_table)
SUITE_COMPILE = ("auto", "off")  # experiment.plan's compile settings a suite honours: its steps run eager


def plan(
    suite: str,
    schedule: str,
    methods: list[str] | None = None,
    *,
    protocol: Protocol = DEFAULT_PROTOCOL,
    execution: Execution = DEFAULT_EXECUTION,
    overrides: dict | None = None,
) -> SuitePlan:
    """Validate every choice (ValueError with the valid options) before any work: the suite's rows (None:
    DEFAULT_ROWS) under `schedule`. Of the settings, a suite honours one meaning of `compile` and `noise` each: its
    steps run eager (auto or off; on is refused) and its labels are standardised per task with noise std
    NOISE_FRACTION after that, which is the relative construction (absolute is refused); it trains one row at a time
    (methods at once 1)."""
    s = suites.get(suite)
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    arch, noise, compile = protocol.arch, protocol.noise, execution.compile
    if compile not in SUITE_COMPILE:
        raise ValueError(f"compile {compile!r} is not available on a suite (its steps run eager); valid: auto, off")
    if execution.methods_at_once not in (1, "auto"):
        raise ValueError(f"a suite trains one row at a time, not {execution.methods_at_once}; valid: 1")
    if noise != zoo.DEFAULT_NOISE:
        raise ValueError(
            f"label noise {noise!r} is not available on a suite (labels standardised per task, noise std "
            f"{zoo.NOISE_FRACTION:g} after that); valid: {zoo.DEFAULT_NOISE}"
        )
    if protocol.validation:
        raise ValueError("a validation set is scored on single-task runs (run, sweep), not on a suite")
    chosen = planning.chosen(methods, DEFAULT_ROWS, f"{', '.join(DEFAULT_ROWS)} (and the registry's methods)")
    for r in chosen:
        method_of(r)
    reserved = {"tasks": f"the suite's task count ({len(s.tasks)})"}
    overrides = planning.check_overrides(overrides, [method_of(r)[0] for r in chosen], reserved)
    configs, sizes, routes = {}, {}, {}
    for r in chosen:
        name, fixed = method_of(r)
        settings = overrides | fixed | {"tasks": len(s.tasks)}
        suite_source = settings.get("instruction_source") == PARAMETER_SOURCE  # the suite's, not the method's
        own = {k: v for k, v in settings.items() if not (suite_source and k == "instruction_source")}
        configs[r] = planning.make_config(r, name, own)
        if suite_source and hasattr(configs[r], "instruction_source"):  # past the method's checks (made for cards)
            configs[r].instruction_source = PARAMETER_SOURCE
        source = getattr(configs[r], "instruction_source", None)
        if source not in (None, *SUITE_SOURCES):  # checked before any work (instruction_table would, after it)
            raise ValueError(
                f"{r}: instruction_source {source!r} is not available on a suite (each task reads its own sentence, "
                f"a task code or its parameters' code); valid: {', '.join(SUITE_SOURCES)}"
            )
        routes[r] = settings.get("held_out_route", "own")
        if routes[r] not in ROUTES:
            raise ValueError(f"{r}: held_out_route {routes[r]!r}; valid: {', '.join(ROUTES)}")
        if (source == PARAMETER_SOURCE or routes[r] != "own") and s.name not in parametric.names():
            raise ValueError(
                f"{r} reads each task's parameters, which only a parametric suite has, not {s.name!r}; valid: "
                f"{', '.join(parametric.names())}"
            )
        sizes[r] = planning.dry_build(arch, {name: configs[r]})[name]  # variants share their method's name
    dev = engine.resolve_device(execution.device, execution.cuda)
    planning.check_memory(sizes, protocol.n_seeds, protocol.dtype, dev, tasks=len(s.tasks))  # a member per seed
    shared = planning.resolve(protocol, execution, dev)
    return SuitePlan(
        **shared,
        suite=s,
        schedule=schedule,
        rows=chosen,
        configs=configs,
        routes={r: route for r, route in routes.items() if route != "own"},
    )


# ---------------------------------------------------------------------------------------------------------------
# Running.


def stages(p: SuitePlan) -> list[list[int]]:
    """The tasks each stage trains on (suites.Suite.schedule_stages)."""
    return p.suite.schedule_stages(p.schedule)


def trained_labels(p: SuitePlan, data: engine.StackedData) -> torch.Tensor:
    """The training labels (E, n) of the tasks some stage trains on, from every task's `data`: a held-out task's
    labels reach no row (not even mean's constant)."""
    trained = torch.tensor(sorted({t for group in stages(p) for t in group}), device=data.task_train.device)
    return data.y_train[:, torch.isin(data.task_train[0], trained)]  # every member holds the tasks in one order


def train_standardised_mse(
    p: SuitePlan, model, data: engine.StackedData, route: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """((E, T) test MSE with every task's labels standardised by the trained tasks' pooled statistics, NaN for the
    trained tasks; (E, 2) those statistics), or None when every task is trained (no held-out task)."""
    T = len(p.suite.tasks)
    trained = sorted({t for group in stages(p) for t in group})
    if len(trained) == T:
        return None
    own = suite_tasks.own_statistics(p.suite).to(data.y_train.device)
    pooled = suite_tasks.pooled_statistics(data.y_train, data.task_train, own, trained)  # (E, 2)
    y = suite_tasks.restandardise(data.y_test, data.task_test, own, pooled).to(data.y_test.dtype)
    mse = suite_tasks.task_mse(model, data, T, route, y)
    mse[:, trained] = math.nan
    return mse, pooled.cpu()


def _run_rows(p: SuitePlan, todo: list[str], progress: bool, log) -> None:
    if todo:
        with engine.num_threads(engine.auto_threads(p.arch, len(p.seeds), p.threads)):
            needed = p.backbones.needed(p.members, p.store)
            with progress_bar(
                total=engine.steps(p.budget.pretrain, zoo.SOURCE_TRAIN) * (1 if needed else 0),
                desc=f"pretrain {p.arch} x{len(p.seeds)}",
                unit="step",
                disable=not progress,
                leave=False,
            ) as bar:
                pre = p.pretrain(progress=bar.update, log=log)
            trained = [r for r in todo if adapters.get(method_of(r)[0]).trains]
            per_row = sum(engine.steps(p.budget.adapt, p.suite.train_per_task * len(s)) for s in stages(p))  # a row's
            with progress_bar(total=per_row * len(trained), desc="adapt", unit="step", disable=not progress) as bar:
                for r in todo:
                    bar.set_description(f"{p.suite.name} {p.schedule} {r} x{len(p.seeds)}")
                    run_row(p, r, pre, bar.update if r in trained else None, log)


@engine.flush_denormals()
def adapt(p: SuitePlan, row: str, pre: engine.Pretrained, progress=None) -> dict:
    """Train one row on every stage and evaluate; returns per-member results (lists, E first) and counts."""
    name, _ = method_of(row)
    method, config = adapters.get(name), p.configs[row]
    dtype, T = DTYPES[p.dtype], len(p.suite.tasks)
    members = pre.members
    if len(engine.padded(members)) > len(members):  # as engine.adapt: no stack narrower than MIN_STACK
        pre = pre.select(engine.padded(members))
    seeds = [s for _, s in pre.members]
    everything = suite_tasks.task_data(p.suite, seeds, list(range(T)), dtype=dtype, device=p.device)
    init = [generator("init", method.init_stream(), p.arch, "suite", p.suite.name, s) for s in seeds]
    model = method.build(pre.model(device=p.device, dtype=dtype), config, init, trained_labels(p, everything))
    routes = isinstance(config, queryable.QueryableConfig)
    route = suite_tasks.held_out_routes(
        p.suite, p.schedule, p.route(row)
    )  # (T,): the task index each task is evaluated with
    base = (
        suite_tasks.instruction_table(p.suite, config) if reads_instruction(config) else None
    )  # (T, d_c): the tasks' own
    if base is not None:
        suite_tasks.bind(model, base, len(seeds))
    out = {"initial_task_mse": suite_tasks.task_mse(model, everything, T, route)}  # (E, T)
    stage_mse, stage_usage, curves = [], [], []

    def evaluate_stage(k: int) -> None:  # every task on stage k's final parameters
        stage_mse.append(suite_tasks.task_mse(model, everything, T, route))
        if routes:
            stage_usage.append(suite_tasks.usage(model, everything, T))

    if method.trains:
        lr, wd = p.budget.adapt.lr, p.budget.adapt.weight_decay
        # each stage a fresh optimiser; a task's own parameters move only in its stages (isolate_tasks)
        optimizer = lambda tasks: lambda: isolate_tasks(method.optimizer(model, config, lr, wd, p.eps), model, tasks)
        plan_stages = [
            engine.Stage(
                suite_tasks.task_data(p.suite, seeds, tasks, dtype=dtype, device=p.device),
                p.budget.adapt,
                optimizer(tasks),
                [generator("order", "suite", p.suite.name, p.schedule, k, s) for s in seeds],
                p.budget.eval_every,
                after=functools.partial(evaluate_stage, k),
            )
            for k, tasks in enumerate(stages(p))
        ]
        curves = engine.fit(model, plan_stages, progress=progress, capture=p.capture)
    else:
        for k in range(len(stages(p))):
            evaluate_stage(k)
    out["stage_task_mse"] = torch.stack(stage_mse, 1)  # (E, S, T)
    if (standardised := train_standardised_mse(p, model, everything, route)) is not None:
        out["train_standardised_task_mse"], out["train_label_stats"] = standardised  # (E, T), (E, 2)
    if routes:
        out["usage"] = torch.stack(stage_usage, 1)  # (E, S, T, M)
    if base is not None:
        n = min(len(t.paraphrases) for t in p.suite.tasks)
        para = []
        for i in range(n):
            if config.instruction_source in ("random", PARAMETER_SOURCE):  # a code has no words to paraphrase
                continue
            suite_tasks.bind(
                model,
                suite_tasks.instruction_table(p.suite, config, [t.paraphrases[i] for t in p.suite.tasks]),
                len(seeds),
            )
            para.append(suite_tasks.task_mse(model, everything, T))
        if para:
            out["paraphrase_task_mse"] = torch.stack(para).mean(0)  # (E, T)
        suite_tasks.bind(model, base.roll(-1, dims=0), len(seeds))  # task t routes with task t + 1's instruction
        out["shuffled_task_mse"] = suite_tasks.task_mse(model, everything, T)
        suite_tasks.bind(model, base, len(seeds))
    out["diverged_stage"] = [
        next((k for k, c in enumerate(curves) if c.diverged_epoch[e] is not None), None) for e in range(len(seeds))
    ]
    out["curves"] = curves
    out["trainable_params"] = adapters.trainable_parameter_count(model)
    out["total_params"] = adapters.total_parameter_count(model)
    out["chosen"] = member.recorded(model)  # how a method written for one member ran
    out["members"] = len(members)
    return out


def measure_cost(p: SuitePlan, row: str, pre: engine.Pretrained, log) -> dict | None:
    """The row's cost (qlbench/cost.py) on the suite's first member: a fresh one-member model, its instruction
    table bound, beside the frozen backbone, on every task's data. None, said through `log`, if it fails."""
    name, _ = method_of(row)
    method, config, dtype = adapters.get(name), p.configs[row], DTYPES[p.dtype]

    def measure() -> dict:
        one = pre.select(pre.members[:1])
        seed = one.members[0][1]
        data = suite_tasks.task_data(p.suite, [seed], list(range(len(p.suite.tasks))), dtype=dtype, device=p.device)
        init = [generator("init", method.init_stream(), p.arch, "suite", p.suite.name, seed)]
        model = method.build(one.model(device=p.device, dtype=dtype), config, init, trained_labels(p, data))
        if reads_instruction(config):
            suite_tasks.bind(model, suite_tasks.instruction_table(p.suite, config), 1)
        frozen = one.model(device=p.device, dtype=dtype)
        repeats = cost.repeats_for(p.budget.name)
        return cost.measure_model(model, frozen, name, config, data, p.budget.adapt.batch_size, repeats)

    return runner.cost(row, measure, log)


def run_row(p: SuitePlan, row: str, pre: engine.Pretrained, progress, log) -> None:
    """Adapt one row and commit its record (a failure is recorded as a failed row)."""
    t0 = time.perf_counter()
    config = p.cell_config(row)
    # suites: eager steps, labels standardised per task with their own noise (suites.py), no --noise option
    chosen = {"eps": p.eps, "backbone_init": p.backbone_init, "noise": "suite-standardised", "capture": p.capture}
    chosen["backbone_commits"] = pre.commits()  # which code trained the backbones (engine.Pretrained.git)
    chosen["cards"] = p.unit_cards(row)
    run = lambda: record.RunInfo(config, p.seeds, p.device, chosen=chosen)
    failed = lambda message, wall_time_s: write_json(
        record.make_record(run(), record.TrainInfo("failed", message, wall_time_s)), p.record_path(row)
    )
    if (res := runner.attempt(row, lambda: adapt(p, row, pre, progress), failed, log)) is None:
        return
    per_seed = []
    for e, seed in enumerate(p.seeds):
        stage = res["diverged_stage"][e]
        entry = {
            "seed": seed,
            "status": "ok" if stage is None else "diverged",
            "diverged_stage": stage,
            "initial_task_mse": res["initial_task_mse"][e].tolist(),
            "stage_task_mse": res["stage_task_mse"][e].tolist(),
            "stage_curves": [
                {"epochs": c.epochs, "train": c.train_mse[e].tolist(), "test": c.test_mse[e].tolist()}
                for c in res["curves"]
            ],
        }
        for key in (
            "usage",
            "paraphrase_task_mse",
            "shuffled_task_mse",
            "train_standardised_task_mse",
            "train_label_stats",
        ):
            if key in res:
                entry[key] = res[key][e].tolist()
        per_seed.append(_finite(entry))
    bad = [s["seed"] for s in per_seed if s["status"] == "diverged"]
    if bad:
        log(f"{row} on {p.suite.name} ({p.schedule}): seed(s) {bad} diverged; the other seeds completed")
    chosen |= res["chosen"]
    train = record.TrainInfo(
        status="diverged" if bad else "ok",
        message=f"diverged seeds: {bad}" if bad else "",
        wall_time_s=time.perf_counter() - t0,
        stacked_members=res["members"],
        trainable_params=res["trainable_params"],
        total_params=res["total_params"],
        cost=measure_cost(p, row, pre, log),
    )
    rec = record.make_record(run(), train)
    rec["train_info"]["per_seed"] = per_seed  # suite fields (nested lists), made JSON-safe by _finite
    rec["train_info"]["tasks"] = p.suite.task_names
    write_json(rec, p.record_path(row))


def _finite(v):
    """Nested lists and dicts with every non-finite float as None (JSON has no NaN)."""
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return None if isinstance(v, float) and not math.isfinite(v) else v
