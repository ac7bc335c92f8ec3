"""The report of `qlbench real`: a table (mean ± std over seeds per task and overall, trainable parameters, paired
test against LoRA) and a figure (test MSE per task and method, one point per seed), from the method records."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from qlbench import adapters, text
from qlbench.experiments.real import METHODS, TASKS, check_record
from qlbench.metrics import stats
from qlbench.records import results, store
from qlbench.report.write import _save_figure


def legend(comparisons: pd.DataFrame) -> str:
    """The table's legend, with the size of its Holm family (the methods compared with LoRA that have a p)."""
    family = int(comparisons["p"].notna().sum())
    return (
        "Test MSE of the +1/-1 answers at the end of training (a constant prediction scores about 1), mean ± sample "
        "std over seeds; vs LoRA: the mean over tasks paired with LoRA by seed (paired t-test, Wilcoxon signed-rank "
        f"when a seed diverged), its raw p and its p Holm-adjusted over the table's {family} comparisons with LoRA "
        "(every method against LoRA); win / loss = significantly lower / higher on the Holm p (< 0.05 with at least "
        "3 pairs), else tie. The tasks share their sentences and differ only in the instruction that every method "
        "reads in its input (qlbench/experiments/real.py)."
    )


def frame(paths: list[Path], on_damaged=None) -> pd.DataFrame:
    """One row per (method, seed) of the records, every task's MSE and the mean, methods in METHODS order, and the
    record's path, commit and dirty flag (None in records written before git was recorded). A record that cannot be
    read is reported through `on_damaged` and skipped (raised when None)."""
    rows = []
    for path in sorted(paths, key=lambda p: METHODS.index(p.stem) if p.stem in METHODS else len(METHODS)):
        try:
            rec = check_record(store.read_json(path), path)  # a record of another shape is damaged, not read
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
                | {"record": str(path)} | results.git_fields(rec.get("git"))
            )  # fmt: skip
    return pd.DataFrame(rows)


def comparisons(f: pd.DataFrame) -> pd.DataFrame:
    """Every method but LoRA paired with LoRA by seed on the mean over tasks (`stats.paired_test` on the common
    seeds): one row per method with n, mean_diff, p (raw), p_holm and outcome. The table compares them all at once,
    so they are one family: p_holm is p Holm-adjusted over it (`stats.holm`), and a win or loss needs
    p_holm < stats.ALPHA (as `stats.compare`). Empty without LoRA."""
    base = f[f["method"] == adapters.BASELINE].set_index("seed")["test_mse"]
    rows = []
    for method, g in f.groupby("method", sort=False):
        if method != adapters.BASELINE and len(base):
            common = sorted(set(g["seed"]) & set(base.index))
            test = stats.paired_test(g.set_index("seed").loc[common, "test_mse"], base.loc[common])
            rows.append({"method": method} | {k: test[k] for k in ("n", "mean_diff", "p", "outcome")})
    out = pd.DataFrame(rows, columns=["method", "n", "mean_diff", "p", "p_holm", "outcome"])
    out["p_holm"] = stats.holm(out["p"].to_numpy(float))  # NaN (no test) stays out of the family
    out["outcome"] = out["outcome"].where(out["p_holm"] < stats.ALPHA, "tie")  # p_holm >= p: only fewer claims
    return out


def table(f: pd.DataFrame) -> pd.DataFrame:
    """One row per method: trainable parameters, mean ± std per task and over tasks, and vs LoRA (`comparisons`:
    the outcome, decided on the Holm p, with the raw p and the Holm p)."""
    vs = comparisons(f).set_index("method")
    rows = []
    for method, g in f.groupby("method", sort=False):
        cells = {"method": method, "trainable": f"{int(g['trainable_params'].iloc[0]):,}"}
        for col in (*TASKS, "test_mse"):
            v = g[col].to_numpy(float)
            std = float(np.std(v, ddof=1)) if len(v) > 1 else float("nan")
            cells["mean over tasks" if col == "test_mse" else col] = text.mean_std(float(np.mean(v)), std, len(v))
        if method in vs.index:
            c = vs.loc[method]
            cells["vs LoRA"] = f"{c['outcome']} (p {text.p_value(c['p'])}, Holm {text.p_value(c['p_holm'])})"
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
    """real.md (with its records' provenance, `results.provenance`), real.csv and real.png / .pdf into `folder`;
    returns {markdown, files, provenance}."""
    f = frame(paths, on_damaged)
    if f.empty:
        return {"markdown": "", "files": [], "provenance": ""}
    folder.mkdir(parents=True, exist_ok=True)
    prov = results.provenance(f)
    md = f"### On a real model: all-MiniLM-L6-v2\n\n{text.markdown(table(f))}\n\n{legend(comparisons(f))}\n\n{prov}\n"
    files = [folder / "real.md", folder / "real.csv"]
    store.write_text(md, files[0])
    store.write_text(text.csv(f.drop(columns=["record", *results.GIT_COLUMNS])), files[1])
    _save_figure(files, figure(f), folder / "real")
    return {"markdown": md, "files": files, "provenance": prov}
