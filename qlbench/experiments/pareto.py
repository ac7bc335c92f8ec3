"""The accuracy-cost Pareto sweep of the paper's figure "Instruction-queryable Pareto tradeoffs": a method run
over a grid of its size settings (r, M, k) on one function (a cell per grid point, `experiment`) or on one suite (a
suite row per grid point, `multitask`), every point an ordinary record of its own config, so a sweep resumes and
never overwrites; then per point the test MSE (mean ± std over seeds), the trainable parameters and the latency per
sample, and the non-dominated frontier.

Axes per method (GRID_AXES): r is the rank, M the number of shared atoms (queryable, instruct-queryable) or of
experts per layer (moe-lora), k the atoms or experts mixed per input; lora has r only. The paper's grid is r, M in
{4, 8, 16, 32} and k in {1, 2, 4, 8}; points with k > M are skipped and said so.

qlbench interpretation: every grid point keeps LoRA's default scale alpha / r = 2 (alpha = 2 r), so that r changes
the capacity and not the step size; the paper does not say how it scaled alpha across its grid.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from qlbench import adapters, inputs
from qlbench.experiments import experiment, multitask
from qlbench.metrics import stats, suite_stats
from qlbench.records import results
from qlbench.settings import DEFAULT_EXECUTION, DEFAULT_PROTOCOL, Execution, Protocol

GRID_AXES = {  # method -> {axis: config field}; the queryable family shares one config (its layers')
    **{m: {"r": "r", "M": "n_atoms", "k": "top_k"} for m in adapters.of_family("queryable")},
    "moe-lora": {"r": "r", "M": "n_experts", "k": "top_k"},
    "lora": {"r": "r"},
}
PAPER_GRID = {"r": (4, 8, 16, 32), "M": (4, 8, 16, 32), "k": (1, 2, 4, 8)}
SCALE = 2.0  # alpha / r at every grid point (qlbench interpretation)


def parse_grid(text: str | None) -> dict[str, tuple[int, ...]]:
    """'r=4,8 M=8,16 k=1,2' -> the paper's grid with those axes narrowed; None -> the paper's grid (inputs.grid's
    ValueError for anything else it refuses: an empty text, an axis given twice, a bad value)."""
    return dict(PAPER_GRID) if text is None else PAPER_GRID | inputs.grid(text, tuple(PAPER_GRID))


@dataclass(frozen=True)
class Point:
    """One grid point: its axis values and the method-config overrides that make it."""

    values: dict[str, int]
    overrides: dict

    @property
    def label(self) -> str:
        return " ".join(f"{a}={v}" for a, v in self.values.items())


def points(method: str, grid: dict[str, tuple[int, ...]]) -> tuple[list[Point], list[str]]:
    """The valid points of `grid` for `method` and the skipped ones, each with its reason (k > M). Axes the method
    does not have are ignored (lora: only r). ValueError for a method without a grid."""
    if method not in GRID_AXES:
        raise ValueError(f"no Pareto grid for method {method!r}; valid: {', '.join(GRID_AXES)}")
    axes = GRID_AXES[method]
    valid, skipped = [], []
    for combo in itertools.product(*(grid[a] for a in axes)):
        values = dict(zip(axes, combo))
        if "k" in values and values["k"] > values["M"]:
            skipped.append(f"{' '.join(f'{a}={v}' for a, v in values.items())} (k > M)")
            continue
        overrides = {axes[a]: v for a, v in values.items()} | {"alpha": SCALE * values["r"]}
        valid.append(Point(values, overrides))
    return valid, skipped


def plans(
    method: str,
    grid: dict,
    *,
    function: str | None = None,
    suite: str | None = None,
    schedule: str = "joint",
    overrides: dict | None = None,
    protocol: Protocol = DEFAULT_PROTOCOL,
    execution: Execution = DEFAULT_EXECUTION,
) -> tuple[list[tuple[Point, object]], list[str]]:
    """(point, plan) for every valid point: an `experiment.Plan` on `function`, or a `multitask.SuitePlan` on
    `suite` (one of the two), and the skipped points (`points`). `overrides`: hyper-parameters for every point,
    applied where the method's config has the field (as a sweep's --hp; planning.check_overrides checks them
    against all the methods of a sweep), none of which a point sets (its axes and alpha: ValueError). Every plan is
    validated before any work (ValueError)."""
    if (function is None) == (suite is None):
        raise ValueError("give exactly one of a function or a suite")
    valid, skipped = points(method, grid)
    if not valid:
        raise ValueError(f"the grid has no valid point for {method} (every point has k > M)")
    fields = {f.name for f in dataclasses.fields(adapters.get(method).config_cls)}
    overrides = {k: v for k, v in (overrides or {}).items() if k in fields}  # as a sweep: where the method has it
    if taken := [k for k in overrides if k in valid[0].overrides]:
        raise ValueError(
            f"hyper-parameter {', '.join(taken)} is set by the {method} grid (its axes "
            f"{', '.join(f'{a}: {f}' for a, f in GRID_AXES[method].items())}; alpha = {SCALE:g} r): narrow the grid "
            "instead"
        )
    out = []
    for pt in valid:
        settings = overrides | pt.overrides
        if function is not None:
            p = experiment.plan([function], [method], overrides=settings, protocol=protocol, execution=execution)
        else:
            p = multitask.plan(suite, schedule, [method], overrides=settings, protocol=protocol, execution=execution)
        out.append((pt, p))
    return out, skipped


# ---------------------------------------------------------------------------------------------------------------
# Reading a sweep back.


def _axis_values(method: str, method_config: dict) -> dict:
    axes = GRID_AXES.get(method, {})
    return {a: method_config.get(field) for a, field in axes.items()}


def load(paths: list[Path]) -> pd.DataFrame:
    """One row per record of a sweep (function cells or suite rows): method, r, M, k (NaN where the method has no
    such axis), trainable parameters, latency per sample at batch 256 (seconds; NaN without a cost), n seeds, and
    the test metric's mean and sample std over the finished seeds (cells: test MSE at the best-train epoch; suites:
    the average task MSE after the last stage), n_diverged, record and its commit and dirty flag."""
    rows = []
    for path in paths:
        rec = results.read_record(path)
        cfg, info = rec["run_info"]["config"], rec["train_info"]
        row = {"method": cfg["method"], **_axis_values(cfg["method"], cfg["method_config"])}
        row |= {"trainable_params": info.get("trainable_params"), "record": str(path)}
        row |= results.git_fields(rec["run_info"].get("git"))
        row |= {"latency_b256_s": results.cost_fields(info)["latency_b256_s"]}
        if "suite" in cfg:
            frame = suite_stats.load([path])
            values, status = frame.get("average", pd.Series(dtype=float)), frame["status"]
        else:
            frame = results.load([path])
            values, status = frame[stats.metric("test-at-best-train").column], frame["status"]
        ok = values[(status == "ok").to_numpy()].astype(float)
        ok = ok[np.isfinite(ok)]
        row |= {
            "n": len(frame),
            "n_diverged": int((status == "diverged").sum()),
            "mean": ok.mean() if len(ok) else np.nan,
            "std": ok.std(ddof=1) if len(ok) > 1 else np.nan,
        }
        rows.append(row)
    frame = pd.DataFrame(rows)
    return frame.astype({c: float for c in ("r", "M", "k") if c in frame})


def frontier(frame: pd.DataFrame, x: str) -> pd.Series:
    """True for the non-dominated points of `frame` (lower `x` and lower `mean` are better): no other point is at
    most as costly and at most as bad, and strictly better in one. A point with a diverged seed or no finite mean
    is never on the frontier."""
    ok = (frame["n_diverged"] == 0) & np.isfinite(frame["mean"]) & np.isfinite(frame[x])
    c, m = frame[x].to_numpy(float), frame["mean"].to_numpy(float)
    on = []
    for i in range(len(frame)):
        if not ok.iloc[i]:
            on.append(False)
            continue
        others = ok.to_numpy() & (c <= c[i]) & (m <= m[i]) & ((c < c[i]) | (m < m[i]))
        on.append(not others.any())
    return pd.Series(on, index=frame.index)
