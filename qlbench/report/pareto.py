"""The Pareto section of `qlbench pareto`: the grid's table (one row per point, frontier marked) and the paper's two
panels, from `qlbench.experiments.pareto.load`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from qlbench import text
from qlbench.experiments import pareto
from qlbench.metrics import stats
from qlbench.records import results, store
from qlbench.report.cost_figures import pareto_figure
from qlbench.report.write import _save_figure

LEGEND = (
    "One row per grid point (qlbench/experiments/pareto.py; alpha = 2 r at every point): mean ± sample std over the "
    "finished seeds, n seeds (k diverged: the point is never on a frontier); latency: median seconds per sample of "
    "no-grad forwards at batch 256 on one member (qlbench/cost.py, - when not measured); front: on the non-dominated "
    "frontier against latency (L) and against trainable parameters (P)."
)


def table(frame: pd.DataFrame) -> pd.DataFrame:
    """The grid as text, methods in the tables' order, then by parameters."""
    f = frame.assign(order=frame["method"].map(stats.method_order(frame["method"]).index))
    f = f.sort_values(["order", "trainable_params", "latency_us"], kind="stable")
    axis = lambda v: "-" if v is None or not np.isfinite(v) else str(int(v))
    rows = []
    for _, r in f.iterrows():
        n_ok = r["n"] - r["n_diverged"]
        rows.append(
            {
                "method": r["method"],
                "r": axis(r.get("r")),
                "M": axis(r.get("M")),
                "k": axis(r.get("k")),
                "trainable": f"{int(r['trainable_params']):,}",
                "µs/sample b256": "-" if not np.isfinite(r["latency_us"]) else text.num(r["latency_us"], 3),
                "test MSE": text.mean_std(r["mean"], r["std"], int(n_ok)),
                "n (div.)": f"{int(r['n'])} ({int(r['n_diverged'])})",
                "front": ("L" if r["front_latency"] else "") + ("P" if r["front_params"] else ""),
            }
        )
    return pd.DataFrame(rows)


def write(frame: pd.DataFrame, folder: Path, title: str, ylabel: str) -> dict:
    """pareto.md (the table and its records' provenance, `results.provenance`), pareto.csv (the numbers) and
    pareto.png / .pdf into `folder`; returns {markdown, folder, files}."""
    frame = frame.assign(latency_us=frame["latency_b256_s"] * 1e6)
    frame = frame.assign(
        front_latency=pareto.frontier(frame, "latency_us"), front_params=pareto.frontier(frame, "trainable_params")
    )
    folder.mkdir(parents=True, exist_ok=True)
    md = f"### {title}\n\n{text.markdown(table(frame))}\n\n{LEGEND}\n\n{results.provenance(frame)}\n"
    files = [folder / "pareto.md", folder / "pareto.csv"]
    store.write_text(md, files[0])
    columns = ["record", *(c for c in results.GIT_COLUMNS if c in frame)]  # provenance is in the Markdown
    store.write_text(text.csv(frame.drop(columns=columns)), files[1])
    _save_figure(files, pareto_figure(frame, title, ylabel), folder / "pareto")
    return {"markdown": md, "folder": folder, "files": files}
