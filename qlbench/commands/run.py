"""`qlbench run` (one function) and `qlbench sweep` (several, stacked functions x seeds): plan, train, print the
method table, exit 0 when every cell trained (diverged seeds included), 1 when a cell failed."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from qlbench.commands import UsageError, parse_overrides, split_list, usage_errors


def register(subparsers) -> None:
    from qlbench import zoo

    p = subparsers.add_parser(
        "run",
        help="pretrain, adapt with every method over seeds, print a mean ± std table",
        description="Pretrain a backbone on the source function, adapt it to the shifted "
        "target with each method over several seeds (stacked), write one JSON "
        "record per method and print a mean ± std table.",
    )
    p.add_argument("--function", required=True, metavar="NAME", help=f"one of: {', '.join(zoo.names())}")
    p.add_argument(
        "--instruction",
        metavar="TEXT",
        help="the instruction sentence instruct-queryable routes with, instead of the function card's",
    )
    add_experiment_options(p)
    p.set_defaults(func=lambda args: run(args, [args.function]))

    p = subparsers.add_parser(
        "sweep",
        help="run several functions (default: all nine) stacked functions x seeds",
        description="Like `run`, for several functions at once: every method trains one "
        "stack of all functions x seeds. Finished cells are skipped, so a sweep "
        "resumes.",
    )
    p.add_argument(
        "--functions",
        default="all",
        metavar="F1,F2",
        help=f"comma-separated, or all (default): {', '.join(zoo.names())}",
    )
    add_experiment_options(p)
    p.set_defaults(func=lambda args: run(args, zoo.names() if args.functions == "all" else split_list(args.functions)))


def add_experiment_options(p: argparse.ArgumentParser) -> None:
    from qlbench import adapters, engine
    from qlbench.backbones import ARCHS

    methods_help = "; ".join(f"{n}: {m.summary}" for n, m in adapters.REGISTRY.items())
    p.add_argument("--arch", default="deep-narrow", help=f"one of: {', '.join(ARCHS)} (default deep-narrow)")
    p.add_argument(
        "--methods",
        metavar="M1,M2",
        help=f"comma-separated (default: {','.join(adapters.DEFAULT_METHODS)}). {methods_help}",
    )
    p.add_argument("--seeds", type=int, help="number of seeds 0..N-1 (default: the budget's)")
    p.add_argument(
        "--budget", default="quick", help=f"one of: {', '.join(engine.BUDGETS['deep-narrow'])} (default quick)"
    )
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda (default auto)")
    p.add_argument("--compile", default="auto", help="torch.compile the training step: auto (on CUDA only), on, off")
    p.add_argument(
        "--threads",
        type=int,
        help="intra-op threads (default: 1 for a deep-narrow stack below 16 members, else PyTorch's default)",
    )
    p.add_argument("--dtype", default="float32", help="float32 or float64 (default float32)")
    p.add_argument(
        "--backbone-init",
        default="default",
        help="the backbone's initialisation: default (PyTorch's, the paper's), kaiming or orthogonal "
        "(variance-preserving for GELU; deep-narrow only); part of the cache key and of a non-default cell's "
        "config hash",
    )
    p.add_argument("--out", default="results", help="results folder (default ./results)")
    p.add_argument(
        "--hp",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="method hyper-parameter override, e.g. --hp top_k=3 --hp r=4 (applies to every method that has the field)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="re-run cells that already have a finished record of the same config (replacing it)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args, functions: list[str]) -> int:
    from qlbench import experiment, report, results

    if args.methods is not None and not split_list(args.methods):
        raise UsageError("--methods is empty; give a comma-separated list, or leave it out for the default set")
    if not args.out.strip():
        raise UsageError("--out is empty; give a results folder")
    overrides = parse_overrides(args.hp)
    instruction = getattr(args, "instruction", None)
    if instruction is not None:
        if not instruction.strip():
            raise UsageError("--instruction is empty; give a sentence, or leave it out for the function card's")
        if args.methods is not None and "instruct-queryable" not in split_list(args.methods):
            raise UsageError("--instruction only changes instruct-queryable, which is not in --methods")
        overrides["instruction"] = instruction
    with usage_errors():
        plan = experiment.plan(
            functions=functions,
            arch=args.arch,
            methods=split_list(args.methods) if args.methods else None,
            seeds=args.seeds,
            budget=args.budget,
            device=args.device,
            dtype=args.dtype,
            out_dir=Path(args.out),
            overrides=overrides,
            compile=args.compile,
            threads=args.threads,
            force=args.force,
            backbone_init=args.backbone_init,
        )
    b = plan.budget
    print(
        f"qlbench {args.command}: {', '.join(plan.functions)} on {plan.arch}"
        f"{'' if plan.backbone_init == 'default' else f' ({plan.backbone_init} init)'}, budget {b.name} (pretrain "
        f"{b.pretrain.epochs} epochs, adapt {b.adapt.epochs} epochs), seeds {plan.seeds}, methods "
        f"{', '.join(plan.methods)}, device {plan.device}{', compiled' if plan.compile else ''}",
        flush=True,
    )
    t0 = time.perf_counter()
    log = lambda message: print(message, file=sys.stderr, flush=True)
    paths = experiment.run(plan, progress=not args.no_progress, log=log)
    frame = results.load([p for p in paths if p.exists()], on_damaged=log)
    print()
    if len(frame):
        print(report.markdown(report.method_table(frame)))
    print(f"\nwall time {time.perf_counter() - t0:.1f} s; records in {plan.store.root / 'records' / plan.arch}")
    failed = frame[frame["cell_status"] == "failed"].drop_duplicates("record") if len(frame) else frame
    for row in failed.itertuples():
        log(f"qlbench {args.command}: {row.function}/{row.method} failed: {row.message}")
    return 1 if len(failed) else 0
