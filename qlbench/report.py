"""Tables and figures for qlbench. Figures are built on `matplotlib.figure.Figure` (no pyplot state), so they
render under any backend, Agg included."""

from __future__ import annotations

import math

import pandas as pd
import torch
from matplotlib.figure import Figure

from qlbench import zoo

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
# Result tables: mean ± std over seeds, one row per method.

METRICS = {
    "best_train_mse": "best train MSE",
    "best_test_mse": "best test MSE (test-selected)",
    "test_at_best_train": "test MSE @ best-train epoch",
}


def _num(v: float, sig: int) -> str:
    """`sig` significant digits, positional between 1e-3 and 1e5, scientific outside."""
    if v == 0 or not math.isfinite(v):
        return f"{v:g}"
    e = math.floor(math.log10(abs(v)))
    return f"{v:.{max(sig - 1 - e, 0)}f}" if -3 <= e < 5 else f"{v:.{sig - 1}e}"


def _mean_std(values: pd.Series) -> str:
    v = values.dropna()
    if v.empty:
        return "n/a"
    if len(v) == 1:
        return _num(v.iloc[0], 3)
    return f"{_num(v.mean(), 3)} ± {_num(v.std(ddof=1), 2)}"


def method_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (function, arch, budget, method): seeds, trainable parameters and their ratio to LoRA, and each
    metric as mean ± std (sample std) over the seeds that did not diverge, plus the diverged count.

    Budgets are never mixed: each budget gets its own rows (and a budget column when more than one is present).
    """
    keys = ["function", "arch", "budget"]
    rows = []
    for (function, arch, budget), cell in frame.groupby(keys, sort=False):
        lora = cell.loc[cell["method"] == "lora", "trainable_params"]
        for method, g in cell.groupby("method", sort=False):
            ok = g[g["status"] == "ok"]
            params = g["trainable_params"].iloc[0]
            row = {"function": function, "arch": arch, "budget": budget, "method": method,
                   "trainable": "-" if pd.isna(params) else f"{int(params):,}",
                   "× LoRA": f"{params / lora.iloc[0]:.3f}" if len(lora) and not pd.isna(params) and params else "-"}
            row |= {label: _mean_std(ok[col]) for col, label in METRICS.items()}
            failed = (g["cell_status"] == "failed").any()
            row["diverged"] = "failed" if failed else f"{int((g['status'] == 'diverged').sum())}/{len(g)}"
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
