"""Tables and figures for qlbench. Figures are built on `matplotlib.figure.Figure` (no pyplot state), so they
render under any backend, Agg included.

Every number says how many seeds it stands on, and a diverged seed counts as MSE = inf in every "best" mark and
test (see `qlbench.stats` for the conventions). Entry point: `write_report(frame, curves, out_dir)`.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
import torch
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from qlbench import stats, store, zoo

# --------------------------------------------------------------------------------------------------------------
# Function zoo: source vs target surfaces.


def function_zoo_figure(grid: int = 301) -> Figure:
    """Filled contours of every zoo function: source and target side by side, three functions per row.

    Each source/target pair shares one colour scale, so a change of level is visible; white crosses mark the
    source's known minima. `grid` is the number of points per axis.
    """
    names = zoo.names()
    rows = -(-len(names) // 3)  # ceil
    fig = Figure(figsize=(18, 3.1 * rows + 0.5), layout="constrained")
    axes = fig.subplots(rows, 6, squeeze=False)
    for ax in axes.flat[2 * len(names) :]:
        ax.set_axis_off()
    for k, name in enumerate(names):
        task = zoo.task(name)
        lo, hi = task.bounds  # (2,), (2,)
        t = torch.linspace(0, 1, grid, dtype=torch.float64)
        x = lo + (hi - lo) * torch.stack(torch.meshgrid(t, t, indexing="xy"), dim=-1)  # (grid, grid, 2)
        surfaces = {"source": task.source(x), "target": task.target(x)}  # (grid, grid) each
        vmin = min(float(y.min()) for y in surfaces.values())
        vmax = max(float(y.max()) for y in surfaces.values())
        levels = torch.linspace(vmin, vmax, 25).tolist()
        pair = axes.flat[2 * k : 2 * k + 2]
        for ax, (which, y) in zip(pair, surfaces.items()):
            cs = ax.contourf(x[..., 0], x[..., 1], y, levels=levels, cmap="viridis")
            ax.set_title(f"{task.card.display_name}: {which}", fontsize=12)
            ax.set_aspect("equal")
            ax.tick_params(labelsize=8)
        opt = torch.tensor(task.source.optimum_locations)  # (n_opt, 2)
        pair[0].scatter(opt[:, 0], opt[:, 1], marker="x", s=60, c="white", linewidths=2, clip_on=False)
        fig.colorbar(cs, ax=list(pair), shrink=0.8, aspect=25)
    fig.suptitle(
        "Function zoo: source (card defaults) vs target (shifted coefficients, input plane rotated 15° about the"
        " box centre)",
        fontsize=14,
    )
    return fig


# --------------------------------------------------------------------------------------------------------------
# Numbers and cell text. A cell says how many seeds it stands on; a diverged seed makes the cell inf (see stats).

METRICS = {
    "best_train_mse": "best train MSE",
    "best_test_mse": "best test MSE (test-selected)",
    "test_at_best_train": "test MSE @ best-train epoch",
}
FORMATS = ("md", "latex", "csv")
_PM = {"md": " ± ", "latex": r" $\pm$ "}
_DAGGER = {"md": "†", "latex": r"\textsuperscript{$\dagger$}"}


def num(v: float, sig: int) -> str:
    """`sig` significant digits, positional between 1e-3 and 1e5, scientific outside."""
    if v == 0 or not math.isfinite(v):
        return f"{v:g}"
    e = math.floor(math.log10(abs(v)))
    return f"{v:.{max(sig - 1 - e, 0)}f}" if -3 <= e < 5 else f"{v:.{sig - 1}e}"


def _mean_std(mean: float, std: float, n: int, fmt: str = "md") -> str:
    """mean ± sample std; the mean alone for one seed; n/a for none."""
    if n == 0 or math.isnan(mean):
        return "n/a"
    return num(mean, 3) if n == 1 or math.isnan(std) else f"{num(mean, 3)}{_PM[fmt]}{num(std, 2)}"


def _p(p: float) -> str:
    return "n/a" if math.isnan(p) else f"{p:.1e}" if p < 1e-3 else f"{p:.3g}"


# --------------------------------------------------------------------------------------------------------------
# The run table: one row per method, what `qlbench run` prints.


def run_cell(r) -> str:
    """A `stats.summarize` row as run-table text: "failed", "mean ± std", or "inf (k ok: mean ± std)"."""
    if r.n_ok + r.n_diverged == 0:
        return "failed" if r.n_failed else "n/a"
    ok = _mean_std(r.mean_ok, r.std_ok, r.n_ok)
    if r.n_diverged:
        return f"inf ({int(r.n_ok)} ok: {ok})" if r.n_ok else "inf"
    return ok if r.n_ok == r.n else f"{ok} (n={int(r.n_ok)})"


def _cell_status(g: pd.DataFrame) -> str:
    if (g["status"] == "failed").any() or (g["cell_status"] == "failed").any():
        return "failed"
    return "diverged" if (g["status"] == "diverged").any() else "ok"


def method_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (function, arch, budget, method): status (ok | diverged: some seed diverged | failed), n seeds,
    diverged k/n, trainable parameters and their ratio to LoRA, and each metric.

    A metric reads mean ± sample std over the n seeds when none diverged. With k diverged seeds it reads
    "inf (n-k ok: mean ± std)": inf is the cell's value in every ranking and test (a diverged seed counts as
    MSE = inf), and the survivors' mean is shown with the count it stands on, never alone. A failed cell is a row
    with status failed. Budgets are never mixed: key columns that vary are kept.
    """
    keys = ["function", "arch", "budget"]
    summaries = {col: stats.summarize(frame, col).set_index(stats.CELL + ["method"]) for col in METRICS}
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
            row |= {label: run_cell(summaries[col].loc[key]) for col, label in METRICS.items()}
            rows.append(row)
    table = pd.DataFrame(rows)
    drop = [k for k in keys if table[k].nunique() <= 1] if len(table) else []
    return table.drop(columns=drop)


def markdown(table: pd.DataFrame) -> str:
    """A pipe table (no extra dependency)."""
    cols = list(table.columns)
    cells = [[str(v) for v in row] for row in table.itertuples(index=False)]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"
    return "\n".join([line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in cells])


# --------------------------------------------------------------------------------------------------------------
# Paper-layout tables: one row per function, one column per method, one table per (arch, budget) and metric.


def table_data(frame: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Long form of the paper tables, one row per (arch, budget, function, method): metric, the `stats.summarize`
    columns, best_overall / best_adapter (lowest inf-aware mean among non-reference methods / adapters), p_vs_lora,
    vs_lora (win | tie | loss) and sig_vs_lora (the table's † mark). This is what the CSV holds."""
    data = stats.summarize(frame, stats.metric_column(metric))
    data["best_overall"] = stats.best_mask(data, lambda m: m not in stats.REFERENCE)
    data["best_adapter"] = stats.best_mask(data, stats.is_adapter)
    vs = stats.compare(frame, metric, "lora")[stats.CELL + ["method", "p", "outcome"]]
    data = data.merge(
        vs.rename(columns={"p": "p_vs_lora", "outcome": "vs_lora"}), on=stats.CELL + ["method"], how="left"
    )
    data["sig_vs_lora"] = data["vs_lora"].isin(["win", "loss"]) & ~data["method"].isin(stats.REFERENCE)
    return data.assign(metric=metric)[["metric", *data.columns]]


def _one_slice(data: pd.DataFrame) -> tuple[str, str]:
    """The (arch, budget) of a paper table's data; ValueError when it mixes several (tables never mix them)."""
    slices = data[["arch", "budget"]].drop_duplicates()
    if len(slices) != 1:
        raise ValueError(f"a paper table holds one (arch, budget), got {len(slices)}: split the frame first")
    return tuple(slices.iloc[0])


def _seeds(data: pd.DataFrame) -> int:
    """The seed count most cells stand on (others are marked n=k)."""
    return int(data["n"].mode().iloc[0])


def _cell_text(r, n_common: int, fmt: str) -> str:
    """One paper-table cell: mean ± std, "inf (k/n div.)", "failed"; (n=k) when not n_common seeds; † when the
    method differs significantly from LoRA."""
    if r.n_diverged:
        text = f"inf ({r.n_diverged}/{r.n} div.)"
    elif r.n_ok == 0:
        text = "failed" if r.n_failed else "n/a"
    else:
        text = _mean_std(r.mean_ok, r.std_ok, r.n_ok, fmt) + ("" if r.n_ok == n_common else f" (n={r.n_ok})")
    return text + (_DAGGER[fmt] if r.sig_vs_lora else "")


def _grid(data: pd.DataFrame, fmt: str) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(text, bold, italic), each function x method (methods in stats.method_order, "-" = not run)."""
    n_common = _seeds(data)
    data = data.assign(text=[_cell_text(r, n_common, fmt) for r in data.itertuples()])
    functions, methods = sorted(data["function"].unique()), stats.method_order(data["method"])

    def wide(col: str) -> pd.DataFrame:  # (functions, methods)
        return data.pivot(index="function", columns="method", values=col).reindex(index=functions, columns=methods)

    grid = wide("text").fillna("-")
    grid.columns.name, grid.index.name = "function", None
    return grid, wide("best_overall").eq(True), wide("best_adapter").eq(True)


def _legend(data: pd.DataFrame, fmt: str) -> str:
    """What the marks mean, the seed count, inf = diverged."""
    b, i, dag, pm, lt = (
        ("**bold**", "*italic*", "†", "±", "<")
        if fmt == "md"
        else (r"\textbf{bold}", r"\textit{italic}", r"\textsuperscript{$\dagger$}", r"$\pm$", "$<$")
    )
    return (
        f"{b} = lowest mean overall; {i} = lowest mean among adapters (full fine-tuning excluded); {dag} = "
        f"differs from LoRA, paired by seed, p {lt} 0.05 (paired t-test; Wilcoxon signed-rank when a seed "
        f"diverged; at least 3 pairs); inf (k/n div.) = k of n seeds diverged, counted as MSE = inf in every mark "
        f"and test; frozen and mean are reference columns, never marked; mean {pm} sample std over "
        f"n = {_seeds(data)} seeds unless marked (n=k); - = not run."
    )


def _title(data: pd.DataFrame) -> str:
    arch, budget = _one_slice(data)
    return f"{METRICS[stats.metric_column(data['metric'].iloc[0])]}, {arch}, budget {budget}"


def paper_markdown(data: pd.DataFrame) -> str:
    """The Markdown paper table of one (arch, budget) slice of `table_data`, its legend below."""
    _one_slice(data)
    text, bold, italic = _grid(data, "md")
    wrap = pd.DataFrame(
        np.select([bold & italic, bold, italic], ["***", "**", "*"], ""), index=text.index, columns=text.columns
    )
    body = (wrap + text + wrap).reset_index().rename(columns={"index": "function"})
    return f"{markdown(body)}\n\n{_legend(data, 'md')}"


def paper_latex(data: pd.DataFrame, label: str = "") -> str:
    """The LaTeX (booktabs) paper table of one (arch, budget) slice of `table_data`: a `table` float whose caption
    is the title and legend; names escaped, compiles with only \\usepackage{booktabs}."""
    text, bold, italic = _grid(data, "latex")
    css = np.where(bold, "textbf: --rwrap;", "") + np.where(italic, "textit: --rwrap;", "")
    css = pd.DataFrame(css, index=text.index, columns=text.columns)
    return _styler_latex(
        text.style.apply(lambda _: css, axis=None),
        caption=f"{_latex_escape(_title(data))}. {_legend(data, 'latex')}",
        label=label,
    )


_TEX = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "<": "$<$",
    ">": "$>$",
}


def _latex_escape(s: str) -> str:
    """Plain text -> LaTeX text (captions; Styler escapes the cells and labels)."""
    return "".join(_TEX.get(ch, ch) for ch in s)


def _styler_latex(sty, *, caption: str, label: str = "", index: bool = True) -> str:
    """booktabs table float from a Styler whose cell values are LaTeX already; row/column labels get escaped."""
    sty = sty.format_index(escape="latex", axis=1)
    sty = sty.format_index(escape="latex", axis=0) if index else sty.hide(axis="index")
    sty = sty.set_table_styles(
        [{"selector": "scriptsize", "props": ":;"}, {"selector": "setlength", "props": r":{\tabcolsep}{3pt};"}],
        overwrite=False,
    )
    ncols = sty.data.shape[1]
    return sty.to_latex(
        hrules=True,
        column_format="l" + "r" * ncols if index else "l" * ncols,
        caption=caption,
        label=label or None,
        position="htbp",
        position_float="centering",
        environment="table",
    )


# --------------------------------------------------------------------------------------------------------------
# Paired statistics tables (stats.compare / stats.win_tie_loss rendered as text).


def _diff_text(r) -> str:
    """mean paired difference [95% CI]; the CI is n/a when a seed diverged (inf)."""
    if math.isnan(r.mean_diff):
        return "n/a"
    if math.isinf(r.mean_diff):
        return f"{r.mean_diff:+g}"
    ci = "n/a" if math.isnan(r.ci_low) else f"{num(r.ci_low, 2)}, {num(r.ci_high, 2)}"
    return f"{num(r.mean_diff, 3)} [{ci}]"


def comparison_table(comparison: pd.DataFrame) -> pd.DataFrame:
    """`stats.compare` as text, one row per (function, method): baseline, n pairs, diverged seeds (method/baseline),
    mean diff [95% CI] (method - baseline; negative = lower MSE), Wilcoxon p, t p, result."""
    c = comparison.sort_values(["function", "method"], key=_method_key)
    return pd.DataFrame(
        {
            "function": c["function"],
            "method": c["method"],
            "baseline": c["baseline"],
            "n": c["n"],
            "diverged": [f"{a}/{b}" for a, b in zip(c["n_div"], c["n_div_base"])],
            "mean diff [95% CI]": [_diff_text(r) for r in c.itertuples()],
            "Wilcoxon p": c["wilcoxon_p"].map(_p),
            "t p": c["t_p"].map(_p),
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
            "sign test p": w["sign_p"].map(_p),
        }
    )


def _method_key(col: pd.Series) -> pd.Series:
    """Sort key: methods in stats.method_order, anything else as is."""
    if col.name != "method":
        return col
    order = {m: i for i, m in enumerate(stats.method_order(col))}
    return col.map(order)


STATS_LEGEND = (
    "Paired by seed within the function; diff = method - baseline (negative = lower MSE). t p and the "
    "CI are n/a when a seed diverged (inf); Wilcoxon ranks a diverged seed above every finite one. result:"
    " win/loss when p < 0.05 (t-test, else Wilcoxon) with at least 3 pairs, else tie. An exact two-sided "
    "Wilcoxon cannot go below 0.25 with 3 pairs and 0.0625 with 5. Sign test: wins vs losses across "
    "functions, ties dropped."
)


# --------------------------------------------------------------------------------------------------------------
# Figures (seaborn on matplotlib Figure objects).


def _palette(methods) -> dict:
    methods = stats.method_order(methods)
    return dict(zip(methods, sns.color_palette("tab10" if len(methods) <= 10 else "husl", len(methods))))


def curves_figure(curves: pd.DataFrame, split: str = "test") -> Figure:
    """Learning curves of one (arch, budget) slice of `results.load_curves`: one panel per function, x = epoch,
    y = {split} MSE on a log scale, mean ± sample std band over seeds per method (`_sd_band`: where mean - std <= 0,
    which a log axis cannot draw, the lower edge is the lowest seed's value instead). A method with a
    single evaluation (frozen, mean) is a dashed horizontal line. A diverged seed's curve stops at its divergence,
    so the band after it stands on fewer seeds: each panel title names the diverged seeds."""
    y = f"{split}_mse"
    functions, palette = sorted(curves["function"].unique()), _palette(curves["method"])
    cols = min(3, len(functions))
    rows = -(-len(functions) // cols)
    fig = Figure(figsize=(max(5.2 * cols, 9), 3.6 * rows + 1.2), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[len(functions) :]:
        ax.set_axis_off()
    for ax, function in zip(axes.flat, functions):
        c = curves[curves["function"] == function]
        _curve_panel(ax, c, y, palette)
        seeds = c.drop_duplicates(["method", "seed"])
        div = seeds[seeds["status"] == "diverged"].groupby("method", sort=False).size()
        n = seeds.groupby("method").size()
        note = ", ".join(f"{m} {k}/{n[m]}" for m, k in div.items())
        ax.set_title(function + (f" (diverged: {note})" if note else ""), fontsize=10)
    one_shot = set(curves.groupby("method")["epoch"].nunique().loc[lambda n: n <= 1].index)
    handles = [
        Line2D([], [], color=col, label=m, linestyle="--" if m in one_shot else "-") for m, col in palette.items()
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 5), fontsize=9)
    arch, budget = curves["arch"].iloc[0], curves["budget"].iloc[0]
    fig.suptitle(
        f"{split} MSE during adaptation, {arch}, budget {budget}\n"
        "mean ± std over seeds (lower edge: the lowest seed where mean - std <= 0)"
    )
    return fig


def _sd_band(values) -> tuple[float, float]:
    """mean ± sample std of one epoch's seeds; the lower edge clipped to the lowest seed when it is not positive."""
    v = np.asarray(values, dtype=float)
    mean, std = v.mean(), (v.std(ddof=1) if len(v) > 1 else 0.0)
    return (mean - std if mean - std > 0 else v.min()), mean + std


def _curve_panel(ax, c: pd.DataFrame, y: str, palette: dict) -> None:
    """One function's curves on `ax`: trained methods as seaborn lines with sd bands, one-shot ones as lines."""
    epochs = c.groupby("method")["epoch"].nunique()
    trained = c[c["method"].map(epochs) > 1]
    if len(trained):
        sns.lineplot(
            data=trained,
            x="epoch",
            y=y,
            hue="method",
            palette=palette,
            errorbar=_sd_band,
            ax=ax,
            legend=False,
            linewidth=1.2,
            err_kws={"alpha": 0.12},
        )
    for method, g in c[c["method"].map(epochs) <= 1].groupby("method"):
        ax.axhline(g[y].mean(), color=palette[method], linestyle="--", linewidth=1)
    ax.set_yscale("log")
    ax.set_ylabel(y.replace("_", " ").replace("mse", "MSE"))


def log_ratio_figure(frame: pd.DataFrame, metric: str = "test-at-best-train") -> Figure:
    """Function x method heatmap of one (arch, budget): mean over seeds of log10(MSE method / MSE LoRA), paired by
    seed (`stats.log_ratios`), diverging colormap centred at 0 (blue = lower MSE than LoRA). ±inf cells (a seed
    diverged on one side only) are hatched and labelled; * marks a finite cell where a seed diverged."""
    lr = stats.log_ratios(frame, metric)
    functions, methods = sorted(lr["function"].unique()), stats.method_order(lr["method"])
    wide = lambda col: lr.pivot(index="function", columns="method", values=col).reindex(
        index=functions, columns=methods
    )
    value = wide("log_ratio").astype(float)
    diverged = (wide("n_div").fillna(0) + wide("n_div_base").fillna(0)) > 0
    finite = np.isfinite(value)
    annot = value.map(lambda v: f"{v:+.2g}" if math.isfinite(v) else "") + np.where(diverged, "*", "")
    lim = float(np.abs(value[finite]).max().max()) if finite.values.any() else 1.0
    fig = Figure(figsize=(1.0 * len(methods) + 3, 0.55 * len(functions) + 2), layout="constrained")
    ax = fig.subplots()
    sns.heatmap(
        value.where(finite),
        mask=~finite,
        annot=annot,
        fmt="",
        cmap="RdBu_r",
        center=0,
        vmin=-(lim or 1),
        vmax=lim or 1,
        linewidths=0.5,
        linecolor="white",
        ax=ax,
        cbar_kws={"label": "mean log10(MSE / MSE LoRA)"},
    )
    for i, j in zip(*np.nonzero(~finite.values & wide("n").notna().values)):
        v = value.iat[i, j]
        ax.add_patch(Rectangle((j, i), 1, 1, fill=False, hatch="//", edgecolor="0.4", linewidth=0))
        ax.text(j + 0.5, i + 0.5, "undef." if math.isnan(v) else f"{v:+g}", ha="center", va="center", fontsize=9)
    arch, budget = frame["arch"].iloc[0], frame["budget"].iloc[0]
    ax.set_title(
        f"{METRICS[stats.metric_column(metric)]} vs LoRA, {arch}, budget {budget}, paired by seed\n"
        "+inf / -inf: only the method / only LoRA diverged on some seed; undef.: both, on different seeds; "
        "* a seed diverged; blank = not run",
        fontsize=10,
    )
    ax.set_xlabel("")
    ax.set_ylabel("")
    return fig


# --------------------------------------------------------------------------------------------------------------
# Diagnostics: gradient concentration, routing, signal propagation (data from qlbench.diagnostics).

CONCENTRATION_LEGEND = (
    "Gradient concentration index = max / mean of the per-layer adapter gradient norms (1 = every layer gets the "
    "same norm, L = one layer gets everything; lower is better, the paper's reading), from the last training step "
    "of each evaluated epoch, averaged over those epochs per seed; mean ± sample std over seeds. diff = method - "
    "LoRA paired by seed with its 95% t-interval; win = significantly lower (less concentrated), p < 0.05 (paired "
    "t, else Wilcoxon) with at least 3 pairs."
)


def concentration_table(comparison: pd.DataFrame) -> pd.DataFrame:
    """`diagnostics.compare_concentration` as text: function, method, n, concentration mean ± std, paired diff vs
    the baseline [95% CI], t p, Wilcoxon p, result."""
    c = comparison.sort_values(["function", "method"], key=_method_key)
    diff = [
        "baseline"
        if pd.isna(r.mean_diff) and r.method == "lora"
        else ("n/a" if pd.isna(r.mean_diff) else _diff_text(r))
        for r in c.itertuples()
    ]
    return pd.DataFrame(
        {
            "function": c["function"],
            "method": c["method"],
            "n": c["n"],
            "concentration": [_mean_std(m, sd, n) for m, sd, n in zip(c["mean"], c["std"], c["n"])],
            "diff vs LoRA [95% CI]": diff,
            "t p": c["t_p"].map(_p),
            "Wilcoxon p": c["wilcoxon_p"].map(_p),
            "result": c["outcome"].fillna("-"),
        }
    )


def _gradient_section(grads: pd.DataFrame, folder: Path, formats, figures: bool, files: list) -> str:
    """The concentration table (vs LoRA) and the gradient figures of one slice of `results.load_gradients`."""
    from qlbench import diagnostics

    per_seed = diagnostics.concentration_per_seed(grads)
    comparison = diagnostics.compare_concentration(per_seed)
    table = concentration_table(comparison)
    arch, budget = grads["arch"].iloc[0], grads["budget"].iloc[0]
    title = f"Gradient concentration index, {arch}, budget {budget}"
    _write_table(
        files,
        folder / "gradient-concentration",
        [f for f in formats if f != "latex"],
        md=f"### {title}\n\n{markdown(table)}\n\n{CONCENTRATION_LEGEND}",
        latex="",
        csv=comparison,
    )
    if figures:  # the paper's comparison (LoRA, queryable, instruct-queryable) where present; the table has all
        shown = [m for m in diagnostics.GRADIENT_METHODS if m in set(grads["method"])] or None
        _save_figure(files, gradient_profile_figure(grads, shown), folder / "gradient-profile", dpi=100)
        _save_figure(files, concentration_figure(grads, shown), folder / "gradient-concentration", dpi=100)
    return f"### {title}\n\n{markdown(table)}\n\n{CONCENTRATION_LEGEND}"


def _facets(n: int, width: float = 4.6, height: float = 3.4, extra: float = 1.2):
    cols = min(3, n)
    rows = -(-n // cols)
    fig = Figure(figsize=(max(width * cols, 10), height * rows + extra), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_axis_off()
    return fig, axes.flat


def gradient_profile_figure(grads: pd.DataFrame, methods=None, epoch: str | int = "mean") -> Figure:
    """Per-layer adapter gradient norm against the layer, one panel per function, one line per method (mean over
    seeds, band: min to max seed), log scale; the shared entry as a marker at the right. `grads` is
    `results.load_gradients` of one (arch, budget, init); epoch "mean" averages each seed's norms over the recorded
    epochs (geometric mean, as the axis is logarithmic), "last" takes the last recorded epoch, an int that epoch."""
    from qlbench.results import SHARED_LAYER

    g = grads[grads["method"].isin(methods)] if methods is not None else grads
    if epoch == "last":
        g = g[g["epoch"] == g.groupby(["function", "method", "seed"])["epoch"].transform("max")]
    elif epoch != "mean":
        g = g[g["epoch"] == epoch]
    keys = ["function", "method", "seed", "layer"]
    per_seed = g.assign(log=np.log10(g["norm"].where(g["norm"] > 0))).groupby(keys)["log"].mean().reset_index()
    per_seed["norm"] = 10 ** per_seed["log"]
    functions, palette = sorted(per_seed["function"].unique()), _palette(per_seed["method"])
    fig, axes = _facets(len(functions))
    for ax, function in zip(axes, functions):
        f = per_seed[per_seed["function"] == function]
        layers = f[f["layer"] != SHARED_LAYER]
        n_layers = int(layers["layer"].max()) + 1 if len(layers) else 0
        for method in stats.method_order(f["method"]):
            m = layers[layers["method"] == method].groupby("layer")
            if not len(m.size()):
                continue
            mean = 10 ** m["log"].mean()  # geometric mean over seeds, as the axis is logarithmic
            ax.plot(mean.index, mean, color=palette[method], label=method, linewidth=1.3)
            ax.fill_between(mean.index, m["norm"].min(), m["norm"].max(), color=palette[method], alpha=0.15, lw=0)
            shared = f[(f["method"] == method) & (f["layer"] == SHARED_LAYER)]["log"]
            if len(shared):
                ax.scatter([n_layers + 0.5], [10 ** shared.mean()], color=palette[method], marker="D", s=24)
        ax.set_yscale("log")
        ax.set_xlabel(f"adapted layer (diamond at {n_layers + 0.5:g}: shared parameters)")
        ax.set_ylabel("adapter gradient norm")
        ax.set_title(function, fontsize=10)
    handles = [Line2D([], [], color=c, label=m) for m, c in palette.items()]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 6), fontsize=9)
    arch, budget = grads["arch"].iloc[0], grads["budget"].iloc[0]
    when = {"mean": "geometric mean over the recorded epochs", "last": "last recorded epoch"}
    when = when.get(epoch, f"epoch {epoch}")
    fig.suptitle(
        f"Per-layer adapter gradient norms, {arch}, budget {budget}\n({when}; line: geometric mean over seeds, "
        "band: lowest to highest seed; a zero norm is left out)",
        fontsize=11,
    )
    return fig


def concentration_figure(grads: pd.DataFrame, methods=None) -> Figure:
    """The gradient concentration index (max / mean per-layer norm) against the epoch, one panel per function, one
    line per method with a mean ± std band over seeds. `grads` is `results.load_gradients` of one slice."""
    from qlbench.results import gradients_summary

    g = grads[grads["method"].isin(methods)] if methods is not None else grads
    summary = gradients_summary(g)
    functions, palette = sorted(summary["function"].unique()), _palette(summary["method"])
    fig, axes = _facets(len(functions))
    for ax, function in zip(axes, functions):
        sns.lineplot(
            data=summary[summary["function"] == function],
            x="epoch",
            y="concentration",
            hue="method",
            palette=palette,
            errorbar="sd",
            ax=ax,
            legend=False,
            linewidth=1.2,
            err_kws={"alpha": 0.15},
        )
        ax.axhline(1.0, color="0.5", linewidth=0.8, linestyle=":")
        ax.set_title(function, fontsize=10)
        ax.set_ylabel("max / mean layer gradient norm")
    handles = [Line2D([], [], color=c, label=m) for m, c in palette.items()]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 6), fontsize=9)
    arch, budget = grads["arch"].iloc[0], grads["budget"].iloc[0]
    fig.suptitle(
        f"Gradient concentration index over training, {arch}, budget {budget}\n(mean ± std over seeds; lower: "
        "more even across layers)",
        fontsize=11,
    )
    return fig


def route_map_figure(maps: dict, member: int = 0, title: str = "") -> Figure:
    """The target surface, the model's prediction and, per block, the input plane coloured by the dominant atom
    (argmax of alpha) of one member; `maps` is `diagnostics.route_maps`. One colour per atom, shared by the
    blocks."""
    from matplotlib.colors import BoundaryNorm, ListedColormap

    xy, dominant = maps["grid"], maps["dominant"][member]  # (n, n, 2), (B, n, n)
    B, M = dominant.shape[0], maps["alpha"].shape[-1]
    colours = ListedColormap(sns.color_palette("tab10" if M <= 10 else "husl", M))
    norm = BoundaryNorm(np.arange(M + 1) - 0.5, M)
    panels = 2 + B
    cols = min(panels, 3)
    rows = -(-panels // cols)
    fig = Figure(figsize=(4.2 * cols, 3.7 * rows + 0.6), layout="constrained")
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    for ax in axes[panels:]:
        ax.set_axis_off()
    X, Y = xy[..., 0].numpy(), xy[..., 1].numpy()
    lo = float(min(maps["target"].min(), maps["prediction"][member].min()))
    hi = float(max(maps["target"].max(), maps["prediction"][member].max()))
    for ax, (name, z) in zip(axes, (("target", maps["target"]), ("prediction", maps["prediction"][member]))):
        cs = ax.contourf(X, Y, z.numpy(), levels=np.linspace(lo, hi, 25), cmap="viridis")
        ax.set_title(name, fontsize=10)
        ax.set_aspect("equal")
    fig.colorbar(cs, ax=axes[:2], shrink=0.8)
    for b in range(B):
        ax = axes[2 + b]
        mesh = ax.pcolormesh(X, Y, dominant[b].numpy(), cmap=colours, norm=norm, shading="nearest")
        used = sorted(set(dominant[b].flatten().tolist()))
        ax.set_title(f"block {b}: dominant atom ({len(used)} of {M} atoms)", fontsize=10)
        ax.set_aspect("equal")
    fig.colorbar(mesh, ax=axes[2 : 2 + B], ticks=range(M), label="atom", shrink=0.8)
    fig.suptitle(title or "Route maps: dominant atom per block over the input plane")
    return fig


def atom_weight_figure(maps: dict, member: int = 0, title: str = "") -> Figure:
    """Each atom's routing weight alpha over the input plane, blocks as rows, atoms as columns, one member."""
    xy, alpha = maps["grid"], maps["alpha"][member]  # (n, n, 2), (B, n, n, M)
    B, M = alpha.shape[0], alpha.shape[-1]
    fig = Figure(figsize=(1.9 * M + 1.2, 1.9 * B + 1.0), layout="constrained")
    axes = fig.subplots(B, M, squeeze=False)
    X, Y = xy[..., 0].numpy(), xy[..., 1].numpy()
    for b in range(B):
        for m in range(M):
            ax = axes[b, m]
            mesh = ax.pcolormesh(X, Y, alpha[b, ..., m].numpy(), cmap="magma", vmin=0, vmax=1, shading="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_aspect("equal")
            if b == 0:
                ax.set_title(f"atom {m}", fontsize=9)
            if m == 0:
                ax.set_ylabel(f"block {b}", fontsize=9)
    fig.colorbar(mesh, ax=axes, shrink=0.6, label="alpha")
    fig.suptitle(title or "Routing weight of every atom over the input plane")
    return fig


def atom_usage_figure(usage: dict[str, torch.Tensor], title: str = "") -> Figure:
    """Heatmaps of atom usage (mean routing weight over the target test set), blocks x atoms, one panel per model;
    `usage` maps a panel label to a (B, M) tensor (e.g. one member of `diagnostics.route_stats(...)["usage"]`)."""
    fig = Figure(figsize=(4.4 * len(usage) + 1, 3.2), layout="constrained")
    axes = fig.subplots(1, len(usage), squeeze=False).flat
    for ax, (label, u) in zip(axes, usage.items()):
        sns.heatmap(
            pd.DataFrame(u.numpy()).rename_axis(index="block", columns="atom"),
            ax=ax,
            vmin=0,
            vmax=1,
            cmap="rocket_r",
            annot=True,
            fmt=".2f",
            annot_kws={"fontsize": 7},
            cbar=False,
        )
        ax.set_title(label, fontsize=10)
    fig.suptitle(title or "Atom usage per block (mean routing weight over the target test set)")
    return fig


def signal_figure(profile: pd.DataFrame) -> Figure:
    """Spread of the hidden features across inputs against the layer (log scale), one line per (init, stage), mean
    over seeds with a min-max band; `profile` is `diagnostics.signal_profile`."""
    fig = Figure(figsize=(8, 4.6), layout="constrained")
    ax = fig.subplots()
    inits = list(dict.fromkeys(profile["init"]))
    palette = dict(zip(inits, sns.color_palette("tab10", len(inits))))
    for (init, stage), g in profile.groupby(["init", "stage"], sort=False):
        by = g.groupby("layer")["spread"]
        style = "-" if stage == "init" else "--"
        ax.plot(by.mean().index, by.mean(), style, color=palette[init], label=f"{init}, {stage}")
        ax.fill_between(by.mean().index, by.min(), by.max(), color=palette[init], alpha=0.12, linewidth=0)
    ax.set_yscale("log")
    ax.set_xlabel("layer (0: after the input layer)")
    ax.set_ylabel("spread: mean over features of std across inputs")
    ax.legend(fontsize=9)
    first = profile.iloc[0]
    ax.set_title(f"Signal propagation, {first['arch']}, {first['function']}, budget {first['budget']}", fontsize=11)
    return fig


# --------------------------------------------------------------------------------------------------------------
# The report: every table, statistic and figure of a results frame, one set per (arch, budget).


def _validate(frame: pd.DataFrame, metric: str, formats) -> None:
    """One-line ValueErrors for what the CLI turns into exit 2."""
    if frame is None or len(frame) == 0:
        raise ValueError("no results to report: the results frame is empty")
    stats.metric_column(metric)
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise ValueError(f"unknown format {bad[0]!r}; valid: {', '.join(FORMATS)}")
    missing = [c for c in ["function", "arch", "method", "budget", "seed", "status", *METRICS] if c not in frame]
    if missing:
        raise ValueError(f"results frame lacks column(s) {', '.join(missing)}")


def _slug(s) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(s))


def _write_table(files: list, stem: Path, formats, *, md: str, latex, csv: pd.DataFrame) -> None:
    """Write one table as stem.md / .tex / .csv (those in `formats`); `latex` is a str or a callable making one."""
    out = {
        "md": lambda: md + "\n",
        "latex": lambda: latex() if callable(latex) else latex,
        "csv": lambda: csv.to_csv(index=False),
    }
    for fmt in formats:
        path = stem.with_suffix(".tex" if fmt == "latex" else f".{fmt}")
        store.write_text(out[fmt](), path)
        files.append(path)


def _save_figure(files: list, fig: Figure, stem: Path, dpi: int = 150) -> None:
    for ext in ("png", "pdf"):
        store.atomic_write(stem.with_suffix(f".{ext}"), lambda tmp, ext=ext: fig.savefig(tmp, format=ext, dpi=dpi))
        files.append(stem.with_suffix(f".{ext}"))


def _stats_section(frame: pd.DataFrame, metric: str, folder: Path, formats, files: list) -> list[str]:
    """Paired statistics of one slice on `metric`: per function vs LoRA and vs the best static adapter, and the
    cross-function win/tie/loss; returns the Markdown parts and writes the files."""
    parts = []
    for baseline, name in (("lora", "LoRA"), (stats.BEST_STATIC, "the best static adapter")):
        comp = stats.compare(frame, metric, baseline)
        if comp.empty:
            parts.append(f"No paired statistics against {name}: it is not in these results.")
            continue
        per_fn, wtl = comparison_table(comp), wtl_table(stats.win_tie_loss(comp))
        cap = f"paired by seed vs {name} ({METRICS[stats.metric_column(metric)]})"
        for stem, table, title in (
            (f"stats-vs-{baseline}-{metric}", per_fn, f"Per function: {cap}"),
            (f"wtl-vs-{baseline}-{metric}", wtl, f"Across functions: {cap}"),
        ):
            latex = lambda t=table, c=title: _styler_latex(
                t.style.format(escape="latex"), index=False, caption=_latex_escape(f"{c}. {STATS_LEGEND}")
            )
            _write_table(
                files,
                folder / stem,
                formats,
                md=f"{markdown(table)}\n\n{STATS_LEGEND}",
                latex=latex,
                csv=comp if stem.startswith("stats") else stats.win_tie_loss(comp),
            )
            parts.append(f"#### {title}\n\n{markdown(table)}")
        parts.append(STATS_LEGEND)
    return parts


def _slice_report(frame, curves, folder: Path, metric: str, formats, figures: bool, files: list) -> str:
    """Tables, statistics and figures of one (arch, budget) into `folder`; returns its Markdown."""
    arch, budget = frame["arch"].iloc[0], frame["budget"].iloc[0]
    folder.mkdir(parents=True, exist_ok=True)
    parts = [f"## {arch}, budget {budget}"]
    for m in dict.fromkeys(["best-train", metric]):  # the train table, then the chosen test table
        data = table_data(frame, m)
        md = paper_markdown(data)
        _write_table(
            files,
            folder / f"table-{m}",
            formats,
            md=f"### {_title(data)}\n\n{md}",
            csv=data,
            latex=lambda d=data, m=m: paper_latex(d, label=f"tab:{_slug(arch)}-{_slug(budget)}-{m}"),
        )
        parts.append(f"### {_title(data)}\n\n{md}")
    parts.append(f"### Paired statistics ({METRICS[stats.metric_column(metric)]})")
    parts += _stats_section(frame, metric, folder, formats, files)
    if figures:
        _slice_figures(frame, curves, folder, metric, files)
    return "\n\n".join(parts)


def _init_slice(f: pd.DataFrame | None, arch: str, budget: str, init: str, label: str) -> pd.DataFrame | None:
    """The rows of a curves or gradients frame for one (arch, budget, backbone init), arch relabelled."""
    if f is None or not len(f):
        return f
    inits = f["backbone_init"] if "backbone_init" in f else pd.Series("default", index=f.index)
    keep = (f["arch"] == arch) & (f["budget"] == budget) & (inits == init)
    return f[keep].assign(arch=label)


def _slice_figures(frame, curves, folder: Path, metric: str, files: list) -> None:
    arch, budget = frame["arch"].iloc[0], frame["budget"].iloc[0]
    if curves is not None and len(curves):
        c = curves[(curves["arch"] == arch) & (curves["budget"] == budget)]
        for split in ("train", "test") if len(c) else ():
            _save_figure(files, curves_figure(c, split), folder / f"curves-{split}")
    if "lora" in set(frame["method"]):
        _save_figure(files, log_ratio_figure(frame, metric), folder / f"log-ratio-{metric}")


def write_report(
    frame: pd.DataFrame,
    curves: pd.DataFrame | None,
    out_dir: Path,
    *,
    metric: str = "test-at-best-train",
    formats=FORMATS,
    figures: bool = True,
    gradients: pd.DataFrame | None = None,
) -> dict:
    """Write every table, paired statistic and figure of a results frame into out_dir, one set per (arch, budget)
    in out_dir/<arch>/<budget>/ (never mixed), plus out_dir/report.md when "md" is in `formats`. Records of a
    non-default backbone init (column backbone_init) are a slice of their own, in out_dir/<arch>-<init>/<budget>/,
    labelled "<arch>, <init> init" in its tables and figures.

    frame: `results.load`; curves: `results.load_curves` (or None: no curve figures); metric: the test metric
    (best-train | best-test | test-at-best-train), shown after the best-train table and used by the statistics;
    formats: any of md, latex, csv; gradients: `results.load_gradients` (or None): adds the gradient concentration
    table (vs LoRA, paired) and the gradient figures of each slice that has any.
    Returns {"markdown": the report text, "files": [paths written]}.
    ValueError (one line) for an empty frame, a bad metric or format.
    """
    _validate(frame, metric, formats)
    out_dir, files, sections = Path(out_dir), [], []
    if "backbone_init" not in frame:
        frame = frame.assign(backbone_init="default")
    for (arch, budget, init), group in frame.groupby(["arch", "budget", "backbone_init"], sort=True):
        label = arch if init == "default" else f"{arch}, {init} init"
        folder = out_dir / _slug(arch if init == "default" else f"{arch}-{init}") / _slug(budget)
        key = (arch, budget, init, label)
        group = group.drop(columns="backbone_init").assign(arch=label)
        sections.append(_slice_report(group, _init_slice(curves, *key), folder, metric, formats, figures, files))
        if gradients is not None and len(g := _init_slice(gradients, *key)):
            sections.append(_gradient_section(g, folder, formats, figures, files))
    text = "\n\n".join(sections) + "\n"
    if "md" in formats:
        out_dir.mkdir(parents=True, exist_ok=True)
        store.write_text(text, out_dir / "report.md")
        files.append(out_dir / "report.md")
    return {"markdown": text, "files": files}
