"""The suite section of a report: per (arch, suite, schedule, budget, init) the suite table, the stage x task MSE
heatmaps of every row, and for every routed row the figures of the paper's continual-routing section.

    <out>/suites/<arch>[-<init>]/<budget>/<suite>/<schedule>/table.md|csv
        stage-task-mse.png      every row's stage x task test MSE (mean over seeds)
        <row>-usage.png         atom usage per evaluation task after each stage (seed 0: atoms are per seed)
        <row>-drift.png         per evaluation task, its usage change at each stage (sequential; seed 0)
        <row>-atom-entropy.png  each atom's usage entropy across tasks after the last stage (seed 0)
        <row>-kl-drift.png      final symmetric KL between tasks and the stagewise route drift (mean over seeds)

Input is `suite_stats.load`; the metrics and their definitions are `qlbench.metrics.continual`'s.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from qlbench import text
from qlbench.backbones import DEFAULT_INIT
from qlbench.metrics import continual, stats, suite_stats
from qlbench.records import results
from qlbench.report.heldout import write_heldout_report
from qlbench.report.write import _save_figure, _save_table, _slug

TABLE_NOTE = (
    "Test MSE on standardised labels (1 = predicting each task's mean over the box), mean ± std over seeds; "
    "average: over the tasks trained on; vs-lora: the average's mean difference against LoRA, paired over seeds "
    "(raw p, and p Holm-adjusted over every row the table compares with LoRA; win = significantly lower on the "
    "Holm p). Column definitions: docs/methods.md#multi-task-suites."
)


def stage_labels(schedule: str, tasks, n_stages: int) -> list[str]:
    if schedule == "sequential":
        return [f"after {t}" for t in tasks[:n_stages]]
    return ["after joint" if schedule == "joint" else f"after {', '.join(tasks[:-1])}"]


def stage_task_figure(panels: dict[str, np.ndarray], tasks, schedule: str, title: str = "") -> Figure:
    """One heatmap per row: stage x evaluation task test MSE (a (S, T) array per panel label), one colour scale."""
    n = len(panels)
    cols = min(n, 4)
    rows = -(-n // cols)
    fig = Figure(figsize=(3.6 * cols + 0.6, 0.55 * max(len(next(iter(panels.values()))), 2) * rows + 1.6 * rows))
    fig.set_layout_engine("constrained")
    axes = fig.subplots(rows, cols, squeeze=False).flat
    finite = [v for R in panels.values() for v in np.ravel(R) if np.isfinite(v)]
    top = max(finite) if finite else 1.0  # one colour scale for every panel
    for ax, (label, R) in zip(axes, panels.items()):
        frame = pd.DataFrame(R, index=stage_labels(schedule, tasks, len(R)), columns=list(tasks))
        sns.heatmap(
            frame,
            ax=ax,
            cmap="rocket_r",
            vmin=0,
            vmax=top,
            annot=True,
            fmt=".2g",
            annot_kws={"fontsize": 7},
            cbar=False,
        )
        ax.set_title(label, fontsize=10)
        ax.tick_params(labelsize=7)
    for ax in list(axes)[n:]:
        ax.set_visible(False)
    fig.suptitle(title or "Test MSE of every task after each stage (mean over seeds)")
    return fig


def usage_figure(U: np.ndarray, tasks, schedule: str, title: str = "") -> Figure:
    """Atom usage after each stage: one panel per stage, evaluation tasks x atoms (U (S, T, M), one seed)."""
    S = len(U)
    fig = Figure(figsize=(3.4 * S + 1, 0.45 * len(tasks) + 1.6), layout="constrained")
    axes = fig.subplots(1, S, squeeze=False).flat
    for ax, label, u in zip(axes, stage_labels(schedule, tasks, S), U):
        frame = pd.DataFrame(u, index=list(tasks)).rename_axis(columns="atom")
        sns.heatmap(
            frame, ax=ax, vmin=0, vmax=1, cmap="rocket_r", annot=True, fmt=".2f", annot_kws={"fontsize": 6}, cbar=False
        )
        ax.set_title(label, fontsize=10)
        ax.tick_params(labelsize=7)
    fig.suptitle(title or "Atom usage by evaluation task (block-averaged routing weights)")
    return fig


def drift_figure(U: np.ndarray, tasks, title: str = "") -> Figure:
    """Per evaluation task, its usage change U[i] - U[i-1] at each stage i >= 1 (stages x atoms, one seed)."""
    D = continual.usage_drift(U)  # (S - 1, T, M)
    lim = max(float(np.abs(D).max()), 1e-12)
    fig = Figure(figsize=(3.2 * len(tasks) + 1, 0.45 * len(D) + 1.6), layout="constrained")
    axes = fig.subplots(1, len(tasks), squeeze=False).flat
    for j, (ax, task) in enumerate(zip(axes, tasks)):
        frame = pd.DataFrame(D[:, j], index=[f"after {t}" for t in tasks[1 : len(D) + 1]]).rename_axis(columns="atom")
        sns.heatmap(
            frame, ax=ax, vmin=-lim, vmax=lim, cmap="vlag", annot=True, fmt=".2f", annot_kws={"fontsize": 6}, cbar=False
        )
        ax.set_title(f"eval {task}", fontsize=10)
        ax.tick_params(labelsize=7)
    fig.suptitle(title or "Atom-usage drift of each evaluation task across stages")
    return fig


def atom_entropy_figure(usage: np.ndarray, title: str = "") -> Figure:
    """Bars: each atom's usage entropy across the tasks (0 = one task's, 1 = every task's alike), final usage
    (T, M) of one seed; an atom no task uses is drawn as a gap."""
    h = continual.atom_entropy(usage)
    fig = Figure(figsize=(0.45 * len(h) + 2, 3), layout="constrained")
    ax = fig.subplots()
    sns.barplot(x=np.arange(len(h)), y=np.nan_to_num(h, nan=0.0), ax=ax, color="#4c72b0")
    ax.set(xlabel="atom", ylabel="normalised entropy across tasks", ylim=(0, 1.05))
    ax.set_title(title or "Per-atom specialisation entropy after the last stage", fontsize=10)
    return fig


def kl_drift_figure(kl: np.ndarray, drift: np.ndarray | None, tasks, title: str = "") -> Figure:
    """Final symmetric KL between tasks' usage (T, T) and, for a sequential run, the stagewise route drift
    (S - 1, T) (both means over seeds of per-seed values)."""
    n = 1 if drift is None else 2
    fig = Figure(figsize=(4.2 * n + 0.8, 0.5 * len(tasks) + 2), layout="constrained")
    axes = fig.subplots(1, n, squeeze=False).flat
    sns.heatmap(
        pd.DataFrame(kl, index=list(tasks), columns=list(tasks)),
        ax=axes[0],
        cmap="mako_r",
        annot=True,
        fmt=".2g",
        annot_kws={"fontsize": 7},
        cbar=False,
    )
    axes[0].set_title("final symmetric KL (nats)", fontsize=10)
    if drift is not None:
        frame = pd.DataFrame(drift, index=[f"after {t}" for t in tasks[1 : len(drift) + 1]], columns=list(tasks))
        sns.heatmap(
            frame, ax=axes[1], cmap="mako_r", vmin=0, annot=True, fmt=".2f", annot_kws={"fontsize": 7}, cbar=False
        )
        axes[1].set_title("stagewise route drift (total variation)", fontsize=10)
    for ax in axes:
        ax.tick_params(labelsize=7)
    fig.suptitle(title or "Task separation and route drift")
    return fig


def _routed_figures(g: pd.DataFrame, tasks, schedule: str, folder: Path, label: str, files: list) -> None:
    for method in stats.method_order(g["method"].unique()):
        m = g[(g["method"] == method) & (g["status"] == "ok")]
        m = m[m["usage"].map(lambda u: u is not None)]
        if m.empty:
            continue
        first = m.sort_values("seed").iloc[0]
        U, seed = first["usage"], int(first["seed"])
        head = f"{method}, {label}, seed {seed}"
        _save_figure(files, usage_figure(U, tasks, schedule, f"Atom usage: {head}"), folder / f"{method}-usage", 100)
        _save_figure(
            files,
            atom_entropy_figure(U[-1], f"Atom entropy across tasks: {head}"),
            folder / f"{method}-atom-entropy",
            100,
        )
        drift = None
        if schedule == "sequential":
            _save_figure(files, drift_figure(U, tasks, f"Usage drift: {head}"), folder / f"{method}-drift", 100)
            drift = suite_stats.mean_over_seeds(m, "usage", continual.route_drift)
        kl = suite_stats.mean_over_seeds(m, "usage", lambda u: continual.symmetric_kl(u[-1]))
        title = f"Task separation and route drift: {method}, {label}, mean over {len(m)} seeds"
        _save_figure(files, kl_drift_figure(kl, drift, tasks, title), folder / f"{method}-kl-drift", 100)


def write_suite_report(frame: pd.DataFrame, out_dir: Path, *, formats=text.FORMATS, figures: bool = True) -> dict:
    """Every suite slice of `frame` (`suite_stats.load`) as a table (md, csv) and figures under out_dir/suites/;
    every table's Markdown states its records' provenance (`results.provenance`). Returns {"markdown": the section
    text, "files": [paths written], "provenance": of every record of `frame`}."""
    files, sections = [], []
    summary = suite_stats.summary(frame)
    for key, g in frame.groupby(suite_stats.SLICE, sort=True):
        arch, suite, schedule, budget, init = key
        tasks = list(g["tasks"].iloc[0])
        label = f"{suite}, {schedule}, {arch}{'' if init == DEFAULT_INIT else f' ({init} init)'}, {budget} budget"
        folder = out_dir / "suites" / _slug(arch if init == DEFAULT_INIT else f"{arch}-{init}") / _slug(budget)
        folder = folder / _slug(suite) / _slug(schedule)
        s = summary[(summary[suite_stats.SLICE] == pd.Series(dict(zip(suite_stats.SLICE, key)))).all(axis=1)]
        prov = results.provenance(g)  # the slice's records (`path`), once each
        md = f"### {label}\n\n{suite_stats.table_text(s.dropna(axis=1, how='all'))}\n\n{TABLE_NOTE}\n\n{prov}"
        _save_table(files, folder, md, s, formats)
        if figures and len(tasks) <= suite_stats.MAX_TASK_COLUMNS:  # a parametric suite's: the held-out section's
            panels = {}
            for method in stats.method_order(g["method"].unique()):
                R = suite_stats.mean_over_seeds(g[g["method"] == method], "R")
                if R is not None:
                    panels[method] = R
            if panels:
                title = f"Test MSE of every task after each stage: {label} (mean over seeds)"
                _save_figure(files, stage_task_figure(panels, tasks, schedule, title), folder / "stage-task-mse", 100)
            _routed_figures(g, tasks, schedule, folder, label, files)
            shown = sorted(p.name for p in files if p.parent == folder and p.suffix == ".png")
            md += "\n\n" + "\n".join(f"![{name}]({folder.relative_to(out_dir).as_posix()}/{name})" for name in shown)
        sections.append(md)
    md = "## Multi-task suites\n\n" + "\n\n".join(sections) + "\n" if sections else ""
    held = write_heldout_report(frame, out_dir, formats=formats, figures=figures)
    if held["markdown"]:
        md += "\n" + held["markdown"]
        files += held["files"]
    return {"markdown": md, "files": files, "provenance": results.provenance(frame)}
