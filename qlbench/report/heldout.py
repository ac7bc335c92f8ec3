"""The held-out section of a report: on the parametric suites (qlbench/parametric.py), zero-shot test MSE on the
tasks no row trained on, inside the training region (interpolation) and past it (extrapolation), per number of
training tasks T; each language row (LANGUAGE) tested against its own identity control (the same row given a random
code per task instead of the sentence: it cannot transfer by construction; instruct-queryable against task-code,
text-lora against text-lora-code), against LoRA (one update for every task), and against the controls that can
transfer without words: its parameter-code twin (PARAMS_OF: instruct-queryable against param-code, text-lora
against text-lora-params, the same row fed a fixed projection of each task's true parameters) and nearest-task (one
LoRA per training task, each held-out task through its nearest training task's); with the paraphrase and
shuffled-sentence controls; and two figures.

    <out>/heldout/<arch>[-<init>]/<budget>/<schedule>[-n<n>]/
        table.md|csv        per T and row: held-out MSE by split and over both, the same per split with the labels
                            standardised by the training tasks' statistics (records that have it), the trained
                            tasks' average, the language rows' held-out MSE with paraphrases and with shuffled
                            sentences, and their paired tests of each split's held-out MSE against each control
                            (Holm over the whole experiment: every T, both splits, every control)
        distance.png        each held-out task's MSE (mean over seeds) against its distance in parameter space to
                            the nearest training task, one panel per T
        tasks.png           held-out MSE by split against T

One experiment (table, Holm family, folder) per (arch, init, budget, schedule) and data design: the fixed-total
suites param-sin-cos-T in `<schedule>/`, the fixed-n suites param-sin-cos-T-n<n> in `<schedule>-n<n>/`. Columns
without a value are left out (the optional ones, OPTIONAL, from the CSV as well), so a table of records without
the new rows or fields reads as before.

Input is `suite_stats.load`'s frame; only parametric suites' records are read, and each record once more (by the
frame's path) for the per-seed `train_standardised_task_mse` that `load` does not carry (missing in older records).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from qlbench import parametric, suites, text
from qlbench.backbones import DEFAULT_INIT
from qlbench.metrics import stats, suite_stats
from qlbench.records import results
from qlbench.records.store import DamagedFile
from qlbench.report.write import _save_figure, _save_table, _slug
from qlbench.text import Column

CODE_OF = {"instruct-queryable": "task-code", "text-lora": "text-lora-code"}  # a language row -> its identity control
LANGUAGE = tuple(CODE_OF)  # the rows that read the task's sentence
PARAMS_OF = {"instruct-queryable": "param-code", "text-lora": "text-lora-params"}  # -> its parameter-code twin
BLIND = "lora"  # one update for every task: what a row that reads no task does
NEAREST = "nearest-task"  # one LoRA per training task, a held-out task through its nearest training task's
SPLITS = suites.HELD_OUT_SPLITS
TRAIN_STD = tuple(f"{split} (train std)" for split in SPLITS)  # held-out MSE, labels by the training statistics
FIXED_TOTAL = 0  # `per_task` of a fixed-total suite (its per-task n depends on T)
NOTE = (
    "Test MSE on standardised labels (1 = predicting each task's mean), mean ± std over seeds of the mean over the "
    "held-out tasks of a split (held-out: of both); trained: the average over the tasks trained on; paraphrased / "
    "shuffled: the held-out MSE with each held-out task's paraphrases in place of its sentence / with task t given "
    "task t + 1's sentence (instruction rows); vs code / vs lora (split): a language row's mean difference of the "
    "held-out MSE of that split against its identity control (task-code for instruct-queryable, text-lora-code for "
    "text-lora) / against LoRA, paired over seeds, with its 95% bootstrap interval over the split's held-out tasks "
    "and then their seeds, raw p and Holm p over every test of the experiment (every T, both splits); win / loss = "
    "lower / higher with Holm p < 0.05 and an interval that excludes 0, else tie."
)
NOTE_TRAIN_STD = (
    " Headline columns (interpolation, extrapolation, held-out and every test) standardise each held-out task's "
    "labels by its own mean and std over the box, as the trained tasks' are (an oracle a zero-shot method would not "
    "have); interpolation / extrapolation (train std): the same MSE with the held-out labels standardised instead by "
    "the pooled mean and std of the training tasks' training labels (suite_tasks.restandardise), not tested."
)
NOTE_TRANSFER = (
    " vs params (split): instruct-queryable against param-code, text-lora against text-lora-params (the same row fed "
    "a fixed seeded projection of each task's true parameters instead of its sentence: a control that can transfer); "
    "vs nearest (split): a language row against nearest-task (one LoRA per training task, each held-out task "
    "evaluated through its nearest training task's in parameter space); same pairing and Holm family."
)


def _train_standardised(path, cache: dict) -> dict:
    """seed -> the per-seed train_standardised_task_mse (T,) of the record at `path`, for the seeds that have it
    (none for an older record, a damaged one or no path)."""
    if not isinstance(path, str) or not path:
        return {}
    if path not in cache:
        try:
            per_seed = results.read_record(path)["train_info"].get("per_seed") or []
        except (DamagedFile, OSError):
            per_seed = []
        cache[path] = {
            s["seed"]: s["train_standardised_task_mse"] for s in per_seed if s.get("train_standardised_task_mse")
        }
    return cache[path]


def tasks_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (record, seed, held-out task) of the parametric suites' ok seeds: arch, backbone_init, budget,
    schedule, per_task (FIXED_TOTAL, or a fixed-n suite's n), T, method, seed, task, split, distance (to the
    nearest training task of its suite), mse (after the last stage), mse_train_std (the same with the labels
    standardised by the training tasks' statistics; NaN where the record lacks it), paraphrased, shuffled (NaN for
    rows without sentences)."""
    rows, cache = [], {}
    for _, r in frame[frame["suite"].isin(parametric.names()) & (frame["status"] == "ok")].iterrows():
        s = suites.get(r["suite"])
        n = parametric.size(r["suite"])[1]
        trained = [parametric.params(t) for i, t in enumerate(s.tasks) if i not in s.held_out]
        standardised = _train_standardised(r.get("path"), cache).get(r["seed"])
        for i in s.held_out:
            t = s.tasks[i]
            para, shuf = r.get("paraphrase"), r.get("shuffled_R")
            rows.append(
                {k: r[k] for k in ("arch", "backbone_init", "budget", "schedule", "method", "seed")}
                | {
                    "per_task": FIXED_TOTAL if n is None else n,
                    "T": len(trained) if r["schedule"] == "held-out" else len(s.tasks) - len(s.held_out),
                    "task": t.name,
                    "split": t.split,
                    "distance": parametric.nearest(parametric.params(t), trained),
                    "mse": float(r["R"][-1, i]),
                    "mse_train_std": np.nan
                    if standardised is None or standardised[i] is None
                    else float(standardised[i]),
                    "paraphrased": float(para[i]) if para is not None else np.nan,
                    "shuffled": float(shuf[i]) if shuf is not None else np.nan,
                }
            )
    return pd.DataFrame(rows)


def _per_seed(g: pd.DataFrame, column: str, split: str | None = None) -> pd.Series:
    """The mean over a group's held-out tasks (of one split, or all) per seed."""
    g = g if split is None else g[g["split"] == split]
    return g.groupby("seed")[column].mean()


def _controls(method: str) -> tuple[tuple[str, str | None], ...]:
    """(who, control row or None) of each test a row gets: a language row against its code row, LoRA, its
    parameter-code twin and nearest-task; any other row none."""
    language = method in LANGUAGE
    return (
        ("code", CODE_OF.get(method)),
        ("lora", BLIND if language else None),
        ("params", PARAMS_OF.get(method)),
        ("nearest", NEAREST if language else None),
    )


WHO = ("code", "lora", "params", "nearest")
TESTS = tuple(f"vs {who} ({split})" for who in WHO for split in SPLITS)  # the tested columns
# columns a table has only where some row has a value (the tables of records before them read as before)
OPTIONAL = (*TRAIN_STD, *(f"vs {who} ({split})" for who in ("params", "nearest") for split in SPLITS), "per task")


def _text(v: pd.Series) -> str:
    return text.mean_std(v.mean(), v.std(ddof=1), len(v)) if v.notna().any() else "-"


def interval(m: pd.DataFrame, base: pd.DataFrame, split: str) -> tuple[float, float]:
    """95% interval of the mean difference of held-out MSE (row - control) on one split: a hierarchical bootstrap
    (stats.hierarchical_bootstrap) that draws the split's held-out tasks with replacement, then each drawn task's
    paired seeds, so it carries how much tasks differ as well as seeds. NaN without a pair."""
    a = m[m["split"] == split].pivot_table(index="task", columns="seed", values="mse")  # (tasks, seeds)
    b = base[base["split"] == split].pivot_table(index="task", columns="seed", values="mse")
    d = a - b.reindex(index=a.index, columns=a.columns)
    groups = [r.dropna().to_numpy(float) for _, r in d.iterrows() if r.notna().any()]
    if not groups:
        return math.nan, math.nan
    boot = stats.hierarchical_bootstrap(groups)
    low, high = np.quantile(boot, [0.025, 0.975], method="inverted_cdf")
    return float(low), float(high)


def _cells(row: dict, m: pd.DataFrame, g: pd.DataFrame, frame: pd.DataFrame, key: tuple) -> list:
    """Fill one (T, method) row's MSE cells in place; return its paired tests [(row, column, paired_test)]: a
    language row against each of its controls (_controls), on each split's held-out MSE apart. `key` the row's
    (arch, init, budget, schedule, per_task, T)."""
    for split in (*SPLITS, None):
        v = _per_seed(m, "mse", split)
        row[split or "held-out"] = text.mean_std(v.mean(), v.std(ddof=1), len(v)) if len(v) else "-"
    for split, column in zip(SPLITS, TRAIN_STD):
        row[column] = _text(_per_seed(m.dropna(subset=["mse_train_std"]), "mse_train_std", split))
    method, (schedule, per_task, T) = row["method"], key[3:]
    suite = parametric.suite_name(T, None if per_task == FIXED_TOTAL else per_task)
    f = frame[(frame["suite"] == suite) & (frame["method"] == method)]
    f = f[f["schedule"] == schedule]
    row["trained"] = suite_stats.cell(f["average"], f["status"]) if len(f) else "-"
    for column in ("paraphrased", "shuffled"):
        v = _per_seed(m, column)
        row[column] = text.mean_std(v.mean(), v.std(ddof=1), len(v)) if v.notna().any() else "-"
    tested = []
    for who, other in _controls(method):
        base = g[g["method"] == other]
        for split in SPLITS if len(base) else ():
            pair = pd.concat([_per_seed(m, "mse", split), _per_seed(base, "mse", split)], axis=1, join="inner")
            test = stats.paired_test(pair.iloc[:, 0], pair.iloc[:, 1]) | {"ci": interval(m, base, split)}
            tested.append((row, f"vs {who} ({split})", test))
    return tested


def summary(tasks: pd.DataFrame, frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (slice, data design, T, method): n seeds, held-out MSE per split (own and training-statistics
    standardisation), trained average, paraphrased and shuffled held-out MSE (text), and each language row's paired
    tests over seeds against each of its controls on each split apart (TESTS), Holm-adjusted over every test of the
    experiment (every T, both splits and every control of one (arch, init, budget, schedule, design)): the
    experiment asks them all at once. `per task` names a fixed-n design's n ("-" under the fixed total); a frame
    without the per_task or mse_train_std columns (made by hand) reads as the fixed total without them."""
    tasks = tasks.assign(**{c: v for c, v in (("per_task", FIXED_TOTAL), ("mse_train_std", np.nan)) if c not in tasks})
    out = []
    keys = ["arch", "backbone_init", "budget", "schedule", "per_task", "T"]
    for _, experiment in tasks.groupby(keys[:5], sort=True):
        tested = []  # one family: every test of the experiment, every T, both splits and every control
        for key, g in experiment.groupby(keys, sort=True):
            for method in stats.method_order(g["method"].unique()):
                m = g[g["method"] == method]
                out.append(
                    dict(zip(keys, key))
                    | {"per task": "-" if key[4] == FIXED_TOTAL else str(key[4])}
                    | {"method": method, "n": m["seed"].nunique()}
                )
                tested += _cells(out[-1], m, g, frame, key)
        adjusted = stats.holm([t["p"] for *_, t in tested])
        for (row, column, t), p_holm in zip(tested, adjusted):
            low, high = t["ci"]
            outcome = str(stats.claimed(t["outcome"], p_holm, low, high, null=0.0))
            ci = f"[{text.num(low, 2)}, {text.num(high, 2)}]"
            row[column] = (
                f"{text.num(t['mean_diff'], 2)} {ci} (p {text.num(t['p'], 2)}, Holm {text.num(p_holm, 2)}) {outcome}"
            )
    columns = [*keys, "per task", "method", "n", *SPLITS, "held-out", *TRAIN_STD, "trained", "paraphrased", "shuffled"]
    table = pd.DataFrame(out).reindex(columns=[*columns, *TESTS])
    return table.astype({c: object for c in table if table[c].isna().all()}).fillna("-")  # an untested column: "-"


def written(rows: pd.DataFrame) -> pd.DataFrame:
    """One table's rows as written: without the internal per_task key, and without an OPTIONAL column that holds
    no value."""
    return rows.drop(
        columns=[c for c in ("per_task", *OPTIONAL) if c in rows and (c == "per_task" or (rows[c] == "-").all())]
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
    slices = ["arch", "backbone_init", "budget", "schedule", "per_task"]
    for key, g in tasks.groupby(slices, sort=True):
        arch, init, budget, schedule, per_task = key
        n = None if per_task == FIXED_TOTAL else int(per_task)
        family = f"{parametric.PREFIX}T" + ("" if n is None else f"-n{n}")
        label = f"{family}, {schedule}, {arch}{'' if init == DEFAULT_INIT else f' ({init} init)'}, {budget}"
        folder = out_dir / "heldout" / _slug(arch if init == DEFAULT_INIT else f"{arch}-{init}") / _slug(budget)
        folder = folder / _slug(schedule if n is None else f"{schedule}-n{n}")
        rows = written(table[(table[slices] == list(key)).all(axis=1)])
        columns = [Column("T", "T"), Column("row", "method"), Column("n", "n")]
        columns += [Column(c, c) for c in (*SPLITS, "held-out", *TRAIN_STD, "trained", "paraphrased", "shuffled")]
        columns += [Column(c, c) for c in TESTS]
        columns = [c for c in columns if c.field in rows and (rows[c.field] != "-").any()]
        note = NOTE + (NOTE_TRAIN_STD if TRAIN_STD[0] in rows or TRAIN_STD[1] in rows else "")
        note += NOTE_TRANSFER if any(c in rows for c in OPTIONAL if c.startswith("vs ")) else ""
        design = frame["suite"].isin([parametric.suite_name(T, n) for T in parametric.SIZES])
        records = frame[design & (frame["schedule"] == schedule)]
        md = f"### Held-out tasks: {label}\n\n{text.table(rows.to_dict('records'), columns)}\n\n{note}\n\n"
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
            md += "\n\n" + "\n".join(f"![{f}]({folder.relative_to(out_dir).as_posix()}/{f})" for f in shown)
        sections.append(md)
    return {"markdown": "## Held-out tasks (parametric suites)\n\n" + "\n\n".join(sections) + "\n", "files": files}
