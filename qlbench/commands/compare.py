"""`qlbench compare RESULTS`: the methods of a results folder against a protocol's committed baselines (pairs by
function and seed; records of another protocol refused); `--leaderboard`: the baselines' leaderboard
(docs/results/leaderboard.md). Statistics: qlbench/compare.py."""

from __future__ import annotations

import sys
from pathlib import Path

from qlbench import compare, protocols, text
from qlbench.commands import UsageError, options, path_arg, usage_errors
from qlbench.metrics import stats
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
    p.add_argument("--protocol", default=protocols.ZOO_V1.name, help=f"one of: {', '.join(protocols.PROTOCOLS)}")
    p.add_argument("--baselines", type=path_arg, help="a per-seed CSV of baselines (default: the committed one)")
    options.add(p, "--metric", metric=dict(help=f"one of: {', '.join(stats.METRICS)} (default test-at-best-train)"))
    p.add_argument("--leaderboard", action="store_true", help="print the baselines' leaderboard (Markdown)")
    p.set_defaults(func=run)


def _baselines(args, protocol) -> object:
    path = Path(args.baselines) if args.baselines else compare.baselines_file(protocol.name)
    if not path.is_file():
        raise UsageError(f"no baselines for {protocol.name} at {path} (--baselines FILE: a per-seed CSV)")
    try:
        return per_seed.load(path)
    except store.DamagedFile as err:
        raise UsageError(str(err)) from None


def _bench(protocol) -> dict | None:
    """The committed step times of the protocol's methods (compare.bench_file), None where there are none; a damaged
    file is said in one line on stderr and the column left blank."""
    path = compare.bench_file(protocol.name)
    if not path.is_file():
        return None
    try:
        return store.read_json(path)
    except store.DamagedFile as err:
        print(f"qlbench compare: {err}; the leaderboard leaves µs / step blank", file=sys.stderr)
        return None


def run(args) -> int:
    with usage_errors():
        protocol = protocols.get(args.protocol)
        stats.metric(args.metric)
    if args.leaderboard == (args.folder is not None):
        raise UsageError("give RESULTS (compare a results folder) or --leaderboard, not both and not neither")
    base = _baselines(args, protocol)
    if args.leaderboard:
        print(compare.leaderboard_markdown(base, protocol, args.metric, _bench(protocol)), end="")
        return 0
    folder = Path(args.folder)
    with usage_errors():
        paths = compare.check_records(folder, protocol, on_damaged=lambda m: print(m))
    mine = results.load(paths)
    if not compare.trained(mine):
        raise UsageError(f"{folder} holds no trained method to compare (only reference rows)")
    out = compare.against(mine, base, args.metric)
    print_comparison(out, protocol, args.metric)
    return 0


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
