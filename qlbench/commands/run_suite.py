"""`qlbench suite`: adapt every method to a multi-task suite (joint or sequential), print the final task table."""

from __future__ import annotations

import sys
import time

from qlbench import suites
from qlbench.backbones import DEFAULT_INIT
from qlbench.commands import options, split_list, usage_errors
from qlbench.experiments import multitask, planning, runner
from qlbench.metrics import suite_stats


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "suite",
        help="adapt every method to a multi-task suite (joint or sequential) and print the task table",
        description="Pretrain a backbone on the suite's source, adapt it with each method to all of the suite's tasks "
        "(joint: mixed minibatches; sequential: one task per stage, nothing reset), evaluate every task after every "
        "stage, write one record per method and print the final test MSE per task (mean ± std over seeds).",
    )
    schedule = dict(default="joint", help=f"one of: {', '.join(multitask.SCHEDULES)} (default joint)")
    methods = dict(
        help=f"comma-separated (default: {','.join(multitask.DEFAULT_ROWS)}); any registered method, or task-code "
        "(instruct-queryable with each task's sentence replaced by a seeded random vector: identity, no language), "
        "or a variant (multitask.VARIANTS); on a parametric suite also param-code and text-lora-params (fed a fixed "
        "projection of each task's parameters) and nearest-task (lora-per-task, each held-out task through its "
        "nearest training task's LoRA)",
    )
    options.add(
        p, "--suite", "--schedule", "--arch", "--methods", suite=dict(required=True), schedule=schedule, methods=methods
    )
    options.add_training_options(p)
    options.add_output_options(p)
    p.set_defaults(func=run)


def run(args) -> int:
    log = lambda message: print(message, file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    protocol, execution, overrides = options.protocol_of(args), options.execution_of(args), options.overrides_of(args)
    methods = split_list(args.methods, "--methods") if args.methods is not None else None  # '' is refused
    with usage_errors():
        p = multitask.plan(
            args.suite, args.schedule, methods, protocol=protocol, execution=execution, overrides=overrides
        )
    for caveat in planning.caveats(p):
        log(f"qlbench suite: warning: {caveat}")
    b = p.budget
    init = "" if p.backbone_init == DEFAULT_INIT else f" ({p.backbone_init} init)"
    print(
        f"qlbench suite: {p.suite.name} ({len(p.suite.tasks)} tasks: {', '.join(p.suite.task_names)}), schedule "
        f"{p.schedule}, {p.arch}{init}, budget {b.name} "
        f"({b.adapt.epochs} epochs per stage), seeds {p.seeds}, methods {', '.join(p.rows)}, device {p.device}",
        flush=True,
    )
    paths = runner.run(p, progress=execution.progress, log=log)
    if not paths:
        log("qlbench suite: no row has a record yet (another process is training them); run again later")
        return 1
    summary = suite_stats.summary(suite_stats.load(paths, on_damaged=log))
    print(
        f"\nTest MSE per task after the last stage, mean ± std over seeds (standardised labels: 1 = predicting the "
        f"task's mean over the box; noise floor {suites.zoo.NOISE_FRACTION**2:g})\n"
    )
    print(suite_stats.table_text(summary))
    print(f"\nwall time {time.perf_counter() - t0:.1f} s; records in {p.store.root / 'suites' / p.arch / p.suite.name}")
    failed = summary.loc[summary["average"] == "failed", "method"].tolist()
    for method in failed:
        log(f"qlbench suite: {method} failed")
    return 1 if failed else 0
