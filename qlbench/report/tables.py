"""Results as tables: the run table (one row per method), the paper tables (one row per function, one column per
method, one per (arch, budget) and metric), the paired statistics and the gradient concentration, as DataFrames of
text, with their legends. Numbers and Markdown come from `qlbench.text`; rendering to LaTeX and files is
`qlbench.report.write`'s.

A cell says how many seeds it stands on, and a diverged seed makes the cell inf (see `qlbench.metrics.stats`).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from qlbench import adapters, text
from qlbench.metrics import stats

# --------------------------------------------------------------------------------------------------------------
# The run table: one row per method, what `qlbench run` prints.


def _cell_status(g: pd.DataFrame) -> str:
    if (g["status"] == "failed").any() or (g["cell_status"] == "failed").any():
        return "failed"
    return "diverged" if (g["status"] == "diverged").any() else "ok"


SOURCE_AFTER = "source test MSE after"


def _source_after(g: pd.DataFrame) -> str:
    """mean ± std over the seeds of the adapted model's source-task test MSE; "-" for records without it."""
    v = g.get("source_test_mse_after", pd.Series(dtype=float))
    v = v[np.isfinite(v)]  # NaN: a record without the field, or a seed whose value was not finite
    return text.mean_std(v.mean(), v.std(ddof=1), len(v)) if len(v) else "-"


def method_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (function, arch, budget, method): status (ok | diverged: some seed diverged | failed), n seeds,
    diverged k/n, trainable parameters and their ratio to LoRA, each metric, the source task's test MSE after
    adaptation (how much of the source the adaptation kept; `frozen`'s is the pretrained backbone's), and the cell's
    cost (COST_LEGEND; the full cost table is `cost_table`): adapter KB, peak step MB, latency at batch 256 over the
    frozen backbone's.

    A metric reads mean ± sample std over the n seeds when none diverged. With k diverged seeds it reads
    "inf (n-k ok: mean ± std)": inf is the cell's value in every ranking and test (a diverged seed counts as
    MSE = inf), and the survivors' mean is shown with the count it stands on, never alone. A failed cell is a row
    with status failed. Budgets are never mixed: key columns that vary are kept.
    """
    keys = ["function", "arch", "budget"]
    metrics = stats.METRICS.values()
    summaries = {m.column: stats.summarize(frame, m.column).set_index(stats.CELL + ["method"]) for m in metrics}
    rows = []
    for (function, arch, budget), cell in frame.groupby(keys, sort=False):
        lora = cell.loc[cell["method"] == "lora", "trainable_params"]
        for method, g in cell.groupby("method", sort=False):
            params = g["trainable_params"].iloc[0]
            n_div = int((g["status"] == "diverged").sum())
            row = {
                "function": function,
                "arch": arch,
                "budget": budget,
                "method": method,
                "status": _cell_status(g),
                "n": len(g),
                "diverged": f"{n_div}/{len(g)}",
                "trainable": "-" if pd.isna(params) else f"{int(params):,}",
                "× LoRA": f"{params / lora.iloc[0]:.3f}" if len(lora) and not pd.isna(params) and params else "-",
            }
            key = (arch, budget, function, method)
            row |= {m.label: text.seed_cell(summaries[m.column].loc[key]) for m in metrics}
            row[SOURCE_AFTER] = _source_after(g)
            row |= _size_cells(g)
            row["b256 latency × frozen"] = _ratio(_median(g, "latency_b256_s"), _median(g, "frozen_latency_b256_s"))
            rows.append(row)
    table = pd.DataFrame(rows)
    drop = [k for k in keys if table[k].nunique() <= 1] if len(table) else []
    return table.drop(columns=drop)


# --------------------------------------------------------------------------------------------------------------
# Paper-layout tables: one row per function, one column per method, one table per (arch, budget) and metric.

# The marks of a paper table per output format: best overall, best adapter, significant vs LoRA, ±, <.
MARKS = {
    "md": {"bold": "**bold**", "italic": "*italic*", "dagger": "†", "pm": "±", "lt": "<"},
    "latex": {
        "bold": r"\textbf{bold}",
        "italic": r"\textit{italic}",
        "dagger": r"\textsuperscript{$\dagger$}",
        "pm": r"$\pm$",
        "lt": "$<$",
    },
}


def table_data(frame: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Long form of the paper tables, one row per (arch, budget, function, method): metric, the `stats.summarize`
    columns, best_overall / best_adapter (lowest inf-aware mean among non-reference methods / adapters), p_vs_lora
    (raw), p_holm_vs_lora (Holm-adjusted over the table's comparisons, `stats.compare`), vs_lora (win | tie | loss,
    decided on p_holm_vs_lora) and sig_vs_lora (the table's † mark). This is what the CSV holds."""
    data = stats.summarize(frame, stats.metric_column(metric))
    data["best_overall"] = stats.best_mask(data, lambda m: m not in stats.REFERENCE)
    data["best_adapter"] = stats.best_mask(data, stats.is_adapter)
    vs = stats.compare(frame, metric, adapters.BASELINE)[stats.CELL + ["method", "p", "p_holm", "outcome"]]
    vs = vs.rename(columns={"p": "p_vs_lora", "p_holm": "p_holm_vs_lora", "outcome": "vs_lora"})
    data = data.merge(vs, on=stats.CELL + ["method"], how="left")
    data["sig_vs_lora"] = data["vs_lora"].isin(["win", "loss"]) & ~data["method"].isin(stats.REFERENCE)
    return data.assign(metric=metric)[["metric", *data.columns]]


def one_slice(data: pd.DataFrame) -> tuple[str, str]:
    """The (arch, budget) of a paper table's data; ValueError when it mixes several (tables never mix them)."""
    slices = data[["arch", "budget"]].drop_duplicates()
    if len(slices) != 1:
        raise ValueError(f"a paper table holds one (arch, budget), got {len(slices)}: split the frame first")
    return tuple(slices.iloc[0])


def _seeds(data: pd.DataFrame) -> int:
    """The seed count most cells stand on (others are marked n=k)."""
    return int(data["n"].mode().iloc[0])


def _cell_text(r, n_common: int, fmt: str) -> str:
    """One paper-table cell: mean ± std, "inf (k/n div.; m ok: mean ± std)", "failed"; (n=k) when not n_common
    seeds; † when the method differs significantly from LoRA."""
    if r.n_diverged:  # the survivors' mean with the count it stands on, as the README says
        ok = f"; {r.n_ok} ok: {text.mean_std(r.mean_ok, r.std_ok, r.n_ok, fmt)}" if r.n_ok else ""
        cell = f"inf ({r.n_diverged}/{r.n} div.{ok})"
    elif r.n_ok == 0:
        cell = "failed" if r.n_failed else "n/a"
    else:
        cell = text.mean_std(r.mean_ok, r.std_ok, r.n_ok, fmt) + ("" if r.n_ok == n_common else f" (n={r.n_ok})")
    return cell + (MARKS[fmt]["dagger"] if r.sig_vs_lora else "")


def grid(data: pd.DataFrame, fmt: str) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(text, bold, italic), each function x method (methods in stats.method_order, "-" = not run)."""
    n_common = _seeds(data)
    data = data.assign(text=[_cell_text(r, n_common, fmt) for r in data.itertuples()])
    functions, methods = sorted(data["function"].unique()), stats.method_order(data["method"])

    def wide(col: str) -> pd.DataFrame:  # (functions, methods)
        return data.pivot(index="function", columns="method", values=col).reindex(index=functions, columns=methods)

    cells = wide("text").fillna("-")
    cells.columns.name, cells.index.name = "function", None
    return cells, wide("best_overall").eq(True), wide("best_adapter").eq(True)


def legend(data: pd.DataFrame, fmt: str) -> str:
    """What the marks mean, how many comparisons the † family holds (its Holm correction), the seed count, inf =
    diverged."""
    k = MARKS[fmt]
    family = int(data["p_holm_vs_lora"].notna().sum())  # every (function, trained method) compared with LoRA
    return (
        f"{k['bold']} = lowest mean overall; {k['italic']} = lowest mean among adapters (full fine-tuning excluded); "
        f"{k['dagger']} = differs from LoRA, paired by seed, Holm-adjusted p {k['lt']} 0.05 over the table's "
        f"{family} comparisons of trained methods with LoRA (raw p in the paired-statistics table; paired t-test, "
        "Wilcoxon signed-rank "
        f"when a seed diverged; at least 3 pairs); inf (k/n div.; m ok: mean {k['pm']} std) = k of n seeds diverged, "
        "counted as MSE = inf in every mark and test, the m survivors' mean shown; frozen and mean are reference "
        f"columns, never marked; mean {k['pm']} sample std over n = {_seeds(data)} seeds unless marked (n=k); "
        "- = not run."
    )


def title(data: pd.DataFrame) -> str:
    """A paper table's title: metric, arch, budget."""
    arch, budget = one_slice(data)
    return f"{stats.metric(data['metric'].iloc[0]).label}, {arch}, budget {budget}"


def paper_markdown(data: pd.DataFrame) -> str:
    """The Markdown paper table of one (arch, budget) slice of `table_data`, its legend below."""
    one_slice(data)
    cells, bold, italic = grid(data, "md")
    wrap = pd.DataFrame(
        np.select([bold & italic, bold, italic], ["***", "**", "*"], ""), index=cells.index, columns=cells.columns
    )
    body = (wrap + cells + wrap).reset_index().rename(columns={"index": "function"})
    return f"{text.markdown(body)}\n\n{legend(data, 'md')}"


# --------------------------------------------------------------------------------------------------------------
# Paired statistics tables (stats.compare / stats.win_tie_loss rendered as text).

STATS_LEGEND = (
    "Paired by seed within the function; diff = method - baseline (negative = lower MSE). t p and the "
    "CI are n/a when a seed diverged (inf); Wilcoxon ranks a diverged seed above every finite one. Wilcoxon p and "
    "t p are raw; Holm p is the primary p (t-test, else Wilcoxon) Holm-adjusted over this table's family (every "
    "function x trained method against the baseline), since a table makes that many claims at once; frozen and mean "
    "are reference rows (result: reference), outside the family. result: win/loss "
    "when Holm p < 0.05 with at least 3 pairs, else tie. An exact two-sided "
    "Wilcoxon cannot go below 0.25 with 3 pairs and 0.0625 with 5. Sign test: wins vs losses across "
    "functions, ties dropped."
)


def _method_key(col: pd.Series) -> pd.Series:
    """Sort key: methods in stats.method_order, anything else as is."""
    if col.name != "method":
        return col
    order = {m: i for i, m in enumerate(stats.method_order(col))}
    return col.map(order)


def _diff_text(r) -> str:
    """mean paired difference [95% CI]; the CI is n/a when a seed diverged (inf)."""
    if math.isnan(r.mean_diff):
        return "n/a"
    if math.isinf(r.mean_diff):
        return f"{r.mean_diff:+g}"
    ci = "n/a" if math.isnan(r.ci_low) else f"{text.num(r.ci_low, 2)}, {text.num(r.ci_high, 2)}"
    return f"{text.num(r.mean_diff, 3)} [{ci}]"


def comparison_table(comparison: pd.DataFrame) -> pd.DataFrame:
    """`stats.compare` as text, one row per (function, method): baseline, n pairs, diverged seeds (method/baseline),
    mean diff [95% CI] (method - baseline; negative = lower MSE), Wilcoxon p, t p (both raw), Holm p (the primary p
    adjusted over the table's family) and result (decided on Holm p)."""
    c = comparison.sort_values(["function", "method"], key=_method_key)
    return pd.DataFrame(
        {
            "function": c["function"],
            "method": c["method"],
            "baseline": c["baseline"],
            "n": c["n"],
            "diverged": [f"{a}/{b}" for a, b in zip(c["n_div"], c["n_div_base"])],
            "mean diff [95% CI]": [_diff_text(r) for r in c.itertuples()],
            "Wilcoxon p": c["wilcoxon_p"].map(text.p_value),
            "t p": c["t_p"].map(text.p_value),
            "Holm p": c["p_holm"].map(text.p_value),
            "result": c["outcome"],
        }
    )


def wtl_table(wtl: pd.DataFrame) -> pd.DataFrame:
    """`stats.win_tie_loss` as text: method, functions, wins/ties/losses, sign-test p."""
    w = wtl.sort_values("method", key=_method_key)
    return pd.DataFrame(
        {
            "method": w["method"],
            "functions": w["functions"],
            "W/T/L": [f"{a}/{b}/{c}" for a, b, c in zip(w["wins"], w["ties"], w["losses"])],
            "sign test p": w["sign_p"].map(text.p_value),
        }
    )


def _ratio_text(r) -> str:
    """Geometric-mean ratio [95% bootstrap CI]; n/a where undefined (+inf and -inf among the pairs)."""
    if math.isnan(r.gm_ratio):
        return "n/a"
    ci = "n/a" if math.isnan(r.ci_low) else f"{text.num(r.ci_low, 3)}, {text.num(r.ci_high, 3)}"
    return f"{text.num(r.gm_ratio, 3)} [{ci}]"


def across_table(across: pd.DataFrame) -> pd.DataFrame:
    """`stats.across_functions` as text, one row per trained method: functions, (function, seed) pairs, diverged
    seeds (method/baseline), geometric-mean MSE ratio to the baseline [95% bootstrap CI], p (raw), Holm p, result."""
    a = across.sort_values("method", key=_method_key)
    return pd.DataFrame(
        {
            "method": a["method"],
            "functions": a["functions"],
            "pairs": a["n"],
            "diverged": [f"{x}/{y}" for x, y in zip(a["n_div"], a["n_div_base"])],
            "MSE ratio to LoRA [95% CI]": [_ratio_text(r) for r in a.itertuples()],
            "p": a["p"].map(text.p_value),
            "Holm p": a["p_holm"].map(text.p_value),
            "result": a["outcome"],
        }
    )


ACROSS_LEGEND = (
    "Across functions: each trained method against LoRA over every (function, seed) pair, on the log of the MSE "
    "ratio. ratio = geometric mean of MSE_method / MSE_LoRA (below 1 = lower MSE), its 95% CI from a bootstrap that "
    "resamples functions, then seeds within each; a diverged seed makes the ratio inf. p: paired t-test on the log "
    "ratios (Wilcoxon signed-rank when a seed diverged); Holm p: over this table's methods (frozen and mean are "
    "reference rows, not hypotheses). result: win/loss when Holm p < 0.05 and the CI excludes 1, else tie."
)


MIN_FUNCTIONS = 2  # an across-functions test needs functions to resample: with one, it is that function's table


def across_markdown(frame: pd.DataFrame, metric: str) -> str:
    """The across-functions test of one (arch, budget) slice against LoRA as Markdown with its legend; "" when LoRA
    or any other trained method is missing, or the slice has fewer than MIN_FUNCTIONS functions (the per-function
    tables then say all there is)."""
    across = stats.across_functions(frame, metric)
    if across.empty or across["functions"].max() < MIN_FUNCTIONS:
        return ""
    title = f"Across functions vs LoRA ({stats.metric(metric).label})"
    return f"#### {title}\n\n{text.markdown(across_table(across))}\n\n{ACROSS_LEGEND}"


COLLAPSE_TOLERANCE = 0.01  # a trained row "scores what mean scores" within 1 % of mean's MSE on every seed


def missing_note(frame: pd.DataFrame) -> str:
    """One line when the slice's grid of functions x methods has holes, or cells with fewer seeds than the same
    method's other cells (a sweep still running, or stopped): how many and which; "" when every cell is there with
    all its method's seeds. A method run at fewer seeds throughout (a protocol's choice) is not a gap."""
    seeds = frame.groupby(["function", "method"])["seed"].nunique()
    most = seeds.groupby(level="method").max()
    functions, methods = frame["function"].unique(), frame["method"].unique()
    holes = [f"{m} on {f}" for f in functions for m in methods if (f, m) not in seeds.index]
    short = [f"{m} on {f} ({n} of {most[m]})" for (f, m), n in seeds.items() if n < most[m]]
    parts = []
    if holes:
        more = f" and {len(holes) - 6} more" if len(holes) > 6 else ""
        parts.append(f"{len(holes)} of {len(functions) * len(methods)} (function, method) cells have no record: "
                     f"{', '.join(holes[:6])}{more}")  # fmt: skip
    if short:
        more = f" and {len(short) - 6} more" if len(short) > 6 else ""
        parts.append(f"{len(short)} cell(s) have fewer seeds than their method's others: {', '.join(short[:6])}{more}")
    return f"Incomplete: {'; '.join(parts)}. Their rows compare less than the others' do." if parts else ""


def collapse_note(frame: pd.DataFrame, metric: str = "test-at-best-train") -> str:
    """One line per (arch, budget, backbone init) slice that has trained rows scoring what the `mean` row scores on
    every seed of a function (within COLLAPSE_TOLERANCE): such a row predicts a constant there, and says nothing about
    its method. The line names them (per function when the slice has several). On the default deep-narrow init the
    cause is known (its pretrained backbone is constant over the inputs, docs/why.md), and the line names the option
    for a live backbone. "" when no row collapsed or there is no `mean` row."""
    p = stats.pairs(frame, stats.metric_column(metric), "mean")
    p = p[~p["method"].isin(stats.REFERENCE)]
    if p.empty:
        return ""
    init = frame["backbone_init"] if "backbone_init" in frame else pd.Series("default", index=frame.index)
    p = p.merge(frame.assign(backbone_init=init)[[*stats.CELL, "backbone_init"]].drop_duplicates(), on=stats.CELL)
    p["at_mean"] = (p["a"] - p["b"]).abs() <= COLLAPSE_TOLERANCE * p["b"]
    slices = p.groupby(["arch", "budget", "backbone_init"], sort=True)
    lines = []
    for (arch, budget, init), g in slices:
        at_mean = g.groupby(["function", "method"])["at_mean"].all()  # every seed of the cell
        collapsed = {f: stats.method_order(m[m].index.get_level_values("method")) for f, m in at_mean.groupby(level=0)}
        collapsed = {f: m for f, m in collapsed.items() if m}
        if not collapsed:
            continue
        line = "" if len(slices) == 1 else f"{arch}, {init} init, budget {budget}: "
        within = f"on every seed (within {COLLAPSE_TOLERANCE:.0%}), so they predict a constant"
        if g["function"].nunique() == 1:
            (names,) = collapsed.values()
            trained = g["method"].nunique()
            line += f"{len(names)} of {trained} trained rows ({', '.join(names)}) score what `mean` scores {within}."
        else:
            line += (
                f"Trained rows that score what `mean` scores {within}: "
                + "; ".join(f"{f} ({', '.join(m)})" for f, m in collapsed.items())
                + "."
            )
        if str(arch).startswith("deep-narrow") and init == "default":
            line += (
                " The default deep-narrow backbone is constant over its inputs after pretraining (docs/why.md); "
                "`--backbone-init kaiming` pretrains a live one."
            )
        lines.append(line)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# Gradient concentration (data from qlbench.diagnostics).


def concentration_legend(comparison: pd.DataFrame) -> str:
    """The legend of a concentration table (`diagnostics.compare_concentration` of one (arch, budget,
    backbone_init)), with the size of its Holm family: the comparisons with LoRA that have a p. ValueError when
    `comparison` mixes several such tables."""
    slices = comparison[["arch", "budget", "backbone_init"]].drop_duplicates()
    if len(slices) > 1:
        raise ValueError(f"a concentration table holds one (arch, budget, init), got {len(slices)}: split it first")
    family = int(comparison["p"].notna().sum())  # every function x method compared with LoRA in this table
    return (
        "Gradient concentration index = max / mean of the per-layer adapter gradient norms (1 = every layer gets the "
        "same norm, L = one layer gets everything; lower is better, the paper's reading), from the last training "
        "step of each evaluated epoch, averaged over those epochs per seed; mean ± sample std over seeds. diff = "
        "method - LoRA paired by seed with its 95% t-interval. t p and Wilcoxon p are raw; Holm p is the primary p "
        f"(paired t, else Wilcoxon) Holm-adjusted over the table's {family} comparisons with LoRA, since the table "
        "makes that many claims at once. result: win = significantly lower (less concentrated), loss = higher, when "
        "Holm p < 0.05 with at least 3 pairs, else tie."
    )


def concentration_table(comparison: pd.DataFrame) -> pd.DataFrame:
    """`diagnostics.compare_concentration` as text: function, method, n, concentration mean ± std, paired diff vs
    the baseline [95% CI], t p and Wilcoxon p (raw), Holm p (the primary p adjusted over the table's family) and
    result (decided on Holm p)."""
    c = comparison.sort_values(["function", "method"], key=_method_key)
    diff = [
        "baseline"
        if pd.isna(r.mean_diff) and r.method == adapters.BASELINE
        else ("n/a" if pd.isna(r.mean_diff) else _diff_text(r))
        for r in c.itertuples()
    ]
    return pd.DataFrame(
        {
            "function": c["function"],
            "method": c["method"],
            "n": c["n"],
            "concentration": [text.mean_std(m, sd, n) for m, sd, n in zip(c["mean"], c["std"], c["n"])],
            "diff vs LoRA [95% CI]": diff,
            "t p": c["t_p"].map(text.p_value),
            "Wilcoxon p": c["wilcoxon_p"].map(text.p_value),
            "Holm p": c["p_holm"].map(text.p_value),
            "result": c["outcome"].fillna("-"),
        }
    )


# --------------------------------------------------------------------------------------------------------------
# What every method costs (records' train_info.cost, qlbench/cost.py): one row per method of an (arch, budget).

COST_LEGEND = (
    "Measured on one member beside its frozen backbone (qlbench/cost.py), per method the median over the slice's "
    "records: trainable parameters and their ratio to LoRA; adapter file size (torch.save of one member's trainable "
    "weights); peak memory of one training step at the budget's batch (CUDA: the allocator's peak; CPU: parameters, "
    "gradients, optimiser state and the activations saved for backward, a lower bound of the process's peak); "
    "inference latency per sample, median of repeated no-grad forwards at batch 1 and 256, with its ratio to the "
    "frozen backbone timed in the same loop; adaptation wall time per member (a record's wall time over the members "
    "trained in its stack, so it shares the stack's speed-up). - = not measured (records written before costs were "
    "recorded)."
)


def _median(g: pd.DataFrame, col: str) -> float:
    v = g[col].dropna() if col in g else pd.Series(dtype=float)
    return float(v.median()) if len(v) else math.nan


def _size_cells(g: pd.DataFrame) -> dict:
    """The adapter file and the peak memory of a training step, medians over `g`'s records, as text."""
    return {
        "adapter KB": _fmt(_median(g, "adapter_bytes") / 1024, 1),
        "peak step MB": _fmt(_median(g, "peak_train_bytes") / 2**20, 2),
    }


def cost_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per method of one (arch, budget) slice of `results.load` (COST_LEGEND says what each column is)."""
    cells = frame.drop_duplicates("record")
    lora = _median(cells[cells["method"] == "lora"], "trainable_params")
    rows = []
    for method in stats.method_order(cells["method"]):
        g = cells[cells["method"] == method]
        params = _median(g, "trainable_params")
        wall = (g["wall_time_s"] / g["stacked_members"]).median() if "stacked_members" in g else math.nan
        row = {
            "method": method,
            "trainable": "-" if math.isnan(params) else f"{int(params):,}",
            "× LoRA": f"{params / lora:.3f}" if params and lora and not math.isnan(params / lora) else "-",
            **_size_cells(g),
        }
        for b in (1, 256):
            t, f = _median(g, f"latency_b{b}_s"), _median(g, f"frozen_latency_b{b}_s")
            row[f"µs/sample b{b}"] = _fmt(t * 1e6, 2)
            row[f"b{b} × frozen"] = _ratio(t, f)
        row["adapt s/member"] = _fmt(wall, 2)
        rows.append(row)
    return pd.DataFrame(rows)


def _ratio(t: float, f: float) -> str:
    return f"{t / f:.2f}" if f > 0 and math.isfinite(t / f) else "-"


def _fmt(v: float, sig: int) -> str:
    return "-" if math.isnan(v) else text.num(v, max(sig, 3))
