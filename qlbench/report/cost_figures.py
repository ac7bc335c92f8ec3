"""Quality against cost: the cost panels of one (arch, budget) slice and the paper's two Pareto panels, built on
`matplotlib.figure.Figure` (no pyplot state) with the styling helpers of qlbench.report.figures.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from qlbench.metrics import stats
from qlbench.report.figures import _facets, _palette

COST_AXES = {  # x axis of the quality-vs-cost figure: (column(s), label)
    "params": ("trainable_params", "trainable parameters per member (log)"),
    "latency": ("latency_b256_s", "inference latency per sample at batch 256 / frozen backbone's"),
}


def cost_figure(frame: pd.DataFrame, metric: str = "test-at-best-train", x: str = "params") -> Figure | None:
    """Quality against cost for one (arch, budget) slice of `results.load`: one panel per function, every trained
    method one point, y = the metric's mean over the finished seeds with a ± sample std bar (log scale), x = its
    trainable parameters or its latency ratio to the frozen backbone at batch 256 (COST_AXES; the record's cost,
    median over its records). `frozen` and `mean` are dashed horizontal references. A method whose seeds diverged
    is drawn hollow at its survivors' mean and named in the title. None when no method has the x value."""
    column, xlabel = COST_AXES[x]
    col = stats.metric(metric).column
    if column not in frame or (x == "latency" and "frozen_latency_b256_s" not in frame):
        return None
    cells = frame.copy()
    if x == "latency":
        cells["x"] = cells["latency_b256_s"] / cells["frozen_latency_b256_s"]
    else:
        cells["x"] = cells[column].astype(float)
    palette = _palette(cells["method"])
    references = [m for m in ("frozen", "mean") if m in set(cells["method"])]
    points = cells[~cells["method"].isin(references) & np.isfinite(cells["x"])]
    if not len(points):
        return None
    functions = sorted(cells["function"].unique())
    fig, axes = _facets(len(functions), extra=1.6)
    for ax, function in zip(axes, functions):
        c = cells[cells["function"] == function]
        diverged = []
        for method, g in points[points["function"] == function].groupby("method", sort=False):
            ok = g.loc[g["status"] == "ok", col].astype(float)
            ok = ok[np.isfinite(ok)]
            if not len(ok):
                continue
            hollow = (g["status"] == "diverged").any()
            diverged += [method] if hollow else []
            ax.errorbar(
                g["x"].median(),
                ok.mean(),
                yerr=ok.std(ddof=1) if len(ok) > 1 else 0.0,
                fmt="o",
                color=palette[method],
                mfc="none" if hollow else palette[method],
                capsize=3,
                markersize=6,
            )
        for ref in references:
            v = c.loc[c["method"] == ref, col].astype(float)
            if len(v[np.isfinite(v)]):
                ax.axhline(v[np.isfinite(v)].mean(), color=palette[ref], linestyle="--", linewidth=1)
        ax.set_yscale("log")
        if x == "params":
            ax.set_xscale("log")
        ax.set_title(function + (f" (diverged: {', '.join(diverged)})" if diverged else ""), fontsize=10)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(stats.metric(metric).label, fontsize=8)
    handles = [
        Line2D(
            [],
            [],
            color=c,
            marker="o" if m not in references else None,
            linestyle="--" if m in references else "",
            label=m,
        )
        for m, c in palette.items()
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 6), fontsize=9)
    arch, budget = frame["arch"].iloc[0], frame["budget"].iloc[0]
    fig.suptitle(
        f"{stats.metric(metric).label} against cost, {arch}, budget {budget}\n"
        "mean ± std over finished seeds; hollow: some seed diverged; dashed: frozen and mean"
    )
    return fig


K_MARKERS = {1: "o", 2: "s", 4: "^", 8: "D"}  # the Pareto figure's marker per k (others: "P"; no k: "X")


def pareto_figure(frame: pd.DataFrame, title: str, ylabel: str) -> Figure:
    """The paper's two Pareto panels from `pareto.load` (+ frontier columns `front_latency`, `front_params`):
    y = the metric's mean ± std over seeds (log), x = latency per sample at batch 256 (left) and trainable
    parameters (right, log); colour = method, marker = k, size grows with the parameters; the non-dominated
    frontier of each panel dashed. A point with a diverged seed is hollow (never on the frontier)."""
    palette = _palette(frame["method"])
    fig = Figure(figsize=(12, 5.2), layout="constrained")
    axes = fig.subplots(1, 2)
    size = lambda p: (
        20
        + 80
        * (np.log(p) - np.log(frame["trainable_params"].min()) + 0.01)
        / (np.log(frame["trainable_params"].max()) - np.log(frame["trainable_params"].min()) + 0.01)
    )
    panels = (("latency_us", "front_latency", "latency per sample at batch 256 (µs)"),
              ("trainable_params", "front_params", "trainable parameters per member"))  # fmt: skip
    for ax, (x, front, xlabel) in zip(axes, panels):
        for _, r in frame.iterrows():
            if not np.isfinite(r[x]) or not np.isfinite(r["mean"]):
                continue
            k = r.get("k")
            marker = "X" if k is None or not np.isfinite(k) else K_MARKERS.get(int(k), "P")
            colour = palette[r["method"]]
            ax.errorbar(r[x], r["mean"], yerr=0 if not np.isfinite(r["std"]) else r["std"], fmt="none",
                        ecolor=colour, alpha=0.5, capsize=2)  # fmt: skip
            ax.scatter(r[x], r["mean"], s=size(r["trainable_params"]), marker=marker,
                       facecolors="none" if r["n_diverged"] else colour, edgecolors=colour, zorder=3)  # fmt: skip
        f = frame[frame[front]].sort_values(x)
        if len(f):
            ax.step(f[x], f["mean"], where="post", color="0.2", linestyle="--", linewidth=1, label="frontier")
        ax.set_yscale("log")
        if x == "trainable_params":
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
    handles = [Line2D([], [], color=c, marker="o", linestyle="", label=m) for m, c in palette.items()]
    handles += [Line2D([], [], color="0.3", marker=mk, linestyle="", label=f"k={k}") for k, mk in K_MARKERS.items()
                if k in set(frame.get("k", pd.Series(dtype=float)).dropna().astype(int))]  # fmt: skip
    handles += [Line2D([], [], color="0.2", linestyle="--", label="non-dominated frontier")]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 8), fontsize=9)
    fig.suptitle(f"{title}\nmean ± std over seeds; marker = k, size = trainable parameters; hollow: a seed diverged")
    return fig
