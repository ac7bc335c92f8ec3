"""Suites on the stacked engine: one backbone, T tasks, a joint or sequential schedule, the stage x task matrix.

A suite run adapts one method on a stack of seeds (member e = seed e) to every task of a suite (suites.py):

    joint       one stage: shuffled minibatches drawn from all T tasks' training sets (T x 400 samples), each sample
                carrying its task index, so a task-conditioned layer or an instruction router reads each sample's own
                task (ForwardContext.task).
    sequential  T stages: stage t trains on task t only. Everything trainable (adapters, routers, gates, keys,
                atoms) carries over from stage t - 1; the backbone stays frozen. qlbench interpretation: each stage
                starts a fresh optimiser (AdamW's moments reset, the same learning rate), as a practitioner
                fine-tuning the adapted model on the next task would; the paper does not say. Parameters owned
                by one task (lora-per-task's factors, task-lora's cores) are decayed only in stages that train
                that task (adapters.base.isolate_tasks), so an untrained task's own parameters stay bit for bit.
    held-out    one stage, joint over the first T - 1 tasks; the last task is never trained on and is evaluated
                zero-shot (an instruction method with its own sentence; lora-per-task and task-lora with that task's
                untouched factors or core, i.e. the frozen backbone and the shared LoRA).

Each stage runs the single-task budget's adaptation epochs. Before training and after every stage, every task's
test MSE is evaluated on the stage's final parameters: the stage x task matrix R (S, T) of the continual-learning
literature (GEM, Lopez-Paz & Ranzato 2017), plus the untrained model's row. Instruction methods are evaluated again
after the last stage with every task's paraphrases (same task, other words) and with the instructions shuffled
across tasks (task t given task t + 1's); routed methods record their block-averaged atom usage per (stage, task).

Rows are registered methods, plus VARIANTS: a method with a setting. `task-code` is instruct-queryable with each
task's sentence replaced by a fixed seeded random vector of the sentence embedding's norm (identity without
language), `text-lora-code` the same for text-lora; `no-instruction`, `no-language-prior` and `instruction-only`
are the instruction ablation's structural variants (ablation.py). The same-instruction control is a suite of its
own (`<suite>-same-instruction`, suites.py).

The code controls cannot transfer by construction: a held-out task's random code was never trained on, so a
language row beating them on held-out tasks does not separate the sentence's meaning from its being a task
identifier. Three rows transfer without words, on the parametric suites only (parametric.py; PARAMETRIC_ROWS, refused
elsewhere because they read each task's parameters):
    param-code        instruct-queryable fed parametric.codes (a fixed seeded linear projection of the task's true
                      parameters into the embedding's 384 dimensions) instead of e(c): an identity code that is
                      smooth in parameter space, so it can interpolate; what "a task descriptor that carries the
                      parameters" gives the router, with no language at all.
    text-lora-params  text-lora fed the same codes: the oracle descriptor for the hypernetwork, an upper bound for
                      what text-lora's sentences could carry.
    nearest-task      lora-per-task (one LoRA per task, trained as that row is), with every task no stage trains
                      evaluated through the adapter of its nearest trained task in parameter space (parametric.closest
                      over parametric.distance; the first of equally near ones): the nearest-neighbour baseline a
                      descriptor must beat to have transferred more than a lookup. qlbench interpretation: a routing
                      rule of the evaluation (`held_out_route` "nearest", a setting multitask applies and hashes; the
                      trained model is lora-per-task's), not a method of its own, so its training is lora-per-task's
                      step for step; a held-out task's own, never-trained factors stay in the model (and in its
                      parameter count) and are never read. Under joint every task is trained, so it is lora-per-task.
The "params" instruction source is the suite's (a function card has no parameters): it is set on the method's config
after the method's own checks, and `instruction_table` is its only reader; paraphrases are not evaluated for it
(the paraphrases state the same parameters).

Labels under two standardisations (held-out tasks): every task's labels are standardised by its own clean mean and
std over the box (suites.py), which for a never-trained task is an oracle a zero-shot method would not have. So for
every task no stage trains, the final test MSE is also recorded with that task's labels standardised by the trained
tasks' statistics instead (`train_standardised_task_mse` per seed, null for trained tasks, beside
`train_label_stats`): the pooled mean m and std s (population) of the trained tasks' training labels in raw units
(a label y of task t is sd_t y + mu_t raw), the held-out labels as (sd_h y + mu_h - m) / s, and the model's output
read in those units as it stands (`restandardise`). qlbench interpretation: the model's output for a held-out task
is taken as it comes; mapping it back through the task's own (mu_h, sd_h) would be the oracle again. A record
without the field (written before it) reads as missing.

Over 500 lines: one workload (plan, data and instructions, evaluation per stage, records) whose parts all read the
SuitePlan; the generic parts live in runner.py and engine/.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qlbench import adapters, cost, engine, instructions, parametric, suites, zoo
from qlbench.adapters import instruct, member, queryable
from qlbench.adapters.base import isolate_tasks
from qlbench.backbones import ARCHS, DEFAULT_INIT, check_init
from qlbench.experiments import planning
from qlbench.progress import bar as progress_bar
from qlbench.records import results, runner
from qlbench.records.store import Store, check_writable, stable_hash, write_json
from qlbench.seeding import generator
from qlbench.stacked import ForwardContext

SCHEDULES = ("joint", "sequential", "held-out")
# the instruction-router ablation's structural variants: instruct-queryable's settings, run on one function
# (ablation.VARIANTS) and on a suite (`qlbench ablate --suite`)
STRUCTURAL_VARIANTS = {
    "no-instruction": {"tau_lang": 0.0, "lambda_ctx": 0.0},
    "no-language-prior": {"tau_lang": 0.0},
    "instruction-only": {"query": "instruction-only"},
}
PARAMETER_SOURCE = "params"  # a suite row's instruction source: each task's parameter code (parametric.codes)
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
class SuitePlan:
    """A validated suite experiment: everything resolved before any work starts."""

    suite: suites.Suite
    schedule: str
    arch: str
    rows: list[str]
    seeds: list[int]
    budget: engine.Budget
    configs: dict[str, object]  # row -> its method's validated config
    device: torch.device
    dtype: str
    out_dir: Path
    threads: int | None = None
    force: bool = False
    backbone_init: str = DEFAULT_INIT
    eps: float = adapters.EPS
    capture: bool = False  # record the training step in CUDA graphs (engine/step.py; CUDA only; not hashed)
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
        dtype = planning.DTYPES[self.dtype]
        return engine.Backbones(self.arch, self.budget.pretrain, dtype, self.backbone_init, source="suite")

    def pretrain(self, **kwargs) -> engine.Pretrained:
        return engine.pretrain(
            self.backbones, self.members, device=self.device, store=self.store, capture=self.capture, **kwargs
        )


SUITE_SOURCES = ("card", "random", PARAMETER_SOURCE)  # the instruction sources a suite row takes (instruction_table)
SUITE_COMPILE = ("auto", "off")  # experiment.plan's compile settings a suite honours: its steps run eager


def plan(
    *,
    suite: str,
    schedule: str,
    arch: str,
    methods: list[str] | None = None,
    seeds: int | None = None,
    budget: str = "quick",
    device: str = "auto",
    dtype: str = "float32",
    out_dir: str | Path = "results",
    overrides: dict | None = None,
    threads: int | None = None,
    force: bool = False,
    backbone_init: str = DEFAULT_INIT,
    eps: float = adapters.EPS,
    compile: str = "auto",
    noise: str = zoo.DEFAULT_NOISE,
    capture: str = "auto",
) -> SuitePlan:
    """Validate every choice (ValueError with the valid options) before any work. `compile` and `noise` take
    experiment.plan's values, of which a suite honours one meaning each: its steps run eager (auto or off; on is
    refused) and its labels are standardised per task with noise std NOISE_FRACTION after that, which is the
    relative construction (absolute is refused)."""
    s = suites.get(suite)
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; valid: {', '.join(ARCHS)}")
    check_init(arch, backbone_init)
    planning.check_settings(eps=eps, dtype=dtype, threads=threads)
    if compile not in SUITE_COMPILE:
        raise ValueError(f"compile {compile!r} is not available on a suite (its steps run eager); valid: auto, off")
    zoo.check_noise(noise)
    if noise != zoo.DEFAULT_NOISE:
        raise ValueError(
            f"label noise {noise!r} is not available on a suite (labels standardised per task, noise std "
            f"{zoo.NOISE_FRACTION:g} after that); valid: {zoo.DEFAULT_NOISE}"
        )
    chosen = list(DEFAULT_ROWS if methods is None else methods)
    if not chosen:
        raise ValueError(f"no method given; valid: {', '.join(DEFAULT_ROWS)} (and the registry's methods)")
    for r in chosen:
        method_of(r)
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"method listed twice in {','.join(chosen)}")
    b = engine.budget(budget, arch)
    n_seeds = planning.seed_count(b, seeds)
    reserved = {"tasks": f"the suite's task count ({len(s.tasks)})"}
    overrides = planning.check_overrides(overrides, [method_of(r)[0] for r in chosen], reserved)
    configs, sizes, routes = {}, {}, {}
    for r in chosen:
        name, fixed = method_of(r)
        settings = overrides | fixed | {"tasks": len(s.tasks)}
        suite_source = settings.get("instruction_source") == PARAMETER_SOURCE  # the suite's, not the method's
        try:
            configs[r] = adapters.get(name).make_config(
                **{k: v for k, v in settings.items() if not (suite_source and k == "instruction_source")}
            )
        except (TypeError, ValueError) as err:
            raise ValueError(f"{r}: {err}") from None
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
    dev = engine.resolve_device(device)
    planning.check_memory(sizes, n_seeds, dtype, dev, tasks=len(s.tasks))  # one member per seed, T tasks' data
    use_capture = engine.use_capture(capture, dev)
    check_writable(Path(out_dir))
    return SuitePlan(
        suite=s,
        schedule=schedule,
        arch=arch,
        rows=chosen,
        seeds=list(range(n_seeds)),
        budget=b,
        configs=configs,
        device=dev,
        dtype=dtype,
        out_dir=Path(out_dir),
        threads=threads,
        force=force,
        backbone_init=backbone_init,
        eps=float(eps),
        capture=use_capture,
        routes={r: route for r, route in routes.items() if route != "own"},
    )


# ---------------------------------------------------------------------------------------------------------------
# Data and instructions.


def task_data(suite: suites.Suite, seeds: list[int], tasks: list[int], *, dtype, device) -> engine.StackedData:
    """The given tasks' data for each seed (member), concatenated task after task, with each sample's task index."""
    splits, ids = [], []
    for seed in seeds:
        parts = [suite.task_data(t, seed, dtype=dtype, device=device) for t in tasks]
        splits.append(zoo.Split(*(torch.cat([getattr(p, k) for p in parts]) for k in zoo.Split._fields)))
        ids.append(
            tuple(
                torch.cat([torch.full((len(getattr(p, k)),), t, dtype=torch.long) for t, p in zip(tasks, parts)])
                for k in ("y_train", "y_test")
            )
        )
    return engine.StackedData.stack(splits, ids)


def parameter_codes(suite: suites.Suite) -> torch.Tensor:
    """(T, 384) float64: each task's parameter code (parametric.codes) at the sentence embedding's dimension;
    ValueError naming the parametric suites for a suite without task parameters."""
    if suite.name not in parametric.names():
        raise ValueError(
            f"suite {suite.name!r} has no task parameters; valid: {', '.join(parametric.names())} (parametric suites)"
        )
    return parametric.codes([parametric.params(t) for t in suite.tasks], instructions.DIM)


def instruction_table(suite: suites.Suite, config, texts: list[str] | None = None) -> torch.Tensor:
    """The router's e (T, d_c) float64 for the suite's tasks: each task's sentence (or `texts[t]`) through the
    frozen encoder, or for `instruction_source` random (the task-code row) a seeded random vector per task of the
    sentence embedding's norm, or for params (param-code, text-lora-params) each task's parameter code."""
    if config.instruction_source == PARAMETER_SOURCE:
        return instruct.router_input(parameter_codes(suite), config.instruction_dim)
    texts = suite.instructions() if texts is None else texts
    raw = instructions.embed(texts).to(torch.float64)  # (T, 384)
    if config.instruction_source == "random":
        codes = torch.stack(
            [
                torch.randn(raw.shape[1], generator=generator("task-code", suites.data_name(suite.name), t.name)).to(
                    torch.float64
                )
                for t in suite.tasks
            ]
        )
        raw = codes / codes.norm(dim=1, keepdim=True) * raw.norm(dim=1, keepdim=True)
    elif config.instruction_source != "card":
        raise ValueError(
            f"a suite row reads each task's own sentence or a task code, not {config.instruction_source!r}"
        )
    return instruct.router_input(raw, config.instruction_dim)


def bind(model, table: torch.Tensor, members: int) -> None:
    """Every member conditions each sample on its task's row of `table` (T, d_c): the method's shared module that
    keeps the instruction (queryable's memory, text-lora's hypernetwork) binds it as (E, T, d_c)."""
    keepers = [m for m in model.shared.values() if hasattr(m, "bind_instruction")]
    if len(keepers) != 1:
        raise ValueError(f"expected one shared module that binds an instruction, found {len(keepers)}")
    keepers[0].bind_instruction(table.expand(members, -1, -1))


# ---------------------------------------------------------------------------------------------------------------
# Evaluation.


@torch.no_grad()
def task_mse(
    model, data: engine.StackedData, tasks: int, route: torch.Tensor | None = None, y: torch.Tensor | None = None
) -> torch.Tensor:
    """(E, T) test MSE of each task: the mean squared error over its held-out samples. `route` (T,) long: the task
    index each task's samples are run with (held_out_routes; default its own); `y` (E, N): other labels for the
    test samples (default data.y_test)."""
    model.eval()
    task = data.task_test if route is None else route.to(data.task_test.device)[data.task_test]
    sq = engine.squared_errors(model, data.x_test, data.y_test if y is None else y, task=task)  # (E, N)
    model.train()
    one_hot = torch.nn.functional.one_hot(data.task_test, tasks).to(sq)  # (E, N, T): grouped by the sample's task
    return ((sq.unsqueeze(-1) * one_hot).sum(1) / one_hot.sum(1)).cpu()


def held_out_routes(suite: suites.Suite, schedule: str, rule: str) -> torch.Tensor:
    """(T,) long: the task index each task is evaluated with under `rule` (ROUTES): its own ("own"), or for
    "nearest" each task no stage of `schedule` trains the nearest trained task in parameter space
    (parametric.closest: the first of equally near ones), the trained tasks their own."""
    T = len(suite.tasks)
    route = torch.arange(T)
    if rule == "own":
        return route
    trained = sorted({t for group in suite.schedule_stages(schedule) for t in group})
    p = [parametric.params(t) for t in suite.tasks]
    for t in sorted(set(range(T)) - set(trained)):
        route[t] = trained[parametric.closest(p[t], [p[i] for i in trained])]
    return route


def own_statistics(suite: suites.Suite) -> torch.Tensor:
    """(T, 2) float64: each task's (mean, std) of its clean function over the box, by which its labels are
    standardised (suites.Suite.standardisation)."""
    return torch.tensor([suite.standardisation(t) for t in suite.tasks], dtype=torch.float64)


def pooled_statistics(y: torch.Tensor, task: torch.Tensor, own: torch.Tensor, trained: list[int]) -> torch.Tensor:
    """(E, 2) float64: per member, the mean and the population std of the raw training labels (sd_t y + mu_t,
    `own` (T, 2)) of the samples of y (E, N) whose task (E, N) is one of `trained`, pooled over those tasks."""
    raw = own[task, 1] * y.to(torch.float64) + own[task, 0]  # (E, N)
    keep = torch.isin(task, torch.tensor(trained, device=task.device)).to(torch.float64)
    n = keep.sum(1)
    mean = (raw * keep).sum(1) / n
    var = (((raw - mean.unsqueeze(1)) ** 2) * keep).sum(1) / n
    return torch.stack([mean, var.sqrt()], 1)


def restandardise(y: torch.Tensor, task: torch.Tensor, own: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """Labels y (E, N), standardised by their task's own statistics `own` (T, 2), standardised instead by each
    member's `pooled` (E, 2) mean and std: (sd_t y + mu_t - m) / s, in float64."""
    raw = own[task, 1] * y.to(torch.float64) + own[task, 0]
    return (raw - pooled[:, :1]) / pooled[:, 1:]


def train_standardised_mse(
    p: SuitePlan, model, data: engine.StackedData, route: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """((E, T) test MSE with every task's labels standardised by the trained tasks' pooled statistics, NaN for the
    trained tasks; (E, 2) those statistics), or None when every task is trained (no held-out task)."""
    T = len(p.suite.tasks)
    trained = sorted({t for group in stages(p) for t in group})
    if len(trained) == T:
        return None
    own = own_statistics(p.suite).to(data.y_train.device)
    pooled = pooled_statistics(data.y_train, data.task_train, own, trained)  # (E, 2)
    y = restandardise(data.y_test, data.task_test, own, pooled).to(data.y_test.dtype)
    mse = task_mse(model, data, T, route, y)
    mse[:, trained] = math.nan
    return mse, pooled.cpu()


@torch.no_grad()
def usage(model, data: engine.StackedData, tasks: int) -> torch.Tensor:
    """(E, T, M) block-averaged atom usage: the routing weights alpha averaged over blocks and each task's held-out
    samples (rows sum to 1)."""
    model.eval()
    ctx = ForwardContext(model.shared, None, data.task_test)
    model(data.x_test, ctx=ctx)
    model.train()
    routes = ctx.scratch[queryable.NAME].routes
    alpha = torch.stack([routes[b].alpha for b in sorted(routes)]).mean(0)  # (E, N, M)
    one_hot = torch.nn.functional.one_hot(data.task_test, tasks).to(alpha)  # (E, N, T)
    return (one_hot.transpose(1, 2) @ alpha / one_hot.sum(1).unsqueeze(-1)).cpu()


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
    dtype, T = planning.DTYPES[p.dtype], len(p.suite.tasks)
    members = pre.members
    if len(engine.padded(members)) > len(members):  # as engine.adapt: no stack narrower than MIN_STACK
        pre = pre.select(engine.padded(members))
    seeds = [s for _, s in pre.members]
    everything = task_data(p.suite, seeds, list(range(T)), dtype=dtype, device=p.device)
    init = [generator("init", name, p.arch, "suite", p.suite.name, s) for s in seeds]
    model = method.build(pre.model(device=p.device, dtype=dtype), config, init, trained_labels(p, everything))
    routes = isinstance(config, queryable.QueryableConfig)
    route = held_out_routes(p.suite, p.schedule, p.route(row))  # (T,): the task index each task is evaluated with
    base = instruction_table(p.suite, config) if reads_instruction(config) else None  # (T, d_c): the tasks' own
    if base is not None:
        bind(model, base, len(seeds))
    out = {"initial_task_mse": task_mse(model, everything, T, route)}  # (E, T)
    stage_mse, stage_usage, curves = [], [], []

    def evaluate_stage(k: int) -> None:  # every task on stage k's final parameters
        stage_mse.append(task_mse(model, everything, T, route))
        if routes:
            stage_usage.append(usage(model, everything, T))

    if method.trains:
        lr, wd = p.budget.adapt.lr, p.budget.adapt.weight_decay
        # each stage a fresh optimiser; a task's own parameters move only in its stages (isolate_tasks)
        optimizer = lambda tasks: lambda: isolate_tasks(method.optimizer(model, config, lr, wd, p.eps), model, tasks)
        plan_stages = [
            engine.Stage(
                task_data(p.suite, seeds, tasks, dtype=dtype, device=p.device),
                p.budget.adapt,
                optimizer(tasks),
                [generator("order", "suite", p.suite.name, p.schedule, k, s) for s in seeds],
                p.budget.eval_every,
            )
            for k, tasks in enumerate(stages(p))
        ]
        curves = engine.fit(model, plan_stages, progress=progress, after_stage=evaluate_stage, capture=p.capture)
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
            bind(model, instruction_table(p.suite, config, [t.paraphrases[i] for t in p.suite.tasks]), len(seeds))
            para.append(task_mse(model, everything, T))
        if para:
            out["paraphrase_task_mse"] = torch.stack(para).mean(0)  # (E, T)
        bind(model, base.roll(-1, dims=0), len(seeds))  # task t routes with task t + 1's instruction
        out["shuffled_task_mse"] = task_mse(model, everything, T)
        bind(model, base, len(seeds))
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
    method, config, dtype = adapters.get(name), p.configs[row], planning.DTYPES[p.dtype]

    def measure() -> dict:
        one = pre.select(pre.members[:1])
        seed = one.members[0][1]
        data = task_data(p.suite, [seed], list(range(len(p.suite.tasks))), dtype=dtype, device=p.device)
        init = [generator("init", name, p.arch, "suite", p.suite.name, seed)]
        model = method.build(one.model(device=p.device, dtype=dtype), config, init, trained_labels(p, data))
        if reads_instruction(config):
            bind(model, instruction_table(p.suite, config), 1)
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
    common = dict(config=config, seeds=p.seeds, device=p.device, chosen=chosen)
    failed = lambda message, wall_time_s: write_json(
        results.make_record(**common, status="failed", message=message, wall_time_s=wall_time_s), p.record_path(row)
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
    rec = results.make_record(
        **common,
        status="diverged" if bad else "ok",
        message=f"diverged seeds: {bad}" if bad else "",
        wall_time_s=time.perf_counter() - t0,
        stacked_members=res["members"],
        trainable_params=res["trainable_params"],
        total_params=res["total_params"],
        cost=measure_cost(p, row, pre, log),
    )
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
