"""The held-out section of a report: on the parametric suites (qlbench/parametric.py), zero-shot test MSE on the
tasks no row trained on, inside the training region (interpolation) and past it (extrapolation), per number of
training tasks T; each language row tested against its own identity control (the same row given a random code per
task instead of the sentence: it cannot transfer by construction; instruct-queryable against task-code, text-lora
against text-lora-code) and against LoRA (one update for every task); with the paraphrase and shuffled-sentence
controls; and two figures.

    <out>/heldout/<arch>[-<init>]/<budget>/<schedule>/
        table.md|csv        per T and row: held-out MSE by split and over both, the trained tasks' average, the
                            language rows' held-out MSE with paraphrases and with shuffled sentences, and their
                            paired tests of each split's held-out MSE against their code row and LoRA (Holm over
                            the whole experiment: every T and both splits)
        distance.png        each held-out task's MSE (mean over seeds) against its distance in parameter space to
                            the nearest training task, one panel per T
        tasks.png           held-out MSE by split against T

Input is `suite_stats.load`'s frame; only parametric suites' records are read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from qlbench import parametric, results, stats, suite_stats, suites, text
from qlbench.backbones import DEFAULT_INIT
from qlbench.report.write import _save_figure, _save_table, _slug
from qlbench.text import Column

CODE_OF = {"instruct-queryable": "task-code", "text-lora": "text-lora-code"}  # a language row -> its identity control
BLIND = "lora"  # one update for every task: what a row that reads no task does
SPLITS = suites.HELD_OUT_SPLITS
NOTE = (
    "Test MSE on standardised labels (1 = predicting each task's mean), mean ± std over seeds of the mean over the "
    "held-out tasks of a split (held-out: of both); trained: the average over the tasks trained on; paraphrased / "
    "shuffled: the held-out MSE with each held-out task's paraphrases in place of its sentence / with task t given "
    "task t + 1's sentence (instruction rows); vs code / vs lora (split): a language row's mean difference of the "
    "held-out MSE of that split against its identity control (task-code for instruct-queryable, text-lora-code for "
    "text-lora) / against LoRA, paired over seeds, raw p and Holm p over every test of the experiment (every T, both "
    "splits); win = significantly lower."
)


def tasks_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (record, seed, held-out task) of the parametric suites' ok seeds: arch, backbone_init, budget,
    schedule, T, method, seed, task, split, distance (to the nearest training task of its suite), mse (after the
    last stage), paraphrased, shuffled (NaN for rows without sentences)."""
    rows = []
    for _, r in frame[frame["suite"].isin(parametric.names()) & (frame["status"] == "ok")].iterrows():
        s = suites.get(r["suite"])
        trained = [parametric.params(t) for i, t in enumerate(s.tasks) if i not in s.held_out]
        for i in s.held_out:
            t = s.tasks[i]
            para, shuf = r.get("paraphrase"), r.get("shuffled_R")
            rows.append(
                {k: r[k] for k in ("arch", "backbone_init", "budget", "schedule", "method", "seed")}
                | {
                    "T": len(trained) if r["schedule"] == "held-out" else len(s.tasks) - len(s.held_out),
                    "task": t.name,
                    "split": t.split,
                    "distance": parametric.nearest(parametric.params(t), trained),
                    "mse": float(r["R"][-1, i]),
                    "paraphrased": float(para[i]) if para is not None else np.nan,
                    "shuffled": float(shuf[i]) if shuf is not None else np.nan,
                }
            )
    return pd.DataFrame(rows)


def _per_seed(g: pd.DataFrame, column: str, split: str | None = None) -> pd.Series:
    """The mean over a group's held-out tasks (of one split, or all) per seed."""
    g = g if split is None else g[g["split"] == split]
    return g.groupby("seed")[column].mean()


TESTS = tuple(f"vs {who} ({split})" for who in ("code", "lora") for split in SPLITS)  # the tested columns


def _cells(row: dict, m: pd.DataFrame, g: pd.DataFrame, frame: pd.DataFrame, key: tuple) -> list:
    """Fill one (T, method) row's MSE cells in place; return its paired tests [(row, column, paired_test)]: a
    language row against its code row and against LoRA, on each split's held-out MSE apart."""
    for split in (*SPLITS, None):
        v = _per_seed(m, "mse", split)
        row[split or "held-out"] = text.mean_std(v.mean(), v.std(ddof=1), len(v)) if len(v) else "-"
    method = row["method"]
    f = frame[(frame["suite"] == f"{parametric.PREFIX}{key[-1]}") & (frame["method"] == method)]
    f = f[f["schedule"] == key[3]]
    row["trained"] = suite_stats.cell(f["average"], f["status"]) if len(f) else "-"
    for column in ("paraphrased", "shuffled"):
        v = _per_seed(m, column)
        row[column] = text.mean_std(v.mean(), v.std(ddof=1), len(v)) if v.notna().any() else "-"
    tested = []
    for who, other in (("code", CODE_OF.get(method)), ("lora", BLIND if method in CODE_OF else None)):
        base = g[g["method"] == other]
        for split in SPLITS if len(base) else ():
            pair = pd.concat([_per_seed(m, "mse", split), _per_seed(base, "mse", split)], axis=1, join="inner")
            tested.append((row, f"vs {who} ({split})", stats.paired_test(pair.iloc[:, 0], pair.iloc[:, 1])))
    return tested


def summary(tasks: pd.DataFrame, frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (slice, T, method): n seeds, held-out MSE per split, trained average, paraphrased and shuffled
    held-out MSE (text), and each language row's paired tests over seeds against its code row and against BLIND
    on each split apart (TESTS), Holm-adjusted over every test of the experiment (every T and both splits of one
    (arch, init, budget, schedule)): the experiment asks them all at once."""
    out = []
    keys = ["arch", "backbone_init", "budget", "schedule", "T"]
    for _, experiment in tasks.groupby(keys[:4], sort=True):
        tested = []  # one family: every test of the experiment, every T and both splits
        for key, g in experiment.groupby(keys, sort=True):
            for method in stats.method_order(g["method"].unique()):
                m = g[g["method"] == method]
                out.append(dict(zip(keys, key)) | {"method": method, "n": m["seed"].nunique()})
                tested += _cells(out[-1], m, g, frame, key)
        adjusted = stats.holm([t["p"] for *_, t in tested])
        for (row, column, t), p_holm in zip(tested, adjusted):
            outcome = t["outcome"] if p_holm < stats.ALPHA else "tie"
            row[column] = (
                f"{text.num(t['mean_diff'], 2)} (p {text.num(t['p'], 2)}, Holm {text.num(p_holm, 2)}) {outcome}"
            )
    return (
        pd.DataFrame(out)
        .reindex(
            columns=[
                *keys,
                "method",
                "n",
                *SPLITS,
                "held-out",
                "trained",
                "paraphrased",
                "shuffled",
                *TESTS,
            ]
        )
        .fillna("-")
    )


def distance_figure(tasks: pd.DataFrame, title: str) -> Figure:
    """Held-out MSE (mean over seeds) against distance to the nearest training task, a panel per T."""
    mean = tasks.groupby(["T", "method", "task", "split", "distance"], as_index=False)["mse"].mean()
    Ts = sorted(mean["T"].unique())
    fig = Figure(figsize=(4.2 * len(Ts), 3.8), layout="constrained")
    axes = fig.subplots(1, len(Ts), sharey=True, squeeze=False)[0]
    order = stats.method_order(mean["method"].unique())
    for ax, T in zip(axes, Ts):
        sns.scatterplot(
            data=mean[mean["T"] == T], x="distance", y="mse", hue="method", hue_order=order, style="split", ax=ax
        )
        ax.set(title=f"T = {T} training tasks", xlabel="")
        ax.set_yscale("log")
        if ax is not axes[-1] and ax.get_legend():
            ax.get_legend().remove()
    if axes[-1].get_legend():
        sns.move_legend(axes[-1], "upper left", bbox_to_anchor=(1.02, 1))  # beside the panels, over no point
    axes[0].set_ylabel("held-out test MSE (mean over seeds)")
    fig.supxlabel("distance to the nearest training task (in training ranges)")
    fig.suptitle(title)
    return fig


def tasks_figure(tasks: pd.DataFrame, title: str) -> Figure:
    """Held-out MSE by split (mean over seeds of the split's mean) against T, a line per row."""
    per_seed = tasks.groupby(["T", "method", "split", "seed"], as_index=False)["mse"].mean()
    fig = Figure(figsize=(9, 3.8), layout="constrained")
    axes = fig.subplots(1, len(SPLITS), sharey=True)
    order = stats.method_order(per_seed["method"].unique())
    for ax, split in zip(axes, SPLITS):
        sns.lineplot(
            data=per_seed[per_seed["split"] == split], x="T", y="mse", hue="method", hue_order=order, marker="o",
            errorbar="sd", ax=ax,
        )  # fmt: skip
        ax.set(title=split, xscale="log", xlabel="training tasks T", ylabel="held-out test MSE")
        Ts = sorted(per_seed["T"].unique())
        ax.set_xticks(Ts, [str(t) for t in Ts], minor=False)
        ax.set_xticks([], minor=True)
        ax.set_yscale("log")
        if ax is not axes[-1] and ax.get_legend():
            ax.get_legend().remove()
    if axes[-1].get_legend():
        sns.move_legend(axes[-1], "upper left", bbox_to_anchor=(1.02, 1))
    fig.suptitle(title)
    return fig


def write_heldout_report(frame: pd.DataFrame, out_dir: Path, *, formats=text.FORMATS, figures: bool = True) -> dict:
    """The held-out section for every parametric slice of `frame`; {"markdown", "files"} (empty without one)."""
    tasks = tasks_frame(frame) if len(frame) else pd.DataFrame()
    if tasks.empty:
        return {"markdown": "", "files": []}
    table = summary(tasks, frame)
    files, sections = [], []
    for key, g in tasks.groupby(["arch", "backbone_init", "budget", "schedule"], sort=True):
        arch, init, budget, schedule = key
        label = f"{parametric.PREFIX}T, {schedule}, {arch}{'' if init == DEFAULT_INIT else f' ({init} init)'}, {budget}"
        folder = out_dir / "heldout" / _slug(arch if init == DEFAULT_INIT else f"{arch}-{init}") / _slug(budget)
        folder = folder / _slug(schedule)
        rows = table[(table[["arch", "backbone_init", "budget", "schedule"]] == list(key)).all(axis=1)]
        columns = [Column("T", "T"), Column("row", "method"), Column("n", "n")]
        shown = (*SPLITS, "held-out", "trained", "paraphrased", "shuffled", *TESTS)
        columns += [Column(c, c) for c in shown]
        columns = [c for c in columns if c.field in rows and (rows[c.field] != "-").any()]
        records = frame[frame["suite"].isin(parametric.names()) & (frame["schedule"] == schedule)]
        md = f"### Held-out tasks: {label}\n\n{text.table(rows.to_dict('records'), columns)}\n\n{NOTE}\n\n"
        md += results.provenance(records)
        _save_table(files, folder, md, rows, formats)
        if figures:
            title = f"Zero-shot MSE of held-out tasks: {label}"
            _save_figure(files, distance_figure(g, title), folder / "distance", 100)
            if g["T"].nunique() > 1:
                _save_figure(
                    files, tasks_figure(g, f"Held-out MSE against training tasks: {label}"), folder / "tasks", 100
                )
            shown = sorted(p.name for p in files if p.parent == folder and p.suffix == ".png")
            md += "\n\n" + "\n".join(f"![{n}]({folder.relative_to(out_dir).as_posix()}/{n})" for n in shown)
        sections.append(md)
    return {"markdown": "## Held-out tasks (parametric suites)\n\n" + "\n\n".join(sections) + "\n", "files": files}
