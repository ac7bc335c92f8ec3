"""`qlbench bench`: speed benchmarks side by side in one run; prints Markdown, writes bench.json and bench.md."""

from __future__ import annotations

from qlbench import adapters, bench, engine
from qlbench.backbones import ARCHS
from qlbench.commands import UsageError, check_out, options, split_list, usage_errors
from qlbench.records.store import Store, write_json, write_text

COMPILE = {"auto": None, "on": True, "off": False}  # --compile -> Settings.make's compile


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="speed benchmarks: stacked engine vs per-seed loop and plain PyTorch, matmul-peak share, inference",
        description="Speed, measured side by side in one process and reported as ratios.",
    )
    p.add_argument("--quick", action="store_true", help="few steps, E = 5 only (and 45 on CUDA), no compile")
    p.add_argument("--archs", default=",".join(ARCHS), help=f"comma-separated from: {', '.join(ARCHS)}")
    options.add(p, "--methods", methods=dict(help="comma-separated (default: every registered method)"))
    compile_ = dict(
        help="also measure the torch.compile variants of the training step: auto (not with --quick), on, off"
    )
    options.add_training_options(p, "device", "threads", "compile", compile=compile_)
    p.add_argument(
        "--only",
        default=None,
        help=f"comma-separated measurement kinds to run (default: all): {', '.join(bench.KINDS)}; the paper-table "
        "estimate needs throughput (and capture, on CUDA)",
    )
    options.add_output_options(
        p, out=dict(default=None, help="folder for bench.json and bench.md (default results/bench)")
    )
    p.set_defaults(func=run)


def run(args) -> int:
    archs = split_list(args.archs, "--archs")
    if not archs or (bad := [a for a in archs if a not in ARCHS]):
        raise UsageError(f"unknown arch {', '.join(bad) if archs else repr(args.archs)}; valid: {', '.join(ARCHS)}")
    methods = split_list(args.methods, "--methods") if args.methods is not None else adapters.names()
    if not methods:
        raise UsageError(f"--methods is empty; valid: {', '.join(adapters.names())}")
    only = None
    if args.only is not None:
        only = set(split_list(args.only, "--only"))
        if not only or (bad := sorted(only - set(bench.KINDS))):
            what = f"unknown measurement kind {', '.join(bad)}" if only else "--only is empty"
            raise UsageError(f"{what}; valid: {', '.join(bench.KINDS)}")
    if args.compile not in COMPILE:
        raise UsageError(f"unknown --compile {args.compile!r}; valid: {', '.join(COMPILE)}")
    with usage_errors():
        for m in methods:
            adapters.get(m)
        device = engine.resolve_device(args.device)
    with usage_errors():
        engine.check_threads(args.threads)
    out = args.out or Store("results").bench_dir
    check_out(out, "bench folder")
    settings = bench.Settings.make(args.quick, args.threads, compile=COMPILE[args.compile])
    # the rows measured so far, in bench.partial.json until the run ends (a run stopped at a time limit keeps them)
    partial = lambda report: write_json(report | {"partial": True}, out / "bench.partial.json")
    report = bench.run(archs, methods, settings, device, progress=not args.no_progress, only=only, partial=partial)
    text = bench.markdown(report)
    write_json(report, out / "bench.json")
    write_text(text, out / "bench.md")
    (out / "bench.partial.json").unlink(missing_ok=True)
    print(text)
    return 0
