"""The report of `qlbench real`: a table (mean ± std over seeds per task and overall, trainable parameters, paired
test against LoRA) and a figure (test MSE per task and method, one point per seed), from the method records."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from qlbench import stats, store, text
from qlbench.real import METHODS, TASKS
from qlbench.report.write import _save_figure

LEGEND = (
    "Test MSE of the +1/-1 answers at the end of training (a constant prediction scores about 1), mean ± sample std "
    "over seeds; vs LoRA: the mean over tasks paired with LoRA by seed (paired t-test; win = significantly lower, "
    "tie below 3 pairs or p >= 0.05). The tasks share their sentences and differ only in the instruction that "
    "every method reads in its input (qlbench/real.py)."
)


def frame(paths: list[Path], on_damaged=None) -> pd.DataFrame:
    """One row per (method, seed) of the records, every task's MSE and the mean, methods in METHODS order. A record
    that cannot be read is reported through `on_damaged` and skipped (raised when None)."""
    rows = []
    for path in sorted(paths, key=lambda p: METHODS.index(p.stem) if p.stem in METHODS else len(METHODS)):
        try:
            rec = store.read_json(path)
            per_seed = [(s, s["test_mse_per_task"]) for s in rec["per_seed"]]
        except (store.DamagedFile, KeyError, TypeError) as err:
            if on_damaged is None:
                raise
            on_damaged(f"{path}: unreadable real-model record ({err}); skipped")
            continue
        for s, tasks in per_seed:
            ok = s.get("status") == "ok"
            rows.append(
                {"method": rec["method"], "seed": s["seed"], "test_mse": s["test_mse"] if ok else np.inf,
                 "trainable_params": s["trainable_params"]}
                | {f: tasks[f] if ok else np.inf for f in TASKS}
            )  # fmt: skip
    return pd.DataFrame(rows)


def table(f: pd.DataFrame) -> pd.DataFrame:
    base = f[f["method"] == "lora"].set_index("seed")["test_mse"]
    rows = []
    for method, g in f.groupby("method", sort=False):
        cells = {"method": method, "trainable": f"{int(g['trainable_params'].iloc[0]):,}"}
        for col in (*TASKS, "test_mse"):
            v = g[col].to_numpy(float)
            std = float(np.std(v, ddof=1)) if len(v) > 1 else float("nan")
            cells["mean over tasks" if col == "test_mse" else col] = text.mean_std(float(np.mean(v)), std, len(v))
        if method != "lora" and len(base):
            common = sorted(set(g["seed"]) & set(base.index))
            test = stats.paired_test(g.set_index("seed").loc[common, "test_mse"], base.loc[common])
            cells["vs LoRA"] = f"{test['outcome']} (p {text.p_value(test['p'])})"
        else:
            cells["vs LoRA"] = "-"
        rows.append(cells)
    return pd.DataFrame(rows)


def figure(f: pd.DataFrame) -> Figure:
    methods = list(dict.fromkeys(f["method"]))
    fig = Figure(figsize=(7.5, 3.4))
    ax = fig.subplots()
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        g = f[f["method"] == m]
        for j, task in enumerate((*TASKS, "test_mse")):
            v = g[task].to_numpy(float)
            x = j + (i - (len(methods) - 1) / 2) * width
            ax.bar(x, np.mean(v), width, color=f"C{i}", alpha=0.5, label=m if j == 0 else None)
            ax.plot(np.full(len(v), x), v, "o", color=f"C{i}", ms=3)
    ax.set_xticks(range(len(TASKS) + 1), [*TASKS, "mean"])
    ax.set_yscale("log")  # the adapters sit two orders of magnitude below the head alone
    ax.set_ylabel("test MSE (answers +1 / -1), log scale")
    ax.set_title("all-MiniLM-L6-v2 adapted to three instructed yes/no tasks (dots: seeds)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    return fig


def write(paths: list[Path], folder: Path, on_damaged=None) -> dict:
    """real.md, real.csv and real.png / .pdf into `folder`; returns {markdown, files}."""
    f = frame(paths, on_damaged)
    if f.empty:
        return {"markdown": "", "files": []}
    folder.mkdir(parents=True, exist_ok=True)
    md = f"### On a real model: all-MiniLM-L6-v2\n\n{text.markdown(table(f))}\n\n{LEGEND}\n"
    files = [folder / "real.md", folder / "real.csv"]
    store.write_text(md, files[0])
    store.write_text(f.to_csv(index=False), files[1])
    _save_figure(files, figure(f), folder / "real")
    return {"markdown": md, "files": files}
