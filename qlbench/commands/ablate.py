"""`qlbench ablate`: the instruction-router ablation (qlbench.experiments.ablation) on one function and arch, or on a
multi-task suite (--suite), one table."""

from __future__ import annotations

import sys
import time

from qlbench import text
from qlbench.commands import UsageError, check_out, options, usage_errors
from qlbench.experiments import ablation, planning, runner
from qlbench.metrics import suite_stats
from qlbench.settings import DEFAULT_PROTOCOL


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "ablate",
        help="the instruction-router ablation of instruct-queryable (eight variants)",
        description="Train instruct-queryable with every instruction variant ("
        + ", ".join(ablation.VARIANTS)
        + ") on one function and print a table "
        "with the paired difference to the card's instruction; with --suite, on a multi-task suite, where each "
        "task has its own instruction (variants "
        + ", ".join((ablation.REFERENCE, ablation.SAME, *ablation.SUITE_ROWS[1:]))
        + ").",
    )
    where = p.add_mutually_exclusive_group(required=True)
    options.add(where, "--function", "--suite")
    options.add(p, "--schedule", "--arch")
    options.add_training_options(p)
    options.add_output_options(p)
    p.set_defaults(func=run)


def run(args) -> int:
    log = lambda message: print(message, file=sys.stderr, flush=True)
    if args.schedule is not None and args.suite is None:  # given at all, even as the default's value
        raise UsageError("--schedule applies to --suite only; valid with --function: leave it out")
    if args.suite is not None:
        args.schedule = args.schedule or "joint"
        return run_suite(args, log)
    protocol, execution, overrides = options.protocol_of(args), options.execution_of(args), options.overrides_of(args)
    check_out(execution.out_dir, "results folder")
    with usage_errors():
        plans = ablation.plans(function=args.function, overrides=overrides, protocol=protocol, execution=execution)
    first = next(iter(plans.values()))
    for caveat in planning.caveats(first):
        log(f"qlbench ablate: warning: {caveat}")
    init = "" if first.backbone_init == DEFAULT_PROTOCOL.backbone_init else f", {first.backbone_init} init"
    print(
        f"qlbench ablate: {ablation.METHOD} on {args.function} ({first.arch}{init}, budget {first.budget.name}, "
        f"seeds {first.seeds}), variants {', '.join(plans)}",
        flush=True,
    )
    t0 = time.perf_counter()
    records = {}
    for name, plan in plans.items():
        log(f"variant {name}")
        for path in runner.run(plan, progress=not args.no_progress, log=log):  # none: another process has it
            records[name] = path
    if not records:
        log("qlbench ablate: no variant has a record yet (another process is training them); run again later")
        return 1
    table = ablation.table(records)
    print(text.markdown(table))
    print(f"\n{ablation.legend(table)}")
    print(f"\n{ablation.LIMITATION}")
    print(f"\nwall time {time.perf_counter() - t0:.1f} s; records in {first.store.root / 'records'}")
    failed = table.loc[table["best-train"] == "failed", "variant"]
    for name in failed:
        log(f"qlbench ablate: variant {name} failed (its record: {records[name]})")
    return 1 if len(failed) else 0


def run_suite(args, log) -> int:
    protocol, execution, overrides = options.protocol_of(args), options.execution_of(args), options.overrides_of(args)
    with usage_errors():
        plans = ablation.suite_plans(
            suite=args.suite, schedule=args.schedule, overrides=overrides, protocol=protocol, execution=execution
        )
    first = plans["variants"]
    for caveat in planning.caveats(first):
        log(f"qlbench ablate: warning: {caveat}")
    print(
        f"qlbench ablate: {ablation.METHOD} on suite {first.suite.name} ({first.schedule}, {first.arch}, budget "
        f"{first.budget.name}, seeds {first.seeds}, {first.backbone_init} init), variants "
        f"{', '.join((ablation.REFERENCE, ablation.SAME, *ablation.SUITE_ROWS[1:]))}",
        flush=True,
    )
    t0 = time.perf_counter()
    paths = [path for plan in plans.values() for path in runner.run(plan, progress=not args.no_progress, log=log)]
    if not paths:
        log("qlbench ablate: no variant has a record yet (another process is training them); run again later")
        return 1
    table = ablation.suite_table(suite_stats.load(paths, on_damaged=log))
    print(text.markdown(table))
    print(
        "\nTest MSE on standardised labels, mean ± std over seeds; paraphrased / shuffled: with every task's "
        "paraphrases / with task t given task t + 1's instruction; diff is on the average. " + ablation.legend(table)
    )
    print(f"\nwall time {time.perf_counter() - t0:.1f} s; records in {first.store.root / 'suites'}")
    failed = table.loc[table["average"] == "failed", "variant"].tolist()
    for name in failed:
        log(f"qlbench ablate: variant {name} failed")
    return 1 if failed else 0
