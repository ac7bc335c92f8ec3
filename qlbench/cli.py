"""`qlbench` command line: functions | run | sweep | verify | bench.

Bad input (unknown function, arch, method, budget, device, hyper-parameter, or a value out of range) prints one
line naming the problem and the valid choices, and exits with code 2; no traceback.
"""

from __future__ import annotations

import argparse
import ast
import sys
import time
from pathlib import Path

from qlbench import __version__


class UsageError(Exception):
    """Bad command-line input: reported as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors: one line, exit 2, no usage dump
        raise UsageError(message)


def parse_overrides(items: list[str]) -> dict:
    """['top_k=3', 'tau_lang=0.5'] -> {'top_k': 3, 'tau_lang': 0.5}; values are Python literals or strings."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--hp expects key=value, got {item!r}")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def cmd_functions(args) -> int:
    from qlbench import zoo

    rows = []
    for name in zoo.names():
        c = zoo.card(name)
        box = " x ".join(f"[{lo:g}, {hi:g}]" for lo, hi in c.bounds)
        where = "; ".join("(" + ", ".join(f"{v:.6g}" for v in loc) + ")" for loc in c.optimum_locations)
        rows.append((name, box, f"{c.optimum_value:.10g} at {where}"))
    widths = [max(len(r[i]) for r in rows + [("function", "domain", "optimum")]) for i in range(3)]
    for r in [("function", "domain", "optimum")] + rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    return 0


def cmd_run(args) -> int:
    """`run` is a sweep over one function."""
    args.functions = args.function
    return cmd_sweep(args)


def cmd_sweep(args) -> int:
    from qlbench import experiment, report, results, zoo

    split = lambda text: [v.strip() for v in text.split(",") if v.strip()]
    functions = zoo.names() if args.functions == "all" else split(args.functions)
    methods = split(args.methods) if args.methods else None
    try:
        plan = experiment.plan(functions=functions, arch=args.arch, methods=methods, seeds=args.seeds,
                               budget=args.budget, device=args.device, dtype=args.dtype, out_dir=args.out,
                               overrides=parse_overrides(args.hp), compile=args.compile,
                               threads=args.threads)
    except ValueError as err:
        raise UsageError(str(err)) from None
    b = plan.budget
    print(f"qlbench {args.command}: {', '.join(plan.functions)} on {plan.arch}, budget {b.name} (pretrain "
          f"{b.pretrain.epochs} epochs, adapt {b.adapt.epochs} epochs), seeds {plan.seeds}, methods "
          f"{', '.join(plan.methods)}, device {plan.device}{', compiled' if plan.compile else ''}", flush=True)
    t0 = time.perf_counter()
    paths = experiment.run(plan, progress=not args.no_progress, log=lambda m: print(m, file=sys.stderr, flush=True))
    frame = results.load([p for p in paths if p.exists()])
    print()
    print(report.markdown(report.method_table(frame)))
    print(f"\nwall time {time.perf_counter() - t0:.1f} s; records in {plan.out_dir / 'records' / plan.arch}")
    return 0 if (frame["cell_status"] != "failed").all() else 1


def add_experiment_options(p: argparse.ArgumentParser) -> None:
    from qlbench import adapters, engine
    from qlbench.backbones import ARCHS

    methods_help = "; ".join(f"{n}: {m.summary}" for n, m in adapters.REGISTRY.items())
    p.add_argument("--arch", default="deep-narrow", help=f"one of: {', '.join(ARCHS)} (default deep-narrow)")
    p.add_argument("--methods", metavar="M1,M2",
                   help=f"comma-separated (default: {','.join(adapters.DEFAULT_METHODS)}). {methods_help}")
    p.add_argument("--seeds", type=int, help="number of seeds 0..N-1 (default: the budget's)")
    p.add_argument("--budget", default="quick", help=f"one of: {', '.join(engine.BUDGETS['deep-narrow'])} (default quick)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda (default auto)")
    p.add_argument("--compile", default="auto", help="torch.compile the training step: auto (on CUDA only), on, off")
    p.add_argument("--threads", type=int, help="intra-op threads (default: 1 for a deep-narrow stack below 16 "
                                               "members, else PyTorch's default)")
    p.add_argument("--dtype", default="float32", help="float32 or float64 (default float32)")
    p.add_argument("--out", default="results", type=Path, help="results folder (default ./results)")
    p.add_argument("--hp", action="append", default=[], metavar="KEY=VALUE",
                   help="method hyper-parameter override, e.g. --hp top_k=3 --hp r=4 (applies to every method "
                        "that has the field)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    from qlbench import bench, verify, zoo

    parser = Parser(prog="qlbench", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"qlbench {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    p = sub.add_parser("functions", help="list the function zoo (name, domain, optimum)")
    p.set_defaults(func=cmd_functions)

    p = sub.add_parser("run", help="pretrain, adapt with every method over seeds, print a mean ± std table",
                       description="Pretrain a backbone on the source function, adapt it to the shifted target "
                                   "with each method over several seeds (stacked), write one JSON record per "
                                   "method and print a mean ± std table.")
    p.add_argument("--function", required=True, metavar="NAME", help=f"one of: {', '.join(zoo.names())}")
    add_experiment_options(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("sweep", help="run several functions (default: all nine) stacked functions x seeds",
                       description="Like `run`, for several functions at once: every method trains one stack of "
                                   "all functions x seeds. Finished cells are skipped, so a sweep resumes.")
    p.add_argument("--functions", default="all", metavar="F1,F2",
                   help=f"comma-separated, or all (default): {', '.join(zoo.names())}")
    add_experiment_options(p)
    p.set_defaults(func=cmd_sweep)

    verify.add_parser(sub)
    bench.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return args.func(args)
    except UsageError as err:
        cmd = f"qlbench {args.command}" if "args" in locals() else "qlbench"
        print(f"{cmd}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("qlbench: interrupted; finished cells are saved and will be skipped on the next run", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
