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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from qlbench import adapters, inputs, instances, protocols, text, zoo
from qlbench.metrics import board, stats, validity
from qlbench.records import per_seed, results, store

REPOSITORY = Path(__file__).resolve().parents[1]


def baselines_file(protocol: str) -> Path:
    """Where a protocol's committed baselines live in the repository (docs/results/baselines/<name>/)."""
    return REPOSITORY / "docs" / "results" / "baselines" / protocol / per_seed.FILE


def aa_file(protocol: str) -> Path:
    """Where a protocol's A/A rows live: LoRA twins run under it (docs/results/baselines/<name>-aa/)."""
    return REPOSITORY / "docs" / "results" / "baselines" / f"{protocol}-aa" / per_seed.FILE


def aa_line(aa: pd.DataFrame, base: pd.DataFrame, protocol: str, metric: str = "test-at-best-train") -> str:
    """The A/A check of a board: each twin of LoRA against LoRA (`summary`), and how far single seeds of the twin
    stray from LoRA's (the median and largest |ratio - 1| over the finite pairs): a benchmark whose A/A pair is
    not a tie is miscalibrated."""
    rows = summary(aa, base, metric)
    table = board.score_table(pd.concat([base[base["method"] == adapters.BASELINE], aa]), metric)
    parts = []
    for r in rows.to_dict("records"):
        name = r["method"].removesuffix(" (yours)")
        ratio = (table[name] / table[adapters.BASELINE]).dropna()
        stray = (ratio[np.isfinite(ratio)] - 1).abs()
        parts.append(
            f"{name} × LoRA {text.num(r['x_lora'], 3)} [{text.num(r['lora_low'], 3)}, {text.num(r['lora_high'], 3)}]"
            f", {r['lora_outcome']} (single seeds stray from LoRA's by {stray.median():.1%} in the median, "
            f"{stray.max():.0%} at most)"
        )
    commits = ", ".join(sorted({c[:7] for c in aa["commit"].dropna()}))
    return (
        f"A/A check (baselines/{protocol}-aa/, records from commit(s) {commits}): LoRA run again as other methods "
        f"must tie with it. {'; '.join(parts)}. lora-twin is LoRA written as an outside method, drawn from its own "
        "random stream; peft:lora starts from lora's draws at lora's scale, and differs only in the order of its "
        "float32 operations."
    )


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


def check_records(folder: Path, protocol: protocols.Benchmark, on_damaged=None) -> list[Path]:
    """The record files of a results folder, every one made under `protocol`; ValueError (one line) for the first
    that is not, naming the difference, and for a folder without records."""
    found = results._records(inputs.folder(folder, "results folder"), on_damaged)
    if not found:
        raise ValueError(f"no records in {folder}")
    shipped = None
    if protocol.backbones:
        try:
            shipped = instances.manifest(protocol.instances, protocol.backbones)
        except store.DamagedFile as err:
            raise ValueError(str(err)) from None
    for path, rec in found:
        rel = Path(path).relative_to(folder) if Path(path).is_relative_to(folder) else path
        cards = (rec["run_info"].get("settings") or {}).get("cards")
        if diff := protocol.differences(rec["run_info"]["config"], cards):
            raise ValueError(f"{rel} was not made under {protocol.name}: {'; '.join(diff)}")
        if shipped and (other := backbone_mismatch(rec, shipped)):
            raise ValueError(f"{rel}: {other}; its pairs with the {protocol.name} baselines would pair two networks")
    return [p for p, _ in found]


def backbone_mismatch(rec: dict, shipped: dict[tuple[str, int], str]) -> str:
    """The first seed of a record whose backbone digest (train_info.per_seed[].backbone_digest) is not the one the
    protocol ships for its (function, seed) (a task variant's: its card's), as a phrase; "" when every recorded
    digest agrees (a record written before records held digests has none to check)."""
    function = str(rec["run_info"]["config"].get("function"))
    card = function.partition(zoo.VARIANT)[0]
    for s in rec["train_info"].get("per_seed", []):
        got, want = s.get("backbone_digest"), shipped.get((card, s.get("seed")))
        if got is not None and want is not None and got != want:
            return f"{function} seed {s['seed']} was trained on backbone {got}, not the protocol's {want}"
    return ""


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


def summary(mine: pd.DataFrame, base: pd.DataFrame, metric: str = "test-at-best-train") -> pd.DataFrame:
    """`qlbench compare`'s short answer, one row per trained method of `mine` (named "<name> (yours)" where a baseline
    has its name): its ratio to LoRA, to the best baseline of the board (the first row, its own place aside), to
    `frozen` and to `mean`, each the geometric mean over the finite (function, seed) pairs it shares with that row
    with its hierarchical-bootstrap interval and a claim (win or loss where the interval excludes 1 and the paired
    test's Holm p over the four is below 0.05, as `stats.across_functions`); its divergence rate; its place among
    the baselines with the bootstrap interval (board.headline over the baselines and it alone), and how many
    baselines it is told apart from."""
    column = stats.metric_column(metric)
    mine = mine[~mine["method"].isin(stats.REFERENCE)]
    clash = set(mine["method"]) & set(base["method"])
    mine = mine.assign(method=mine["method"].map(lambda m: f"{m} (yours)" if m in clash else m))
    mine = mine.assign(**{k: base[k].iloc[0] for k in ("arch", "budget")})  # one protocol: one cell per function
    rows = []
    for method in trained(mine):
        own = mine[mine["method"] == method]
        pooled = pd.concat([base, own])
        board_ = board.headline(pooled, metric).set_index("method")
        best = next(m for m in board_.index if m != method)
        row = {
            "method": method,
            "seeds": int(board_.loc[method, "seeds"]),
            "functions": int(own["function"].nunique()),
            "divergence": board_.loc[method, "divergence"],
            "place": int(board_.loc[method, "place"]),
            "place_low": int(board_.loc[method, "place_low"]),
            "place_high": int(board_.loc[method, "place_high"]),
            "of": len(board_),
            "told_apart": int(board_.loc[method, "told_apart"]),
            "best": best,
        }
        claims = []
        for key, other in (("lora", adapters.BASELINE), ("best", best), ("frozen", "frozen"), ("mean", "mean")):
            pair = pooled[pooled["method"].isin([method, other])]
            finite = pair[np.isfinite(stats.scores(pair, column))]  # divergence is its own column
            both = finite.groupby(["function", "seed"])["method"].transform("nunique") == 2
            across = stats.across_functions(finite[both], metric, baseline=other)
            got = across[across["method"] == method]
            if got.empty:
                row |= {f"x_{key}": math.nan, f"{key}_low": math.nan, f"{key}_high": math.nan}
                claims.append(math.nan)
                continue
            g = got.iloc[0]
            row |= {f"x_{key}": g["gm_ratio"], f"{key}_low": g["ci_low"], f"{key}_high": g["ci_high"]}
            claims.append((g["p"], g["ci_low"], g["ci_high"], "win" if g["gm_ratio"] < 1 else "loss"))
        p_holm = stats.holm([c[0] if isinstance(c, tuple) else math.nan for c in claims])
        for key, c, ph in zip(("lora", "best", "frozen", "mean"), claims, p_holm):
            ok = isinstance(c, tuple) and ph < stats.ALPHA and not (c[1] <= 1 <= c[2])
            row[f"{key}_outcome"] = c[3] if ok else ("" if not isinstance(c, tuple) else "tie")
        rows.append(row)
    return pd.DataFrame(rows)


def own_reference(mine: pd.DataFrame, base: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(your methods, the baselines with your own `lora` in place of the committed one): the ratios to LoRA then
    share one machine's numerics (docs/extending.md). ValueError (one line) when RESULTS holds no lora."""
    lora = mine[mine["method"] == adapters.BASELINE]
    if lora.empty:
        raise ValueError("--own-lora needs lora in RESULTS: run it beside your method (--methods lora,M)")
    rest = mine[mine["method"] != adapters.BASELINE]
    if not trained(rest):
        raise ValueError("RESULTS holds only lora: nothing to compare with it")
    lora = lora.assign(**{k: base[k].iloc[0] for k in ("arch", "budget")})
    return rest, pd.concat([base[base["method"] != adapters.BASELINE], lora], ignore_index=True)


def leaderboard(base: pd.DataFrame, metric: str = "test-at-best-train") -> pd.DataFrame:
    """One row per trained method of the baselines (`board.headline`: the ratio to LoRA over finite pairs with its
    interval, the divergence rate, the ratios to frozen and mean, the place and its interval, the group it cannot be
    told apart from), with its trainable parameters. Sorted by ratio, never by a bare mean rank."""
    out = board.headline(base, metric)
    first = base.drop_duplicates("method").set_index("method")["trainable_params"]
    return out.assign(trainable=[int(first[m]) for m in out["method"]])


def _ci(row) -> str:
    if pd.isna(row["ci_low"]):
        return ""
    return f"[{text.num(row['ci_low'], 3)}, {text.num(row['ci_high'], 3)}]"


def _group(row) -> str:
    """ "top" (cannot be told from the first) or "told apart from N"; the count of the rest in its group."""
    where = "top" if row["top"] else f"apart from {row['told_apart']}"
    return f"{where}; ties {len(row['group'])}"


def separation_line(board_: pd.DataFrame, base: pd.DataFrame, metric: str) -> str:
    """How many pairs the board tells apart, both ways: its groups (board.headline's told_apart, each pair counted
    from both sides) and Demšar's test on the same frame (board.nemenyi)."""
    n, apart = len(board_), int(board_["told_apart"].sum()) // 2
    nem = board.nemenyi(base, metric)
    told = (
        f"Pairs told apart: {apart} of {n * (n - 1) // 2} (t-test over tasks of the per-task mean log "
        f"ratio, Holm over every pair); "
    )
    if nem["friedman_p"] is None:
        return told + (
            f"Demšar's Nemenyi test: not run ({nem['methods']} trained methods; Friedman's test needs "
            f"{board.MIN_FRIEDMAN})."
        )
    return told + (
        f"Demšar's Nemenyi test on mean ranks: {nem['apart']} of {nem['pairs']} "
        f"(critical difference {nem['cd']:.1f} places over {nem['tasks']} tasks; Friedman p {nem['friedman_p']:.3g}, "
        f"Kendall's W {nem['kendall_w']:.2f})."
    )


@dataclass(frozen=True)
class Yours:
    """A user's entry on the leaderboard: their records, where they came from (the RESULTS folder as given) and a
    `qlbench bench` report of their methods, if any."""

    records: pd.DataFrame
    source: str
    bench: dict | None = None


def placed(base: pd.DataFrame, mine: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, str]]:
    """The baselines with a user's trained methods beside them as "<name> (yours)" (one protocol: its arch and
    budget), and {name: shown name}."""
    mine = mine[~mine["method"].isin(stats.REFERENCE)]
    ours = {m: f"{m} (yours)" for m in mine["method"].unique()}
    mine = mine.assign(method=mine["method"].map(ours), **{k: base[k].iloc[0] for k in ("arch", "budget")})
    return pd.concat([base, mine], ignore_index=True), ours


def leaderboard_markdown(
    base: pd.DataFrame,
    protocol: protocols.Benchmark,
    metric: str = "test-at-best-train",
    bench: dict | None = None,
    figure: str | None = None,
    yours: Yours | None = None,
    aa: pd.DataFrame | None = None,
) -> tuple[str, pd.DataFrame]:
    """docs/results/leaderboard.md and the board it shows (`leaderboard`, for `forest_figure`): the leaderboard
    table with what it shows and where its records are; `bench`, a
    `qlbench bench` report of the same methods, gives the µs / step column (blank where it has no row); `figure`,
    a path relative to the page, adds the forest plot beside it (`forest_figure`). `yours`: a user's records, placed
    among the baselines as "<name> (yours)", with their step times where a bench report of them is given. `aa`: the
    protocol's A/A rows (`aa_file`), checked on the page."""
    commits = ", ".join(sorted({c[:7] for c in base["commit"].dropna()}))
    times = step_times(bench, protocol.arch) if bench else {}
    note = ""
    if yours is not None:
        mine, mine_source = yours.records, yours.source
        base, ours = placed(base, mine)
        mine_times = step_times(yours.bench, protocol.arch) if yours.bench else {}
        times |= {ours[m]: t for m, t in mine_times.items() if m in ours}
        theirs = ", ".join(sorted({c[:7] for c in mine["commit"].dropna()})) or "unknown"
        lacking = [m for m in ours.values() if m not in times]
        why = (
            f" No µs / step for {', '.join(lacking)}: no bench report of {'it' if len(lacking) == 1 else 'them'} "
            f"in {mine_source} (`qlbench bench --quick --archs {protocol.arch} --only throughput,members --threads 1 "
            f"--methods ... --out {mine_source}/bench` adds it)."
            if lacking
            else ""
        )
        note = f" Your methods: records in {mine_source}, from commit(s) {theirs}.{why}"
    board_ = leaderboard(base, metric)
    board_["us_per_step"] = [times.get(m) for m in board_["method"]]
    board_["lr"] = (
        [rates.get(m, math.nan) for m in board_["method"]] if (rates := board.chosen_rates(base)) else math.nan
    )
    fixed = protocol.budget_fields()["adapt"]["lr"]
    cols = [
        text.Column("place", lambda r: f"{r['place']} [{r['place_low']}, {r['place_high']}]"),
        text.Column("method", "method"),
        text.Column("× LoRA", lambda r: text.num(r["ratio"], 3)),
        text.Column("95% CI", _ci),
        text.Column("diverged", lambda r: f"{r['divergence']:.0%}"),
        text.Column("× frozen", lambda r: text.num(r["x_frozen"], 3)),
        text.Column("× mean", lambda r: text.num(r["x_mean"], 3)),
        text.Column("group", _group),
        text.Column("lr", lambda r: f"{fixed:g} (fixed)" if pd.isna(r["lr"]) else f"{r['lr']:g}"),
        text.Column("trainable", lambda r: f"{r['trainable']:,}"),
        text.Column("µs / step", lambda r: "" if pd.isna(r["us_per_step"]) else f"{r['us_per_step']:,.0f}"),
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
    plot = [f"![forest plot: each method's ratio to LoRA with its interval]({figure})", ""] if figure else []
    page = "\n".join(
        [
            f"# Leaderboard: {protocol.name}",
            "",
            f"Protocol {protocol.name}: {protocol.arch}, {protocol.backbone_init} backbone init, budget "
            f"{protocol.budget}, {protocol.dtype}, {len(protocol.functions)} tasks ({functions}), seeds "
            f"{protocol.seeds[0]}-{protocol.seeds[-1]}. Metric: {stats.metric(metric).label}.",
            "",
            "× LoRA: the geometric-mean MSE ratio to LoRA over the finite (function, seed) pairs (both trained without "
            "diverging), with its 95% hierarchical bootstrap interval (functions, then seeds); sorted by it. "
            "diverged: the share of the method's seeds that diverged, counted here and not in the ratio. "
            "× frozen, × mean: the same ratio against the reference rows (below 1: better than not adapting, and "
            "than a constant). place: its place by × LoRA, with the 95% interval of its place over the same bootstrap "
            "draws. group: top when it cannot be told apart from the first row; ties: how many methods it cannot be "
            "told apart from (a t-test over functions of the per-function mean log ratio of the pair, Holm over every "
            f"pair). {protocol.lr_rule()}",
            "",
            separation_line(board_, base, metric),
            "",
            *([aa_line(aa, base, protocol.name, metric), ""] if aa is not None else []),
            *plot,
            text.table(board_.to_dict("records"), cols),
            "",
            f"Provenance: records from commit(s) {commits}; per-seed records: baselines/{protocol.name}/"
            f"{per_seed.FILE}; rebuilt by `qlbench compare --leaderboard` (tests/test_compare.py checks it).{speed}"
            f"{note}",
            "",
        ]
    )
    return page, board_


def forest_figure(board_: pd.DataFrame, title: str):
    """A forest plot of a leaderboard (`leaderboard`): each method's ratio to LoRA (log scale) with its interval,
    in board order; a method that diverged on some seeds in red with its share; the top group filled."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 0.22 * len(board_) + 1.2))
    ax = fig.add_subplot()
    y = np.arange(len(board_))[::-1]
    for yi, r in zip(y, board_.to_dict("records")):
        color = "tab:red" if r["divergence"] > 0 else "tab:blue"
        if np.isfinite(r["ci_low"]):
            ax.plot([r["ci_low"], r["ci_high"]], [yi, yi], color=color, lw=1.2)
        ax.plot([r["ratio"]], [yi], "o", color=color, mfc=color if r["top"] else "white", ms=4)
        if r["divergence"] > 0:
            ax.annotate(f"{r['divergence']:.0%} diverged", (r["ratio"], yi), xytext=(6, -3), textcoords="offset points",
                        fontsize=6, color=color)  # fmt: skip
    ax.axvline(1.0, color="0.5", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_yticks(y, board_["method"], fontsize=7)
    ax.set_xlabel("MSE × LoRA (geometric mean over finite pairs, 95% interval)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


AGGREGATES = {  # validity.aggregates' columns as a reader names them
    "mean_rank": "mean rank over tasks (zoo-v1's published order)",
    "ratio_all": "× LoRA over every pair (a diverged seed: inf)",
    "ratio_finite": "× LoRA over finite pairs (the leaderboard's order)",
    "median_task_ratio": "median over tasks of × LoRA",
    "divergence": "share of seeds diverged",
    "worse_than_frozen": "share of tasks worse than frozen",
}


def validity_markdown(
    base: pd.DataFrame, protocol: protocols.Benchmark, reference: pd.DataFrame, source: str, metric: str
) -> tuple[str, pd.DataFrame]:
    """The external-validity page of a protocol's baselines against real fine-tuning accuracies (`validity.correlate`):
    (Markdown, the correlation table as a frame)."""
    out = validity.correlate(base, reference, metric)
    if out["matched"].empty:
        raise ValueError(f"no tuner of {source} is on the {protocol.name} baselines (as peft:<tuner>)")
    table = out["table"].assign(protocol=protocol.name)
    r2 = lambda v: "" if pd.isna(v) else f"{v:+.2f}"
    cols = [
        text.Column("aggregate", lambda r: AGGREGATES.get(r["aggregate"], r["aggregate"])),
        text.Column("tuners", "tuners"),
        text.Column("Spearman", lambda r: r2(r["spearman"])),
        text.Column("95% CI", lambda r: f"[{r2(r['spearman_low'])}, {r2(r['spearman_high'])}]"),
        text.Column("Kendall", lambda r: r2(r["kendall"])),
        text.Column(" 95% CI", lambda r: f"[{r2(r['kendall_low'])}, {r2(r['kendall_high'])}]"),
    ]
    m = out["matched"].sort_values("accuracy", ascending=False)
    tuner_cols = [
        text.Column("tuner", "tuner"),
        text.Column("best configuration", "config"),
        text.Column("GSM8K accuracy", lambda r: f"{r['accuracy']:.4f}"),
        text.Column("mean rank", lambda r: f"{r['mean_rank']:.2f}"),
        text.Column("× LoRA (finite)", lambda r: text.num(r["ratio_finite"], 3)),
        text.Column("diverged", lambda r: f"{r['divergence']:.0%}"),
    ]
    commits = ", ".join(sorted({c[:7] for c in base["commit"].dropna()}))
    unmatched = f" Not on the board: {', '.join(out['unmatched'])}." if out["unmatched"] else ""
    page = "\n".join(
        [
            f"# External validity: {protocol.name} against real fine-tuning",
            "",
            f"Does the order of the {protocol.name} baselines predict peft's own method comparison (Llama-3.2-3B "
            f"fine-tuned on MetaMathQA, scored on GSM8K)? Reference: {source}, the design split of peft's "
            "method_comparison results (one row per tuner and configuration; each tuner at its best configuration, "
            "matched to the board's peft:<tuner>). The other tuners' results are reserved for review and are not "
            "read. Each correlation is signed so that +1 means the board puts the most accurate tuner first; its "
            f"interval is a 95% percentile bootstrap over the tuners ({validity.RESAMPLES:,} draws).{unmatched}",
            "",
            text.table(table.to_dict("records"), cols),
            "",
            text.table(m.to_dict("records"), tuner_cols),
            "",
            f"Provenance: records from commit(s) {commits}; per-seed records: baselines/{protocol.name}/"
            f"{per_seed.FILE}; reference: validity/{source}; rebuilt by `qlbench compare --protocol {protocol.name} "
            "--validity` "
            "(tests/test_compare.py checks it).",
            "",
        ]
    )
    return page, table
