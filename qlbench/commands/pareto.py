"""`qlbench pareto`: run a method over its r x M x k grid on one function or one suite (resumable: one record per
grid point), then write the Pareto table and the paper's two panels (quality against latency and against
trainable parameters, non-dominated frontier dashed)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from qlbench import engine, experiment, multitask, pareto
from qlbench.backbones import ARCHS, INITS
from qlbench.commands import UsageError, split_list, usage_errors
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
    target.add_argument("--function", metavar="NAME", help="a function of the zoo (qlbench functions lists them)")
    target.add_argument("--suite", metavar="NAME", help="a multi-task suite (qlbench suites lists them)")
    p.add_argument("--schedule", default="joint", metavar="S", help=f"with --suite: {', '.join(multitask.SCHEDULES)}")
    p.add_argument(
        "--methods",
        default="queryable",
        metavar="M1,M2",
        help=f"comma-separated, any of: {', '.join(pareto.GRID_AXES)} (default queryable); axes per method: "
        + "; ".join(f"{m}: {', '.join(a)}" for m, a in pareto.GRID_AXES.items()),
    )
    p.add_argument(
        "--grid",
        metavar="'r=4,8 M=8,16 k=1,2'",
        help="narrow the paper's grid; axes not named keep the paper's values",
    )
    p.add_argument("--arch", default="deep-narrow", metavar="ARCH", help=f"one of: {', '.join(ARCHS)}")
    p.add_argument("--seeds", type=int, metavar="N", help="number of seeds 0..N-1 (default: the budget's)")
    p.add_argument("--budget", default="quick", metavar="B", help="paper, quick or smoke (default quick)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--threads", type=int, help="intra-op threads (default as `qlbench run`)")
    p.add_argument("--backbone-init", default="default", help=f"one of {', '.join(INITS)}")
    p.add_argument(
        "--out",
        default="pareto-results",
        help="results folder of the grid's records (default ./pareto-results: a grid's many configs of one method "
        "are kept apart from the method tables' records); the table and figure go to OUT/pareto/",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    log = lambda message: print(message, file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    methods = split_list(args.methods)
    if not methods:
        raise UsageError(f"--methods is empty; valid: {', '.join(pareto.GRID_AXES)}")
    common = dict(
        arch=args.arch,
        seeds=args.seeds,
        budget=args.budget,
        device=args.device,
        threads=args.threads,
        out_dir=Path(args.out),
        backbone_init=args.backbone_init,
    )
    with usage_errors():
        engine.check_threads(args.threads)
        grid = pareto.parse_grid(args.grid)
        target = dict(function=args.function) if args.function else dict(suite=args.suite, schedule=args.schedule)
        todo, skipped = [], {}  # every method's plans, validated before any work
        for m in dict.fromkeys(methods):
            pairs, skipped[m] = pareto.plans(m, grid, **target, **common)
            todo += [(m, pt, p) for pt, p in pairs]
    for m, points in skipped.items():
        if points:
            log(f"qlbench pareto: {m}: {len(points)} point(s) skipped: {', '.join(points)}")
    name = args.function or f"{args.suite} ({args.schedule})"
    print(f"qlbench pareto: {name} on {args.arch}, {len(todo)} grid point(s) of {', '.join(methods)}", flush=True)
    paths = []
    for i, (m, pt, p) in enumerate(todo, 1):
        log(f"qlbench pareto: point {i}/{len(todo)}: {m} {pt.label}")
        if isinstance(p, multitask.SuitePlan):
            paths += multitask.run(p, progress=not args.no_progress, log=log)
        else:
            paths += experiment.run(p, progress=not args.no_progress, log=log)
    frame = pareto.load(paths)
    init = "" if args.backbone_init == "default" else f"-{args.backbone_init}"
    slug = (args.function or f"{args.suite}-{args.schedule}") + f"-{args.arch}{init}-{todo[0][2].budget.name}"
    ylabel = "average task test MSE after the last stage" if args.suite else "test MSE @ best-train epoch"
    title = f"Pareto, {name}, {args.arch}" + ("" if not init else f" ({args.backbone_init} init)")
    out = pareto_report.write(frame, Path(args.out) / "pareto" / slug, title, ylabel)
    print(out["markdown"])
    print(f"\nwall time {time.perf_counter() - t0:.1f} s; table and figure in {out['folder']}")
    failed = frame["mean"].isna().sum()
    if failed:
        log(f"qlbench pareto: {failed} point(s) without a finished seed")
    return 1 if failed else 0
