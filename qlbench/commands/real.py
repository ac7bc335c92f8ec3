"""`qlbench real`: the offline real-model experiment (qlbench/experiments/real.py): the bundled all-MiniLM-L6-v2 adapted
through peft with LoRA, Queryable LoRA and Instruction-Queryable LoRA to three instructed yes/no tasks; records, table
and figure."""

from __future__ import annotations

import sys

from qlbench.commands import UsageError, check_out, options, split_list, usage_errors
from qlbench.experiments import real, runner
from qlbench.progress import bar
from qlbench.report import real as real_report


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "real",
        help="adapt the bundled all-MiniLM-L6-v2 to three instructed tasks (needs the hf extra)",
        description="The offline real-model experiment: the bundled, pretrained all-MiniLM-L6-v2 adapted through "
        "peft to three regression tasks over the same generated sentences, told apart by their instruction; "
        "every method, several seeds, paired with LoRA; records and report under OUT/real/. Needs `pip install "
        "'qlbench[hf]'`.",
    )
    methods = dict(default=",".join(real.METHODS), help=f"any of: {', '.join(real.METHODS)}")
    options.add(
        p,
        "--methods",
        "--epochs",
        methods=methods,
        epochs=dict(default=10, help="passes over the training set (default 10)"),
    )
    p.add_argument("--train-per-task", type=int, default=100, metavar="N", help="training sentences per task")
    seeds = dict(default=3, help="seeds 0..N-1 (default 3)")
    options.add_training_options(p, "seeds", "threads", "device", seeds=seeds)
    options.add_output_options(p)  # records and report under OUT/real/
    p.set_defaults(func=run)


def run(args) -> int:
    log = lambda message: print(message, file=sys.stderr, flush=True)
    methods = split_list(args.methods, "--methods")
    if not methods or (bad := [m for m in methods if m not in real.METHODS]):
        raise UsageError(f"unknown method {', '.join(bad) if methods else '(none)'}; valid: {', '.join(real.METHODS)}")
    execution = options.execution_of(args)  # --threads checked against the cores present
    out = execution.out_dir
    if args.seeds is None or not 1 <= args.seeds <= 100:  # before range(seeds) is built
        raise UsageError(f"--seeds must be an integer from 1 to 100, got {args.seeds}")
    try:
        import peft  # noqa: F401
    except ImportError as err:
        raise UsageError(f"qlbench real needs the hf extra (pip install 'qlbench[hf]'): {err}") from None
    with usage_errors():
        config = real.RealConfig(epochs=args.epochs, train_per_task=args.train_per_task, seeds=tuple(range(args.seeds)))
    with usage_errors():
        real.plan(methods, config, execution)  # the device checked before any work
    check_out(out, "results folder")
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    todo = len(methods) * len(config.seeds) * real.steps(config)
    with bar(total=todo, desc="real", disable=args.no_progress) as progress:
        paths = runner.run(real.plan(methods, config, execution), progress=progress.update, log=log)
    folder = real.record_path(out, config, methods[0]).parent
    report = real_report.write(paths, folder)
    print(report["markdown"])
    print(f"records and report in {folder}")
    return 0
