"""Item analysis of a benchmark's tasks: does a task tell methods apart, and does it measure adaptation?

A task is one (arch, backbone init, budget, function) slice of a per-seed frame (`per_seed.load`), as a test item
is one question of an exam. Every number of a task is taken on the seeds that all its methods have. Per task
(`analyse`):

- headroom_frozen, headroom_mean: the mean MSE of `frozen` (no adaptation) and of `mean` (a constant predictor)
  over the best trained method's mean MSE; near 1, adaptation has nothing to win.
- seed_noise: the median over trained methods of the standard deviation over seeds of ln MSE (finite seeds): how
  far one seed's MSE strays, as a factor (0.1: about 10 %).
- reliability: split-half reliability of the method order. The seeds every method has are split in two halves at
  random; the methods are ordered by mean ln MSE (a diverged seed counts as inf, so a method with one sorts last)
  in each half; r, the mean over SPLITS random splits of the Spearman correlation of the two orders, is stepped up
  to the whole seed count once by Spearman-Brown, 2r / (1 + r) (at least -1). NaN with fewer than 4 common seeds.
- worse_than_frozen: the share of trained methods whose mean MSE (inf-aware) ends above `frozen`'s.
- divergence: the share of trained (method, seed) runs that diverged.
- verdict (`verdict`): keep, re-parameterise or drop by the thresholds below (qlbench interpretation: the
  thresholds are a reviewer's rules of thumb, written down so they can be argued with).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy import stats as sps

from qlbench.metrics import board, stats

TASK = ["arch", "backbone_init", "budget", "function"]
SPLITS = 200  # random split halves per task
SEED = 0
MIN_RELIABILITY = 0.7  # a task whose method order is less reliable than this adds mostly noise to a board
MAX_WORSE_THAN_FROZEN = 0.5  # above this share, the task measures harm done by adapting, not adaptation
MIN_HEADROOM = 1.5  # frozen's MSE at least 1.5x the best method's: there is something to adapt to


def _reliability(table: pd.DataFrame, splits: int, seed: int) -> float:
    """Spearman-Brown split-half reliability of the method order; `table` (seeds, methods) of scores, on the seeds
    every method has."""
    n = len(table)
    if n < 4 or table.shape[1] < 3:
        return math.nan
    logs = np.log(table.to_numpy(float))  # (seeds, methods); inf stays inf
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(splits):
        perm = rng.permutation(n)
        halves = [logs[perm[: n // 2]].mean(axis=0), logs[perm[n // 2 : 2 * (n // 2)]].mean(axis=0)]
        out.append(sps.spearmanr(*halves).statistic)
    if not np.isfinite(out).any():
        return math.nan
    r = float(np.nanmean(out))  # the mean half-to-half correlation, then stepped up once (a mean of stepped-up
    return max(-1.0, 2 * r / (1 + r)) if r > -1 else -1.0  # values would be dominated by splits with r near -1)


def verdict(row: dict) -> str:
    """keep / re-parameterise / drop, from one task's numbers, with the reason."""
    why = []
    if row["worse_than_frozen"] > MAX_WORSE_THAN_FROZEN:
        why.append(f"{row['worse_than_frozen']:.0%} of methods end worse than frozen")
    if not row["headroom_frozen"] >= MIN_HEADROOM:
        why.append(f"headroom over frozen {row['headroom_frozen']:.2f}x < {MIN_HEADROOM}x")
    reliable = row["reliability"] >= MIN_RELIABILITY
    if not reliable:
        r = "n/a (< 4 seeds)" if math.isnan(row["reliability"]) else f"{row['reliability']:.2f}"
        why.append(f"reliability {r} < {MIN_RELIABILITY}")
    if not why:
        return "keep"
    if reliable:  # orders methods well, but measures harm or has little to win: change its shift or budget
        return "re-parameterise: " + "; ".join(why)
    return "drop: " + "; ".join(why)


def analyse(frame: pd.DataFrame, metric: str = "test-at-best-train", splits: int = SPLITS, seed: int = SEED):
    """One row per task of `frame`: TASK columns, methods, seeds, headroom_frozen, headroom_mean, seed_noise,
    reliability, worse_than_frozen, divergence, verdict."""
    rows = []
    for key, g in frame.groupby(TASK, sort=True):
        table = board.score_table(g, metric).droplevel("function")  # (seeds, methods)
        table = table.dropna()  # the seeds every method has: each number below compares methods on the same seeds
        trained = [m for m in table.columns if m not in stats.REFERENCE]
        means = table.mean()  # inf-aware: one diverged seed makes a method's mean inf
        best = means[trained].min()
        with np.errstate(invalid="ignore", divide="ignore"):
            logs = np.log(table[trained].where(np.isfinite(table[trained])))
        row = dict(zip(TASK, key))
        row |= {
            "methods": len(trained),
            "seeds": len(table),
            "headroom_frozen": means.get("frozen", math.nan) / best,
            "headroom_mean": means.get("mean", math.nan) / best,
            "seed_noise": float(logs.std().median()),
            "reliability": _reliability(table[trained], splits, seed),
            "worse_than_frozen": float((means[trained] > means["frozen"]).mean()) if "frozen" in means else math.nan,
            "divergence": float(np.isinf(table[trained].to_numpy()).mean()),
        }
        row["verdict"] = verdict(row)
        rows.append(row)
    return pd.DataFrame(rows)
