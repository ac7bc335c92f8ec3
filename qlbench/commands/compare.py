"""`qlbench compare RESULTS`: the methods of a results folder against a protocol's committed baselines (pairs by
function and seed; records of another protocol refused); `--leaderboard`: the baselines' leaderboard
(docs/results/leaderboard.md; with --out, written there with its forest plot); `--validity FILE`: how far the
baselines' order predicts real fine-tuning (docs/results/validity/). Statistics: qlbench/compare.py,
qlbench/metrics/board.py and qlbench/metrics/validity.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from qlbench import compare, protocols, text
from qlbench.commands import UsageError, check_out, options, path_arg, usage_errors
from qlbench.metrics import board, stats, validity
from qlbench.records import per_seed, results, store
from qlbench.text import Column


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compare",
        help="your methods against a protocol's committed baselines (zoo-v1), or the baselines' leaderboard",
    )
    p.add_argument(
        "folder", nargs="?", type=path_arg, metavar="RESULTS", help="a results folder made under the protocol"
    )
    options.add(
        p,
        "--protocol",
        protocol=dict(default=protocols.ZOO_V1.name, help=f"one of: {', '.join(protocols.PROTOCOLS)} (default zoo-v1)"),
    )
    p.add_argument("--baselines", type=path_arg, help="a per-seed CSV of baselines (default: the committed one)")
    options.add(p, "--metric", metric=dict(help=f"one of: {', '.join(stats.METRICS)} (default test-at-best-train)"))
    p.add_argument("--leaderboard", action="store_true", help="print the baselines' leaderboard (Markdown)")
    p.add_argument(
        "--own-lora",
        action="store_true",
        help="with RESULTS: take the ratios to the lora in RESULTS (run on this machine, on the same backbones) "
        "instead of the committed lora; the other baselines stay committed",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="with RESULTS: also every baseline pair across functions and the per-function ratios (default: the short "
        "table against LoRA, the best baseline, frozen and mean)",
    )
    p.add_argument(
        "--validity",
        type=path_arg,
        metavar="FILE",
        help="correlate the baselines' order with a CSV of real fine-tuning accuracies (tuner, config, test_accuracy: "
        "docs/results/validity/peft-metamathqa-design.csv)",
    )
    out = dict(default=None, help="with --leaderboard or --validity: also write the page (and figure) into this folder")
    options.add_output_options(p, "out", out=out)
    p.set_defaults(func=run)


def _baselines(args, protocol) -> object:
    path = Path(args.baselines) if args.baselines else compare.baselines_file(protocol.name)
    if not path.is_file():
        raise UsageError(f"no baselines for {protocol.name} at {path} (--baselines FILE: a per-seed CSV)")
    try:
        return _tuned(per_seed.load(path), protocol)
    except store.DamagedFile as err:
        raise UsageError(str(err)) from None


def _tuned(frame, protocol):
    """The frame's rows at each method's chosen learning rate (board.tune; a protocol without a grid: as it is);
    UsageError (one line) for a method not tried at every rate."""
    with usage_errors():
        return board.tune(frame, protocol.lrs)[0]


def _optional(path: Path, read, left_out: str):
    """What `read` makes of the file at `path`, None where there is none; a damaged one is said in one line on stderr
    (with what is then `left_out`) and taken as none."""
    if not path.is_file():
        return None
    try:
        return read(path)
    except store.DamagedFile as err:
        print(f"qlbench compare: {err}; {left_out}", file=sys.stderr)
        return None


def _bench(protocol) -> dict | None:
    """The committed step times of the protocol's methods (compare.bench_file), or None."""
    return _optional(compare.bench_file(protocol.name), store.read_json, "the leaderboard leaves µs / step blank")


def _mine(args, protocol):
    """The records of RESULTS, every one under the protocol and on its backbones (compare.check_records)."""
    folder = Path(args.folder)
    with usage_errors():
        paths = compare.check_records(folder, protocol, on_damaged=lambda m: print(m))
    mine = _tuned(results.load(paths), protocol)
    if not compare.trained(mine):
        raise UsageError(f"{folder} holds no trained method to compare (only reference rows)")
    return mine


def _mine_bench(folder: Path) -> dict | None:
    """A bench report of your methods in RESULTS (`qlbench bench --out RESULTS/bench`), or None."""
    for path in (Path(folder) / "bench" / "bench.json", Path(folder) / "bench.json"):
        if path.is_file():
            return _optional(path, store.read_json, "your methods' µs / step left blank")
    return None


def _aa(args, protocol):
    """The protocol's committed A/A rows (compare.aa_file) beside its committed baselines, or None (other
    --baselines, or none committed)."""
    if args.baselines:
        return None
    aa = _optional(compare.aa_file(protocol.name), per_seed.load, "the A/A check is left out")
    return None if aa is None else _tuned(aa, protocol)


def _reference(path: Path):
    if not path.is_file():
        raise UsageError(
            f"no reference accuracies at {path} (--validity FILE: a CSV with tuner, config, test_accuracy)"
        )
    try:
        return validity.load_reference(path)
    except store.DamagedFile as err:
        raise UsageError(str(err)) from None


def run(args) -> int:
    with usage_errors():
        protocol = protocols.get(args.protocol)
        stats.metric(args.metric)
    if args.validity is not None and (args.folder is not None or args.leaderboard):
        raise UsageError(
            "--validity FILE goes alone (the baselines' order); RESULTS or --leaderboard is another report"
        )
    if args.folder is None and not args.leaderboard and args.validity is None:
        raise UsageError("give RESULTS (compare a results folder), --leaderboard (RESULTS too: yours among the "
                         "baselines) or --validity FILE")  # fmt: skip
    if args.own_lora and (args.folder is None or args.leaderboard):
        raise UsageError("--own-lora goes with RESULTS alone (a comparison of your folder with its own lora)")
    if args.full and args.folder is None:
        raise UsageError("--full goes with RESULTS (a comparison of a results folder)")
    if args.out is not None and args.folder is not None and not args.leaderboard:
        raise UsageError("--out goes with --leaderboard or --validity; a comparison prints only")
    if args.out is not None:
        check_out(args.out)
    reference = _reference(args.validity) if args.validity else None
    base = _baselines(args, protocol)
    if args.leaderboard:
        figure = "leaderboard-forest.png" if args.out else None
        mine = _mine(args, protocol) if args.folder is not None else None
        with usage_errors():
            page, board = compare.leaderboard_markdown(
                base,
                protocol,
                args.metric,
                _bench(protocol),
                figure=figure,
                yours=None if mine is None else compare.Yours(mine, str(args.folder), _mine_bench(args.folder)),
                aa=_aa(args, protocol),
            )
        print(page, end="")
        if args.out:
            fig = compare.forest_figure(board, f"{protocol.name}: {stats.metric(args.metric).label}")
            store.write_text(page, args.out / "leaderboard.md")
            store.atomic_write(args.out / figure, lambda tmp: fig.savefig(tmp, format="png", dpi=150))
        return 0
    if args.validity:
        with usage_errors():
            page, table = compare.validity_markdown(base, protocol, reference, args.validity.name, args.metric)
        print(page, end="")
        if args.out:
            store.write_text(page, args.out / "validity.md")
            store.write_text(text.csv(table), args.out / "validity.csv")
        return 0
    mine = _mine(args, protocol)
    if args.own_lora:
        with usage_errors():
            mine, base = compare.own_reference(mine, base)
    print_summary(compare.summary(mine, base, args.metric), protocol, args.metric)
    if args.full:
        print()
        print_comparison(compare.against(mine, base, args.metric), protocol, args.metric)
    return 0


def _ratio(key: str):
    r3 = lambda v: text.num(v, 3)

    def cell(r) -> str:
        if pd.isna(r[f"x_{key}"]):
            return "n/a"
        outcome = f" {r[f'{key}_outcome']}" if r[f"{key}_outcome"] else ""
        return f"{r3(r[f'x_{key}'])} [{r3(r[f'{key}_low'])}, {r3(r[f'{key}_high'])}]{outcome}"

    return cell


def print_summary(rows: pd.DataFrame, protocol, metric: str) -> None:
    print(f"Against the {protocol.name} baselines ({stats.metric(metric).label}; pairs by function and seed)\n")
    print("Each ratio: the geometric-mean MSE ratio over the finite (function, seed) pairs with that row, its 95%")
    print("bootstrap interval (functions, then seeds), and win / loss where the interval excludes 1 and the paired")
    print("test's Holm p over the four is below 0.05 (else tie). best: the leaderboard's first baseline. place: among")
    print("the baselines and this method, by ratio to LoRA, with its bootstrap interval. --full: every pair.\n")
    print(
        text.table(
            rows.to_dict("records"),
            [
                Column("method", "method"),
                Column("seeds", "seeds"),
                Column("diverged", lambda r: f"{r['divergence']:.0%}"),
                Column("× LoRA", _ratio("lora")),
                Column("× best", _ratio("best")),
                Column("best", "best"),
                Column("× frozen", _ratio("frozen")),
                Column("× mean", _ratio("mean")),
                Column("place", lambda r: f"{r['place']} [{r['place_low']}, {r['place_high']}] of {r['of']}"),
                Column("told apart from", "told_apart"),
            ],
        )
    )


def print_comparison(out: dict, protocol, metric: str) -> None:
    r3 = lambda v: text.num(v, 3)
    print(f"Against the {protocol.name} baselines ({stats.metric(metric).label}; pairs by function and seed)\n")
    print("Across functions: geometric-mean MSE ratio (method / baseline) with its 95% bootstrap CI; Holm over the")
    print("baselines; win or loss where the Holm p < 0.05 and the CI excludes 1\n")
    across = out["across"].to_dict("records")
    print(
        text.table(
            across,
            [
                Column("method", "method"),
                Column("baseline", "baseline"),
                Column("pairs", "n"),
                Column("ratio", "gm_ratio", r3),
                Column("95% CI", lambda r: f"[{r3(r['ci_low'])}, {r3(r['ci_high'])}]"),
                Column("p", "p", r3),
                Column("p (Holm)", "p_holm", r3),
                Column("outcome", "outcome"),
            ],
        )
    )
    print("\nPer function (descriptive: raw paired p over seeds, not corrected)\n")
    print(
        text.table(
            out["functions"].to_dict("records"),
            [
                Column("method", "method"),
                Column("function", "function"),
                Column("seeds", "seeds"),
                Column("MSE", "mse", r3),
                Column("LoRA", "lora", r3),
                Column("× LoRA", "ratio_lora", r3),
                Column("p", "p_lora", r3),
                Column("best baseline", "best"),
                Column("× best", "ratio_best", r3),
                Column("p ", "p_best", r3),
            ],
        )
    )
    print()
    for r in out["rank"]:
        print(
            f"{r['method']}: mean rank {r['mean_rank']:.2f} of {r['of']} over its {r['functions']} function(s) "
            "(1 = lowest mean MSE on its seeds)"
        )
