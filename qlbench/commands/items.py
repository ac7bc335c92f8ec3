"""`qlbench items CSV...`: item analysis of the tasks in per-seed CSVs (qlbench/metrics/items.py): per task its
headroom over frozen and mean, seed noise, split-half reliability of the method order, the share of methods that end
worse than frozen, and a verdict (keep, re-parameterise, drop). docs/results/items/ is its output over the committed
reports."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from qlbench import text
from qlbench.commands import UsageError, check_out, options, path_arg, split_list, usage_errors
from qlbench.metrics import board, items, stats
from qlbench.records import per_seed, store
from qlbench.text import Column


def register(subparsers) -> None:
    p = subparsers.add_parser("items", help="item analysis: which tasks tell methods apart (per-seed CSVs)")
    p.add_argument("csv", nargs="+", type=path_arg, metavar="CSV", help="per-seed CSVs (per-seed.csv.gz of a report)")
    options.add(p, "--metric", metric=dict(help=f"one of: {', '.join(stats.METRICS)} (default test-at-best-train)"))
    panel = "analyse only these methods (a panel every task ran, so that tasks compare on the same methods); default: "
    options.add(p, "--methods", methods=dict(help=panel + "every method of each task"))
    options.add_training_options(p, "--seeds", seeds=dict(help="analyse only seeds 0..N-1 (default: every seed)"))
    out = dict(default=None, help="also write items.md and items.csv into this folder")
    options.add_output_options(p, "out", out=out)
    p.set_defaults(func=run)


def _load(paths: list[Path]) -> pd.DataFrame:
    frames = []
    for path in paths:
        if not path.is_file():
            raise UsageError(f"no per-seed CSV at {path}")
        try:
            # a learning-rate grid's methods count once per rate ("lora @ lr 0.001"), never as one method
            frames.append(stats.by_rate(per_seed.load(path)).assign(source=str(path)))
        except store.DamagedFile as err:
            raise UsageError(str(err)) from None
    # a (task, method, seed) in two files (a record exported into two reports) counts once: the first file's
    return pd.concat(frames).drop_duplicates([*items.TASK, "method", "seed"], keep="first")


COLUMNS = [
    Column("arch", "arch"),
    Column("init", "backbone_init"),
    Column("budget", "budget"),
    Column("function", "function"),
    Column("methods", "methods"),
    Column("seeds", "seeds"),
    Column("frozen / best", "headroom_frozen", lambda v: text.num(v, 3)),
    Column("mean / best", "headroom_mean", lambda v: text.num(v, 3)),
    Column("seed noise", "seed_noise", lambda v: f"{v:.3f}"),
    Column("reliability", "reliability", lambda v: "n/a" if pd.isna(v) else f"{v:.2f}"),
    Column("worse than frozen", "worse_than_frozen", lambda v: f"{v:.0%}"),
    Column("diverged", "divergence", lambda v: f"{v:.1%}"),
    Column("verdict", "verdict"),
]


def power_lines(frame: pd.DataFrame, metric: str) -> list[str]:
    """Per (arch, init, budget) slice with LoRA and at least 3 tasks: the tasks a board of it needs to see a 10 %
    effect across tasks at 80 % power (board.power_plan), alone and against LoRA with Holm over its methods."""
    lines = []
    for (arch, init, budget), g in frame.groupby(["arch", "backbone_init", "budget"], sort=True):
        if "lora" not in set(g["method"]) or g["function"].nunique() < 3:
            continue
        k = g.loc[~g["method"].isin(stats.REFERENCE), "method"].nunique() - 1
        one, many = board.power_plan(g, metric), board.power_plan(g, metric, comparisons=max(k, 1))
        need = lambda plan: ", ".join(f"{n or '> 500'} at {s} seeds" for s, n in plan["tasks"].items())
        lines.append(
            f"- {arch}, {init} init, {budget}: sd between tasks {one['sd_task']:.3f}, sd over seeds "
            f"{one['sd_seed']:.3f} (ln ratio to LoRA, median over methods); tasks needed for one comparison: "
            f"{need(one)}; for each of its {k} methods against LoRA (alpha 0.05 / {k}): {need(many)}."
        )
    return lines


def markdown(
    table: pd.DataFrame, sources: list[str], commits: list[str], power: list[str] = (), panel: str = ""
) -> str:
    power_part = (
        [
            "## Power: how many tasks a board needs",
            "",
            "To see a 10% ratio to LoRA across tasks at 80% power by the test the leaderboard uses (a t-test over "
            "tasks of per-task mean ln ratios), from the spread each slice shows (qlbench/metrics/board.py, "
            "power_plan):",
            "",
            *power,
            "",
        ]
        if power
        else []
    )
    return "\n".join(
        [
            "# Item analysis: which tasks tell methods apart",
            "",
            "One row per task (arch, backbone init, budget, function), on the seeds every one of its methods has. "
            "frozen / best, mean / best: the mean MSE of no adaptation and of a constant predictor over the best "
            "trained method's (headroom). seed noise: the median over methods of the standard deviation of ln MSE "
            "over seeds. reliability: the split-half reliability of the method order (Spearman between the orders of "
            f"two random halves of the seeds, stepped up by Spearman-Brown, mean of {items.SPLITS} splits; n/a below "
            "4 seeds). worse than frozen: the share of trained methods whose mean MSE ends above frozen's. verdict: "
            f"keep when reliability >= {items.MIN_RELIABILITY}, at most {items.MAX_WORSE_THAN_FROZEN:.0%} of methods "
            f"end worse than frozen and frozen / best >= {items.MIN_HEADROOM}; re-parameterise (shift, samples or "
            "budget) a task that orders methods reliably but fails another rule; drop the rest."
            + (f" {panel}" if panel else ""),
            "",
            text.table(table.to_dict("records"), COLUMNS),
            "",
            *power_part,
            f"Provenance: records from commit(s) {', '.join(commits)}; per-seed records: {', '.join(sources)}; rebuilt "
            "by `qlbench items` (tests/test_board.py checks it).",
            "",
        ]
    )


def run(args) -> int:
    with usage_errors():
        stats.metric(args.metric)
    if args.out is not None:
        check_out(args.out)
    frame = _load(list(args.csv))
    if args.seeds is not None:
        if args.seeds < 1:
            raise UsageError(f"--seeds must be >= 1, got {args.seeds}")
        frame = frame[frame["seed"] < args.seeds]
    panel = ""
    if args.methods is not None:
        chosen = split_list(args.methods, "--methods")
        if missing := sorted(set(chosen) - set(frame["method"])):
            raise UsageError(
                f"--methods: {missing[0]} is in no CSV; present: {', '.join(sorted(set(frame['method'])))}"
            )
        frame = frame[frame["method"].isin(chosen)]
        panel = f"Methods: the panel {', '.join(chosen)}" + (f", seeds 0-{args.seeds - 1}" if args.seeds else "") + "."
    with usage_errors():
        table = items.analyse(frame, args.metric)
    commits = sorted({c[:7] for c in frame["commit"].dropna()})
    sources = [Path(p).as_posix() for p in args.csv]
    page = markdown(table, sources, commits, power_lines(frame, args.metric), panel)
    print(page, end="")
    if args.out is not None:
        store.write_text(page, Path(args.out) / "items.md")
        store.write_text(text.csv(table), Path(args.out) / "items.csv")
    return 0
