"""External validity: does a board's order carry over to real fine-tuning?

The reference is peft's own method comparison (Llama-3.2-3B trained on MetaMathQA, scored on GSM8K), one row per
(tuner, configuration) with its test accuracy (docs/results/validity/peft-metamathqa-design.csv: the design split,
20 tuners; the other tuners' results are kept for review and are not read here). Each tuner stands at its best
configuration (the highest accuracy among its rows), and is matched to the board's `peft:<tuner>` method.

Per aggregate (a per-method score of the board, lower = better: `aggregates`), the Spearman and Kendall (tau-b)
correlations between the board's order and the accuracies, signed so that +1 means the board puts the most accurate
tuner first; each with a 95 % percentile interval from resampling the matched tuners with replacement.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats as sps

from qlbench import adapters
from qlbench.metrics import board, stats
from qlbench.records import store

RESAMPLES = 2_000
SEED = 0
REQUIRED = ("tuner", "config", "test_accuracy")


def load_reference(path: Path) -> pd.DataFrame:
    """One row per tuner at its best configuration: tuner, config, accuracy. DamagedFile (one line) for a file that
    does not read as CSV or lacks a column."""
    try:
        f = pd.read_csv(path)
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise store.DamagedFile(f"{path} does not read as a CSV: {err}") from None
    if missing := [c for c in REQUIRED if c not in f]:
        raise store.DamagedFile(f"{path} lacks column(s) {', '.join(missing)}; needs {', '.join(REQUIRED)}")
    f = f.assign(accuracy=pd.to_numeric(f["test_accuracy"], errors="coerce")).dropna(subset=["accuracy"])
    best = f.sort_values(["tuner", "accuracy"], ascending=[True, False]).drop_duplicates("tuner")
    return best[["tuner", "config", "accuracy"]].reset_index(drop=True)


def aggregates(frame: pd.DataFrame, metric: str = "test-at-best-train") -> pd.DataFrame:
    """Per trained method of a board's per-seed frame, the candidate aggregates (lower = better):
    - mean_rank: the mean over tasks of its place by mean MSE (inf-aware) on the seeds every method has (zoo-v1's
      published sort order);
    - ratio_all: the geometric-mean ratio to LoRA over every (task, seed) pair, a diverged seed inf;
    - ratio_finite: the same over the finite pairs only (the headline's ratio, `board.headline`);
    - median_task_ratio: the median over tasks of the per-task geometric-mean ratio to LoRA (finite pairs);
    - divergence: the share of diverged seeds;
    - worse_than_frozen: the share of tasks where its mean MSE is above frozen's."""
    table = board.score_table(frame, metric)
    methods = [m for m in table.columns if m not in stats.REFERENCE]
    common = table.dropna()
    means = common.groupby(level="function").mean()  # (tasks, methods)
    with np.errstate(invalid="ignore", divide="ignore"):
        r_all = np.log(table[methods].to_numpy(float) / table[[adapters.BASELINE]].to_numpy(float))
    r_all = pd.DataFrame(r_all, index=table.index, columns=methods)
    r_fin = r_all.where(np.isfinite(r_all))
    with np.errstate(invalid="ignore"):
        ratio_all = np.exp(r_all.mean())  # +inf where a seed diverged (and LoRA's did not)
    out = pd.DataFrame(
        {
            "mean_rank": means[methods].rank(axis=1, method="average").mean(),
            "ratio_all": ratio_all,
            "ratio_finite": np.exp(r_fin.mean()),
            "median_task_ratio": np.exp(r_fin.groupby(level="function").mean().median()),
            "divergence": np.isinf(table[methods]).sum() / table[methods].notna().sum(),
            "worse_than_frozen": means[methods].gt(means["frozen"], axis=0).mean() if "frozen" in means else np.nan,
        }
    )
    out.index.name = "method"
    return out


def _signed(score: np.ndarray, accuracy: np.ndarray) -> tuple[float, float]:
    """(Spearman, Kendall tau-b) of -score with accuracy: +1 when the lowest score has the highest accuracy."""
    if len(score) < 3 or np.unique(score).size < 2 or np.unique(accuracy).size < 2:
        return math.nan, math.nan
    s = -np.where(np.isinf(score), np.finfo(float).max, score)  # inf: the worst place, as a rank sees it
    return float(sps.spearmanr(s, accuracy).statistic), float(sps.kendalltau(s, accuracy).statistic)


def correlate(
    frame: pd.DataFrame, reference: pd.DataFrame, metric: str = "test-at-best-train", resamples=RESAMPLES, seed=SEED
) -> dict:
    """{"matched": the tuners with their accuracy and every aggregate, "table": one row per aggregate (tuners,
    spearman and its interval, kendall and its interval), "unmatched": reference tuners not on the board}."""
    agg = aggregates(frame, metric)
    ref = reference.assign(method="peft:" + reference["tuner"])
    matched = ref.merge(agg, left_on="method", right_index=True, how="inner")
    unmatched = sorted(set(ref["method"]) - set(matched["method"]))
    acc = matched["accuracy"].to_numpy(float)
    rng = np.random.default_rng(seed)
    draws = rng.integers(len(matched), size=(resamples, len(matched))) if len(matched) else np.zeros((0, 0), int)
    rows = []
    for name in agg.columns:
        score = matched[name].to_numpy(float)
        rho, tau = _signed(score, acc)
        boot = np.array([_signed(score[d], acc[d]) for d in draws]).reshape(-1, 2)  # (resamples, 2)
        lo, hi = (
            np.nanquantile(boot, q, axis=0) if np.isfinite(boot).any() else [math.nan] * 2 for q in (0.025, 0.975)
        )
        rows.append(
            {
                "aggregate": name,
                "tuners": len(matched),
                "spearman": rho,
                "spearman_low": lo[0],
                "spearman_high": hi[0],
                "kendall": tau,
                "kendall_low": lo[1],
                "kendall_high": hi[1],
            }
        )
    return {"matched": matched.reset_index(drop=True), "table": pd.DataFrame(rows), "unmatched": unmatched}
