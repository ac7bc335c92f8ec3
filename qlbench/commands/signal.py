"""`qlbench signal`: how a backbone propagates its input, layer by layer, at initialisation and after pretraining.

The spread of a layer is the mean over its features of each feature's standard deviation across the target test
inputs (qlbench.diagnostics.signal_profile). Pretrained backbones come from the results folder's cache (trained and
cached when missing), the same files `qlbench run --backbone-init` uses.
"""

from __future__ import annotations

import sys

from qlbench import diagnostics, engine, progress, text, zoo
from qlbench.backbones import DEFAULT_INIT, INITS, check_init
from qlbench.commands import UsageError, check_out, check_out_file, options, path_arg, split_list, usage_errors
from qlbench.records import store
from qlbench.settings import Protocol


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "signal",
        help="per-layer spread of a backbone's hidden features across inputs, at init and after pretraining",
        description="Signal propagation: for each backbone init, the spread across inputs of every hidden layer's "
        "features at initialisation and after the budget's pretraining, as a table and a figure.",
    )
    options.add(p, "--arch", "--function", function=dict(required=True))
    p.add_argument("--no-pretrain", action="store_true", help="at initialisation only")
    p.add_argument(
        "--figure", type=path_arg, help="the figure (PNG; default <out>/signal/<arch>-<function>-<budget>.png)"
    )
    inits = dict(metavar="I1,I2", help=f"comma-separated, from: {', '.join(INITS)} (default: {DEFAULT_INIT})")
    options.add_training_options(p, "budget", "seeds", "device", "threads", "backbone-init", backbone_init=inits)
    options.add_output_options(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from qlbench import report  # imported here: seaborn and matplotlib would slow qlbench --help and bad input

    inits = split_list(args.backbone_init, "--backbone-init")
    if not inits:
        raise UsageError("--backbone-init is empty; give one or more of default, kaiming, orthogonal")
    if args.seeds is not None and args.seeds < 1:
        raise UsageError(f"--seeds must be >= 1, got {args.seeds}")
    out = options.execution_of(args).out_dir
    with usage_errors():
        b = engine.budget(args.budget, args.arch)
        zoo.card(args.function)
        for init in inits:
            check_init(args.arch, init)
        engine.resolve_device(args.device)
    check_out(out, "results folder")
    figure = args.figure or out / "signal" / f"{args.arch}-{args.function}-{args.budget}.png"
    check_out_file(figure, "figure")  # before the training, not after it
    log = lambda message: print(message, file=sys.stderr, flush=True)
    seeds = b.seeds if args.seeds is None else args.seeds
    with (
        engine.num_threads(engine.auto_threads(args.arch, seeds, args.threads)),  # as `qlbench run` pretrains
        progress.bar(desc="pretrain", unit="step", disable=args.no_progress, leave=False) as bar,
    ):
        profile = diagnostics.signal_profile(
            args.function,
            inits,
            Protocol(arch=args.arch, budget=args.budget, seeds=seeds),
            store=store.Store(out),
            device=args.device,
            pretrained=not args.no_pretrain,
            progress=bar.update,
            log=log,
        )
    wide = profile.groupby(["layer", "init", "stage"])["spread"].mean().unstack(["init", "stage"])
    wide.columns = [f"{init}, {stage}" for init, stage in wide.columns]
    print(
        f"qlbench signal: {args.arch}, {args.function}, budget {args.budget} ({seeds} seeds): spread of the hidden "
        "features across the target test inputs, mean over seeds (layer 0: after the input layer)\n"
    )
    print(text.markdown(wide.map(lambda v: f"{v:.3g}").reset_index()))
    fig = report.signal_figure(profile)
    store.atomic_write(figure, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    print(f"\nfigure: {figure}")
    return 0
