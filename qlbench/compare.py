"""A method against a protocol's committed baselines (`qlbench compare RESULTS`), and the leaderboard the baselines
make (`qlbench compare --leaderboard`, docs/results/leaderboard.md).

The baselines are a per-seed CSV (per_seed.py) of records made under one protocol (protocols.py), committed under
docs/results/baselines/<protocol>/. A method's records are paired with them by (function, seed). Records made under
another protocol are refused, one line naming the difference.

Statistics (stats.py's, on the test MSE at the best-train epoch unless told otherwise):
- across functions, per baseline: the geometric-mean MSE ratio over every (function, seed) pair with its
  hierarchical-bootstrap interval and the paired test on the log ratios (`stats.across_functions`); Holm over the
  baselines compared; win or loss only where the Holm p < 0.05 and the interval excludes 1;
- per function, against LoRA and against the best baseline there (lowest mean): the geometric-mean ratio over seeds
  and the raw paired p, descriptive (not corrected; the claim is the test across functions);
- rank: per function, the method's place by mean MSE among the trained baselines and itself; averaged over functions.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from qlbench import adapters, inputs, protocols, text
from qlbench.metrics import stats
from qlbench.records import per_seed, results

REPOSITORY = Path(__file__).resolve().parents[1]


def baselines_file(protocol: str) -> Path:
    """Where a protocol's committed baselines live in the repository (docs/results/baselines/<name>/)."""
    return REPOSITORY / "docs" / "results" / "baselines" / protocol / per_seed.FILE


def bench_file(protocol: str) -> Path:
    """Where the step times of a protocol's methods live: a `qlbench bench` report (docs/results/bench/<name>.json)."""
    return REPOSITORY / "docs" / "results" / "bench" / f"{protocol}.json"


def step_times(report: dict, arch: str) -> dict[str, float]:
    """µs per member-step of each method in a `qlbench bench` report, at its fewest members on `arch`: 1e6 over the
    model-steps/s of qlbench's stacked step (throughput rows) or of the path a method written for one member trains
    on (members rows: stacked where vmap runs it, else looped)."""
    rates = {}
    rows = [r for r in report.get("throughput", []) if r["arch"] == arch]
    rows += [r | {"stacked": r["stacked"] or r["looped"]} for r in report.get("members", []) if r["arch"] == arch]
    for r in sorted(rows, key=lambda r: -r["members"]):  # the fewest members last: they win
        rates[r["method"]] = 1e6 / r["stacked"]
    return rates


def check_records(folder: Path, protocol: protocols.Protocol, on_damaged=None) -> list[Path]:
    """The record files of a results folder, every one made under `protocol`; ValueError (one line) for the first
    that is not, naming the difference, and for a folder without records."""
    found = results._records(inputs.folder(folder, "results folder"), on_damaged)
    if not found:
        raise ValueError(f"no records in {folder}")
    for path, rec in found:
        cards = (rec["run_info"].get("settings") or {}).get("cards")
        if diff := protocol.differences(rec["run_info"]["config"], cards):
            rel = Path(path).relative_to(folder) if Path(path).is_relative_to(folder) else path
            raise ValueError(f"{rel} was not made under {protocol.name}: {'; '.join(diff)}")
    return [p for p, _ in found]


def trained(frame: pd.DataFrame) -> list[str]:
    return [m for m in stats.method_order(frame["method"]) if m not in stats.REFERENCE]


def _ratio(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(geometric-mean ratio a / b over the seeds both have, raw paired p) from scores (inf = diverged, NaN = not
    run)."""
    both = ~(np.isnan(a) | np.isnan(b))
    a, b = a[both], b[both]
    return math.exp(float(np.mean(stats.ln_ratio(a, b)))), stats.paired_test(a, b)["p"]


def _scores(frame: pd.DataFrame, column: str) -> pd.DataFrame:
    """(function, seed) x method table of scores (inf = diverged)."""
    tidy = frame.assign(score=stats.scores(frame, column)).dropna(subset=["score"])
    return tidy.pivot_table(index=["function", "seed"], columns="method", values="score", aggfunc="first")


def against(mine: pd.DataFrame, base: pd.DataFrame, metric: str = "test-at-best-train") -> dict[str, pd.DataFrame]:
    """Each trained method of `mine` against the baselines: {"across": one row per (method, baseline),
    "functions": one row per (method, function), "rank": one row per method}. A method of `mine` named as a
    baseline is renamed "<name> (yours)"."""
    column = stats.metric_column(metric)
    mine = mine[~mine["method"].isin(stats.REFERENCE)]  # the baselines carry the reference rows
    clash = set(mine["method"]) & set(base["method"])
    mine = mine.assign(method=mine["method"].map(lambda m: f"{m} (yours)" if m in clash else m))
    keys = ["arch", "budget"]
    mine = mine.assign(**{k: base[k].iloc[0] for k in keys})  # one protocol: one cell per function
    across, per_function, ranks = [], [], []
    baselines = trained(base)
    table = _scores(pd.concat([base, mine]), column)
    for method in trained(mine):
        rows = []
        for b in baselines:
            frame = pd.concat([mine[mine["method"] == method], base[base["method"] == b]])
            row = stats.across_functions(frame, metric, baseline=b)
            rows.append(row[row["method"] == method])
        rows = pd.concat(rows, ignore_index=True)
        rows["p_holm"] = stats.holm(rows["p"])
        rows["outcome"] = stats.claimed(rows["outcome"], rows["p_holm"], rows["ci_low"], rows["ci_high"], null=1.0)
        across.append(rows)
        place = []
        for function, g in table.groupby(level="function"):
            g = g[g[method].notna()]  # the seeds the method ran: every mean and pair is on them
            if g.empty:
                continue
            means = g[[*baselines, method]].mean()  # over seeds; inf when a seed diverged
            best = means[baselines].idxmin()
            ratio_lora, p_lora = _ratio(g[method].to_numpy(float), g[adapters.BASELINE].to_numpy(float))
            ratio_best, p_best = _ratio(g[method].to_numpy(float), g[best].to_numpy(float))
            per_function.append(
                {
                    "method": method,
                    "function": function,
                    "seeds": int(g[method].notna().sum()),
                    "mse": means[method],
                    "lora": means[adapters.BASELINE],
                    "ratio_lora": ratio_lora,
                    "p_lora": p_lora,
                    "best": best,
                    "ratio_best": ratio_best,
                    "p_best": p_best,
                }
            )
            place.append(int((means < means[method]).sum()) + 1)
        ranks.append(
            {"method": method, "mean_rank": float(np.mean(place)), "of": len(baselines) + 1, "functions": len(place)}
        )
    return {"across": pd.concat(across, ignore_index=True), "functions": pd.DataFrame(per_function), "rank": ranks}


def leaderboard(base: pd.DataFrame, metric: str = "test-at-best-train") -> pd.DataFrame:
    """One row per trained method of the baselines: mean rank over functions (by mean MSE among the trained
    methods, on the seeds they all have), wins / ties / losses against LoRA per function (stats.compare: Holm over
    every function and method), the geometric-mean ratio to LoRA across functions with its interval and outcome
    (stats.across_functions), trainable parameters, seeds. Sorted by mean rank."""
    column = stats.metric_column(metric)
    table = _scores(base, column)
    methods = trained(base)
    # (functions, methods) on the seeds every method has: one of 5 seeds is ranked on the same seeds as one of 10
    means = table[methods].dropna().groupby(level="function").mean()
    rank = means.rank(axis=1, method="average").mean()
    wtl = stats.win_tie_loss(stats.compare(base, metric)).set_index("method")
    across = stats.across_functions(base, metric).set_index("method")
    rows = []
    for m in methods:
        g = base[base["method"] == m]
        is_lora = m == adapters.BASELINE
        rows.append(
            {
                "method": m,
                "mean_rank": rank[m],
                "wins": None if is_lora else wtl.loc[m, "wins"],
                "ties": None if is_lora else wtl.loc[m, "ties"],
                "losses": None if is_lora else wtl.loc[m, "losses"],
                "gm_ratio": 1.0 if is_lora else across.loc[m, "gm_ratio"],
                "ci_low": None if is_lora else across.loc[m, "ci_low"],
                "ci_high": None if is_lora else across.loc[m, "ci_high"],
                "outcome": "" if is_lora else across.loc[m, "outcome"],
                "trainable": int(g["trainable_params"].iloc[0]),
                "seeds": int(g["seed"].nunique()),
                "functions": int(g["function"].nunique()),
            }
        )
    return pd.DataFrame(rows).sort_values(["mean_rank", "method"], kind="stable").reset_index(drop=True)


def _wtl(row) -> str:
    if pd.isna(row["wins"]):
        return ""
    return " / ".join(str(int(row[k])) for k in ("wins", "ties", "losses"))


def _ci(row) -> str:
    if row["ci_low"] is None or pd.isna(row["ci_low"]):
        return ""
    return f"[{text.num(row['ci_low'], 3)}, {text.num(row['ci_high'], 3)}]"


def leaderboard_markdown(
    base: pd.DataFrame, protocol: protocols.Protocol, metric: str = "test-at-best-train", bench: dict | None = None
) -> str:
    """docs/results/leaderboard.md: the leaderboard table with what it shows and where its records are; `bench`, a
    `qlbench bench` report of the same methods, gives the µs / step column (blank where it has no row)."""
    board = leaderboard(base, metric)
    times = step_times(bench, protocol.arch) if bench else {}
    board["us_per_step"] = [times.get(m) for m in board["method"]]
    commits = ", ".join(sorted({c[:7] for c in base["commit"].dropna()}))
    cols = [
        text.Column("rank", lambda r: f"{r['mean_rank']:.2f}"),
        text.Column("method", "method"),
        text.Column("× LoRA (geometric mean)", lambda r: text.num(r["gm_ratio"], 3)),
        text.Column("95% CI", _ci),
        text.Column("across functions", "outcome"),
        text.Column("W / T / L vs LoRA", _wtl),
        text.Column("trainable", lambda r: f"{r['trainable']:,}"),
        text.Column("µs / step", lambda r: "" if r["us_per_step"] is None else f"{r['us_per_step']:,.0f}"),
        text.Column("seeds", "seeds"),
    ]
    speed = ""
    if bench:
        meta, E = bench["meta"], min(r["members"] for r in bench.get("throughput", []) + bench.get("members", []))
        threads = bench.get("settings", {}).get("threads") or meta.get("threads")
        device = meta.get("gpu") or f"a {meta.get('cpu_count')}-core {meta.get('cpu')} CPU"
        speed = (
            f" µs / step: one member's training step, from `qlbench bench --quick` at {E} members stacked (the path "
            f"each method trains on), {threads} thread(s) on {device}: bench/{protocol.name}.json."
        )
    functions = ", ".join(protocol.functions)
    return "\n".join(
        [
            f"# Leaderboard: {protocol.name}",
            "",
            f"Protocol {protocol.name}: {protocol.arch}, {protocol.backbone_init} backbone init, budget "
            f"{protocol.budget}, {protocol.dtype}, the nine functions ({functions}), seeds "
            f"{protocol.seeds[0]}-{protocol.seeds[-1]}. Metric: {stats.metric(metric).label}.",
            "",
            "rank: the mean over functions of each method's place by mean MSE among these methods (1 = lowest), on the "
            "seeds they all have. "
            "× LoRA: the geometric-mean MSE ratio to LoRA over every (function, seed) pair, with its hierarchical "
            "bootstrap interval; across functions: win or loss where the paired test on the log ratios is below "
            "0.05 after Holm over the methods and the interval excludes 1, else tie. W / T / L: functions won, tied "
            "and lost against LoRA, each a paired test over seeds, Holm over every function and method. "
            "The reference rows (frozen, mean) are not ranked.",
            "",
            text.table(board.to_dict("records"), cols),
            "",
            f"Provenance: records from commit(s) {commits}; per-seed records: baselines/{protocol.name}/"
            f"{per_seed.FILE}; rebuilt by `qlbench compare --leaderboard` (tests/test_compare.py checks it).{speed}",
            "",
        ]
    )
