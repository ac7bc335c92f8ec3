"""Figures for qlbench, built on `matplotlib.figure.Figure` (no pyplot state), so they render under any backend,
Agg included; seaborn draws the lines, bands and heatmaps.

Results: learning curves and the log-ratio heatmap vs LoRA of one (arch, budget). Diagnostics (data from
`qlbench.diagnostics` and `qlbench.records.results`): per-layer gradient norms and the gradient concentration index,
route maps, atom weights and usage, signal propagation. And the function zoo, source vs target. Quality against cost
(the cost panels and the Pareto figure) is in qlbench.report.cost_figures, on the styling helpers here.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import seaborn as sns
import torch
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from qlbench import zoo
from qlbench.metrics import stats
from qlbench.records.results import SHARED_LAYER, gradients_summary

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
# Results: learning curves and the log-ratio heatmap of one (arch, budget).


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
        f"{stats.metric(metric).label} vs LoRA, {arch}, budget {budget}, paired by seed\n"
        "+inf / -inf: only the method / only LoRA diverged on some seed; undef.: both, on different seeds; "
        "* a seed diverged; blank = not run",
        fontsize=10,
    )
    ax.set_xlabel("")
    ax.set_ylabel("")
    return fig


# --------------------------------------------------------------------------------------------------------------
# Diagnostics: gradient norms and concentration, routing, signal propagation (data from qlbench.diagnostics).


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
