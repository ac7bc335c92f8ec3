"""`qlbench diagnose RESULTS --function F`: routing and gradient diagnostics of one trained routed cell.

Prints, for a queryable or instruct-queryable cell, per seed and block: route entropy, usage entropy, effective
atoms, input dependence and each atom's usage over the target test set; each atom's usage entropy across blocks;
and the gradient concentration of LoRA, queryable and instruct-queryable on the same (arch, budget, init,
function). Writes route maps (dominant atom per block beside the target surface and the prediction), every atom's
weight over the input plane, the atom-usage heatmap and the gradient figures, as PNG, into --out.
"""

from __future__ import annotations

import sys
from pathlib import Path

from qlbench import diagnostics, text
from qlbench.backbones import ARCHS, DEFAULT_INIT, INITS
from qlbench.commands import UsageError, check_out, options, path_arg, usage_errors
from qlbench.records import results, store


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "diagnose",
        help="routing and gradient diagnostics of a trained queryable cell: route maps, atom usage, entropies",
        description="Routing diagnostics of a trained queryable / instruct-queryable cell over its target test "
        "set and over a grid of the input plane (route maps), and the gradient concentration of LoRA, queryable "
        "and instruct-queryable on the same function.",
    )
    p.add_argument("folder", type=path_arg, metavar="RESULTS", help="a results folder (as given to run/sweep --out)")
    arch = dict(default=None, help=f"one of: {', '.join(ARCHS)} (default: the only one with a matching record)")
    method = dict(help=f"one of: {', '.join(diagnostics.ROUTED)} (default queryable)")
    options.add(p, "--method", "--function", "--arch", function=dict(required=True), arch=arch, method=method)
    p.add_argument("--seed", type=int, help="the seed whose route maps are drawn (default: the cell's first)")
    p.add_argument("--grid", type=int, default=101, help="grid points per axis of the route maps (default 101)")
    options.add_training_options(
        p,
        "budget",
        "backbone-init",
        "device",
        budget=dict(default=None, help="the cell's budget (default: the only one with a matching record)"),
        backbone_init=dict(default=None, help=f"one of: {', '.join(INITS)} (default: the only one with a record)"),
    )
    options.add_output_options(
        p, "out", out=dict(default=None, help="folder for the figures (default <RESULTS>/diagnose/...)")
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from qlbench import report  # imported here: seaborn and matplotlib would slow qlbench --help and bad input

    if args.method not in diagnostics.ROUTED:
        raise UsageError(f"unknown routed method {args.method!r}; valid: {', '.join(diagnostics.ROUTED)}")
    if args.arch is not None and args.arch not in ARCHS:
        raise UsageError(f"unknown arch {args.arch!r}; valid: {', '.join(ARCHS)}")
    if args.backbone_init is not None and args.backbone_init not in INITS:
        raise UsageError(f"unknown backbone init {args.backbone_init!r}; valid: {', '.join(INITS)}")
    if not 2 <= args.grid <= 1001:
        raise UsageError(f"--grid must be between 2 and 1001, got {args.grid}")
    with usage_errors():
        record = diagnostics.find_cell(
            args.folder,
            args.function,
            args.method,
            arch=args.arch,
            budget=args.budget,
            backbone_init=args.backbone_init,
        )
        rec = results.read_record(record)
        seeds = rec["run_info"]["seeds"]
        if args.seed is not None and args.seed not in seeds:
            raise ValueError(f"seed {args.seed} is not in the cell; valid: {', '.join(map(str, seeds))}")
    if args.out is not None:
        check_out(args.out, "figure folder")
    with usage_errors():
        model, data, rec = diagnostics.load_cell(record, args.device)
    cfg = rec["run_info"]["config"]
    init = cfg.get("backbone_init", DEFAULT_INIT)
    arch, budget = cfg["arch"], rec["run_info"]["budget"]
    member = seeds.index(args.seed) if args.seed is not None else 0
    out = args.out or (
        args.folder / "diagnose" / (arch if init == DEFAULT_INIT else f"{arch}-{init}") / budget / args.function
    )
    name = f"{args.method} on {args.function} ({arch}, {init} init, budget {budget}, seeds {seeds})"
    print(f"qlbench diagnose: {name}; record {record}")

    alpha, _ = diagnostics.capture_routes(model, data.x_test)  # (E, B, N, M)
    s = diagnostics.route_stats(alpha.cpu())
    table = diagnostics.block_table(s, seeds)
    top_k = model.shared["queryable"].config.top_k
    print(f"\n### Routing over the target test set ({alpha.shape[2]} inputs, top-{top_k} of {alpha.shape[-1]} atoms)\n")
    print(text.markdown(table.round(3)))
    atoms = {f"seed {seed}": [f"{v:.3f}" for v in s["atom_block_entropy"][e].tolist()] for e, seed in enumerate(seeds)}
    print("\nper-atom usage entropy across blocks (nats; max log B; nan = unused):")
    for seed, values in atoms.items():
        print(f"  {seed}: {', '.join(values)}")

    files = []
    save = lambda fig, stem: files.append(_save(fig, out / stem))
    maps = diagnostics.route_maps(model, args.function, args.grid)
    label = f"{name}, seed {seeds[member]}"
    save(report.route_map_figure(maps, member, f"Route maps: {label}"), f"{args.method}-route-map")
    save(report.atom_weight_figure(maps, member, f"Atom weights: {label}"), f"{args.method}-atom-weights")
    usage = {f"seed {seed}": s["usage"][e] for e, seed in enumerate(seeds)}
    save(report.atom_usage_figure(usage, f"Atom usage: {name}"), f"{args.method}-atom-usage")

    cells = [
        p
        for m in diagnostics.GRADIENT_METHODS
        for p in results.index(args.folder, on_damaged=lambda m: None).itertuples()
        if p.method == m and p.function == args.function and (p.arch, p.budget, p.backbone_init) == (arch, budget, init)
    ]
    frame, _ = results.newest_config(results.load([c.record for c in cells]))
    grads = results.load_gradients(sorted(set(frame["record"]))) if len(frame) else frame
    if len(grads):
        comparison = diagnostics.compare_concentration(diagnostics.concentration_per_seed(grads))
        print(f"\n### Gradient concentration ({', '.join(sorted(set(grads['method'])))})\n")
        print(text.markdown(report.concentration_table(comparison)))
        print(f"\n{report.concentration_legend(comparison)}")
        save(report.gradient_profile_figure(grads), "gradient-profile")
        save(report.concentration_figure(grads), "gradient-concentration")
    else:
        print("\nno gradient diagnostics in these records (written before they existed): `--force` re-runs a cell")
    print(f"\nwritten to {out}: {', '.join(sorted(p.name for p in files))}", file=sys.stdout)
    return 0


def _save(fig, stem: Path) -> Path:
    path = stem.with_suffix(".png")
    store.atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    return path
