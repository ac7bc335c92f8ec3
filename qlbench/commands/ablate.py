"""`qlbench ablate`: the instruction-router ablation (qlbench.ablation) on one function and arch, one table."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from qlbench import ablation, experiment, text, zoo
from qlbench.backbones import ARCHS
from qlbench.commands import usage_errors


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "ablate",
        help="the instruction-router ablation of instruct-queryable (eight variants)",
        description="Train instruct-queryable with every instruction variant ("
        + ", ".join(ablation.VARIANTS)
        + ") on one function and print a table "
        "with the paired difference to the card's instruction.",
    )
    p.add_argument("--function", required=True, metavar="NAME", help=f"one of: {', '.join(zoo.names())}")
    p.add_argument("--arch", default="deep-narrow", help=f"one of: {', '.join(ARCHS)} (default deep-narrow)")
    p.add_argument("--budget", default="quick", help="paper, quick or smoke (default quick)")
    p.add_argument("--seeds", type=int, help="number of seeds (default: the budget's)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--out", default=Path("results"), type=Path, help="results folder (default ./results)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    log = lambda message: print(message, file=sys.stderr, flush=True)
    with usage_errors():
        plans = ablation.plans(
            function=args.function,
            arch=args.arch,
            budget=args.budget,
            seeds=args.seeds,
            out_dir=args.out,
            device=args.device,
        )
    first = next(iter(plans.values()))
    print(
        f"qlbench ablate: {ablation.METHOD} on {args.function} ({first.arch}, budget {first.budget.name}, seeds "
        f"{first.seeds}), variants {', '.join(plans)}",
        flush=True,
    )
    t0 = time.perf_counter()
    records = {}
    for name, plan in plans.items():
        log(f"variant {name}")
        (records[name],) = experiment.run(plan, progress=not args.no_progress, log=log)
    table = ablation.table(records)
    print(text.markdown(table))
    print(f"\n{ablation.LIMITATION}")
    print(f"\nwall time {time.perf_counter() - t0:.1f} s; records in {first.store.root / 'records'}")
    failed = table.loc[table["best-train"] == "failed", "variant"]
    for name in failed:
        log(f"qlbench ablate: variant {name} failed (its record: {records[name]})")
    return 1 if len(failed) else 0
