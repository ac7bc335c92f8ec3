"""`qlbench pareto`: run a method over its r x M x k grid on one function or one suite (resumable: one record per
grid point), then write the Pareto table and the paper's two panels (quality against latency and against
trainable parameters, non-dominated frontier dashed)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from qlbench.commands import UsageError, options, split_list, usage_errors
from qlbench.experiments import pareto, pareto_stack, planning, runner
from qlbench.records.store import stable_hash
from qlbench.report import pareto as pareto_report


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "pareto",
        help="a method over its r x M x k grid on one function or suite, and the accuracy-cost Pareto figure",
        description="Run each method over its size grid (the paper's r, M in {4,8,16,32}, k in {1,2,4,8}; "
        "points with k > M skipped) on one function or one suite, one record per point (a sweep resumes), then "
        "write the Pareto table and figure: test MSE against latency per sample and against trainable parameters, "
        "with the non-dominated frontier.",
    )
    target = p.add_mutually_exclusive_group(required=True)
    options.add(target, "--function", "--suite")
    methods = dict(
        default="queryable",
        help=f"comma-separated, any of: {', '.join(pareto.GRID_AXES)} (default queryable); axes per method: "
        + "; ".join(f"{m}: {', '.join(a)}" for m, a in pareto.GRID_AXES.items()),
    )
    options.add(p, "--schedule", "--methods", methods=methods)
    p.add_argument(
        "--grid",
        metavar="'r=4,8 M=8,16 k=1,2'",
        help="narrow the paper's grid; axes not named keep the paper's values",
    )
    options.add(p, "--arch")
    options.add_training_options(p)
    options.add_output_options(
        p,
        out=dict(
            default="pareto-results",
            help="results folder of the grid's records (default ./pareto-results: a grid's many configs of one method "
            "are kept apart from the method tables' records); the table and figure go to OUT/pareto/",
        ),
    )
    p.set_defaults(func=run)


def run(args) -> int:
    log = lambda message: print(message, file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    methods = split_list(args.methods, "--methods")
    if not methods:
        raise UsageError(f"--methods is empty; valid: {', '.join(pareto.GRID_AXES)}")
    if args.schedule is not None and args.function:
        raise UsageError("--schedule applies to --suite only; valid with --function: leave it out")
    args.schedule = args.schedule or "joint"
    protocol, execution, overrides = options.protocol_of(args), options.execution_of(args), options.overrides_of(args)
    with usage_errors():
        planning.check_overrides(overrides, methods)  # each applies where a method has it, as a sweep's --hp
        grid = pareto.parse_grid(args.grid)
        target = dict(function=args.function) if args.function else dict(suite=args.suite, schedule=args.schedule)
        todo, skipped = [], {}  # every method's plans, validated before any work
        for m in dict.fromkeys(methods):
            pairs, skipped[m] = pareto.plans(
                m, grid, **target, overrides=overrides, protocol=protocol, execution=execution
            )
            todo += [(m, pt, p) for pt, p in pairs]
    for caveat in planning.caveats(todo[0][2]):  # every point has the same dtype and eps
        log(f"qlbench pareto: warning: {caveat}")
    for m, points in skipped.items():
        if points:
            log(f"qlbench pareto: {m}: {len(points)} point(s) skipped: {', '.join(points)}")
    name = args.function or f"{args.suite} ({args.schedule})"
    print(f"qlbench pareto: {name} on {args.arch}, {len(todo)} grid point(s) of {', '.join(methods)}", flush=True)
    paths, done = [], 0
    for m, grp in batches(todo, stack=bool(args.function)):
        first, last = done + 1, done + len(grp)
        span = f"point {first}/{len(todo)}" if len(grp) == 1 else f"points {first}-{last}/{len(todo)}"
        labels_ = ", ".join(pt.label for pt, _ in grp)
        log(f"qlbench pareto: {span}: {m} {labels_}" + (" (one stack)" if len(grp) > 1 else ""))
        if len(grp) == 1:
            paths += runner.run(grp[0][1], progress=not args.no_progress, log=log)  # a suite's or a single-task plan
        else:
            w = pareto_stack.StackedPoints([p for _, p in grp], [pt.values["k"] for pt, _ in grp])
            paths += runner.run(w, progress=not args.no_progress, log=log)
        done = last
    if not paths:
        log("qlbench pareto: no point has a record yet (another process is training them); run again later")
        return 1
    frame = pareto.load(paths)
    slug, title = labels(args, protocol, overrides, todo[0][2].budget.name)
    ylabel = "average task test MSE after the last stage" if args.suite else "test MSE @ best-train epoch"
    out = pareto_report.write(frame, Path(args.out) / "pareto" / slug, title, ylabel)
    print(out["markdown"])
    print(f"\nwall time {time.perf_counter() - t0:.1f} s; table and figure in {out['folder']}")
    failed = frame["mean"].isna().sum()
    if failed:
        log(f"qlbench pareto: {failed} point(s) without a finished seed")
    return 1 if failed else 0


def batches(todo: list, stack: bool) -> list[tuple[str, list]]:
    """(method, [(point, plan), ...]) in grid order: on one function, a routed method's points that differ in k
    alone train as one stack (qlbench/experiments/pareto_stack.py); every other point alone."""
    out = []
    for m in dict.fromkeys(m for m, _, _ in todo):
        pairs = [(pt, p) for n, pt, p in todo if n == m]
        grouped = pareto_stack.groups(pairs) if stack and pareto_stack.stackable(m) else [[pair] for pair in pairs]
        out += [(m, grp) for grp in grouped]
    return out


def labels(args, protocol, overrides: dict, budget: str) -> tuple[str, str]:
    """(folder name, figure title) of a grid's table: the target, arch and budget, and every setting that is not
    the default (backbone init, dtype, eps, label noise, --hp), so that two grids never share a folder."""
    name = args.function or f"{args.suite} ({args.schedule})"
    changed = options.non_default(protocol)
    settings = {k: changed[k] for k in ("backbone_init", "dtype", "eps", "noise") if k in changed}
    words = {"backbone_init": "{} init", "dtype": "{}", "eps": "eps {:g}", "noise": "{} noise"}
    said = [words[k].format(v) for k, v in settings.items()]
    tags = [str(v) if k != "eps" else f"eps{v:g}" for k, v in settings.items()]
    if overrides:
        said.append(" ".join(f"{k}={v}" for k, v in overrides.items()))
        tags.append(f"hp{stable_hash(overrides)[:8]}")
    slug = "-".join([args.function or f"{args.suite}-{args.schedule}", args.arch, *tags, budget])
    return slug, f"Pareto, {name}, {args.arch}" + (f" ({', '.join(said)})" if said else "")
