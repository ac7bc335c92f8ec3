"""A leaderboard's headline with its uncertainty: what a reader needs to pick a method, and how sure the order is.

Input: the tidy per-seed frame of one protocol (one arch and budget; `per_seed.load` or `results.load`), scored by
`stats.scores` (inf = diverged, NaN = not run). Per trained method (`headline`):

- ratio: the geometric-mean MSE ratio to the baseline (LoRA) over the *finite* pairs, the (task, seed) pairs where
  both trained without diverging, with its 95 % hierarchical-bootstrap interval (tasks, then seeds within each task;
  `stats.hierarchical_bootstrap`). A diverged seed does not turn the ratio into inf: it is counted apart.
- divergence: the share of the method's seeds that diverged, its own column (never hidden, never averaged in).
- x frozen, x mean: the same ratio against the two reference rows (below 1: better than not adapting at all).
- place: the method's place by ratio among the trained methods, and its 95 % interval from the same bootstrap
  (one draw of tasks and seeds shared by every method, so the places of one draw are a ranking).
- group: the methods it cannot be told apart from (`separation`); "top" when it cannot be told from the first.

`separation` decides, for every pair of trained methods, whether they can be told apart: per task, the mean over
their finite common seeds of ln(MSE_a / MSE_b); a one-sample t-test of those task means against 0 (tasks are the unit
a benchmark generalises over, as in Demšar 2006); Holm over every pair. A task where the two never both stay finite
drops out of that pair. qlbench interpretation: Demšar's Nemenyi test on mean ranks (`nemenyi`) is reported beside
it for comparison; it compares places, not sizes, and rewards a method that loses by little everywhere.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
from scipy import stats as sps

from qlbench import adapters
from qlbench.metrics import stats

RESAMPLES = 2_000  # bootstrap draws for the places (every method ranked in each)
SEED = 0  # the draws' generator: one frame, one interval


def tune(frame: pd.DataFrame, grid: tuple[float, ...]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Each method at its chosen learning rate: (the frame's rows of that rate, one row per method: method, lr,
    tried, diverged, val). `grid`: the protocol's rates; () (a protocol without a grid) returns the frame as it is,
    each method at its one rate.

    qlbench interpretation of "the best rate on a validation split": per method and rate, the share of its seeds
    that diverged, then the mean over tasks of the mean ln validation MSE at the best-train epoch over the task's
    seeds that did not diverge (val_at_best_train, zoo.Task.validation_data; never the test set). The rate with the
    fewest divergences wins, then the lowest val, then the smaller rate. ValueError (one line) for a method that was
    not tried at every rate of the grid (every method gets the same trials) or a frame without validation scores."""
    lrs = frame["lr"] if "lr" in frame else pd.Series(math.nan, index=frame.index)
    if not grid:
        chosen = frame.assign(lr=lrs).groupby("method", sort=False)["lr"].first()
        info = pd.DataFrame({"method": chosen.index, "lr": chosen.to_numpy(), "tried": 1})
        return frame, info.assign(diverged=math.nan, val=math.nan)
    rows, keep = [], []
    for method, g in frame.groupby("method", sort=False):
        if missing := [x for x in grid if not np.isclose(g["lr"], x, rtol=1e-12, atol=0).any()]:
            raise ValueError(f"{method} was not tried at lr {', '.join(f'{x:g}' for x in missing)} of the grid")
        if outside := sorted(set(g["lr"]) - set(grid)):
            raise ValueError(f"{method} has records at lr {outside[0]:g}, outside the grid")
        best = None
        for lr in sorted(grid):
            at = g[g["lr"] == lr]
            diverged = float((at["status"] == "diverged").mean())
            ok = at[at["status"] == "ok"]
            if ok["val_at_best_train"].isna().any():
                raise ValueError(f"{method} at lr {lr:g} has no validation score (run it under the protocol)")
            per_task = np.log(ok["val_at_best_train"].astype(float)).groupby(ok["function"]).mean()
            val = float(per_task.mean()) if len(per_task) else math.inf
            key = (diverged, val, lr)
            if best is None or key < best:
                best = key
        rows.append({"method": method, "lr": best[2], "tried": len(grid), "diverged": best[0], "val": best[1]})
        keep.append(g[g["lr"] == best[2]])
    return pd.concat(keep), pd.DataFrame(rows)


def chosen_rates(frame: pd.DataFrame) -> dict[str, float]:
    """{method: its adaptation learning rate} of a frame at one rate per method (`tune`'s), {} without rates."""
    if "lr" not in frame or frame["lr"].isna().all():
        return {}
    return frame.groupby("method")["lr"].first().to_dict()


def score_table(frame: pd.DataFrame, metric: str = "test-at-best-train") -> pd.DataFrame:
    """(function, seed) x method table of scores: the metric for an ok seed, inf for a diverged one, NaN where the
    method did not run that seed (or failed)."""
    tidy = frame.assign(score=stats.scores(frame, stats.metric_column(metric))).dropna(subset=["score"])
    return tidy.pivot_table(index=["function", "seed"], columns="method", values="score", aggfunc="first")


def _finite_log_ratio(table: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """ln(method / baseline) per (function, seed) and method, NaN unless both are finite."""
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.log(table.to_numpy(float) / table[[baseline]].to_numpy(float))
    return pd.DataFrame(np.where(np.isfinite(r), r, np.nan), index=table.index, columns=table.columns)


def _draws(index: pd.MultiIndex, resamples: int, seed: int) -> np.ndarray:
    """(resamples, rows) weights: each draw picks the tasks with replacement, then within each drawn task its seeds
    with replacement; a row's weight is how often its (task, seed) was drawn."""
    tasks = index.get_level_values(0)
    names = list(dict.fromkeys(tasks))
    rows_of = [np.flatnonzero(tasks == t) for t in names]
    rng = np.random.default_rng(seed)
    w = np.zeros((resamples, len(index)))
    for b in range(resamples):
        for t in rng.integers(len(names), size=len(names)):
            rows = rows_of[t]
            np.add.at(w[b], rows[rng.integers(len(rows), size=len(rows))], 1.0)
    return w


def _weighted_mean(w: np.ndarray, r: np.ndarray) -> np.ndarray:
    """(draws, methods) weighted mean of r (rows, methods) over its finite rows; NaN where a draw has none."""
    have = np.isfinite(r)
    num = w @ np.where(have, r, 0.0)
    den = w @ have.astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def places(values: np.ndarray) -> np.ndarray:
    """Places (1 = lowest) of each column per row of `values` (draws, methods); NaN (no finite pair) comes last; ties
    share the lower place."""
    v = np.where(np.isnan(values), np.inf, values)
    return sps.rankdata(v, axis=1, method="min")


def separation(frame: pd.DataFrame, metric: str = "test-at-best-train", methods=None) -> pd.DataFrame:
    """Every pair of trained methods (a before b in `methods`' order): tasks (with a finite common seed), the mean
    over tasks of the per-task mean ln(a / b), the t-test's p, Holm's p over every pair, and `apart` (Holm p < 0.05)."""
    table = score_table(frame, metric)
    methods = list(methods) if methods is not None else [m for m in table.columns if m not in stats.REFERENCE]
    rows = []
    for a, b in itertools.combinations(methods, 2):
        with np.errstate(invalid="ignore", divide="ignore"):
            r = np.log(table[a] / table[b])
        task_means = r[np.isfinite(r)].groupby(level="function").mean()  # (tasks,)
        n = len(task_means)
        if n < stats.MIN_PAIRS:
            p = math.nan  # too few tasks: never apart
        elif task_means.std() > 0:
            p = float(sps.ttest_1samp(task_means, 0.0).pvalue)
        else:
            p = 1.0 if task_means.iloc[0] == 0 else 0.0  # the same ratio on every task: no spread to test
        rows.append({"a": a, "b": b, "tasks": n, "mean_log_ratio": float(task_means.mean()) if n else math.nan, "p": p})
    out = pd.DataFrame(rows, columns=["a", "b", "tasks", "mean_log_ratio", "p"])
    out["p_holm"] = stats.holm(out["p"]) if len(out) else []
    out["apart"] = out["p_holm"] < stats.ALPHA
    return out


MIN_FRIEDMAN = 3  # trained methods Friedman's test compares at the least (scipy refuses fewer)


def nemenyi(frame: pd.DataFrame, metric: str = "test-at-best-train") -> dict:
    """Demšar's (2006) Friedman test and Nemenyi critical difference on the trained methods' places per task (by
    inf-aware mean over the seeds every method has): {methods, tasks, friedman_p, kendall_w, cd, pairs, apart}.
    Friedman's test needs at least MIN_FRIEDMAN methods: with fewer (a board still being built), the test's entries
    are None."""
    table = score_table(frame, metric)
    methods = [m for m in table.columns if m not in stats.REFERENCE]
    means = table[methods].dropna().groupby(level="function").mean()  # (tasks, methods)
    ranks = means.rank(axis=1, method="average")
    k, n = len(methods), len(means)
    if k < MIN_FRIEDMAN:
        return {"methods": k, "tasks": n, "friedman_p": None, "kendall_w": None, "cd": None,
                "pairs": k * (k - 1) // 2, "apart": None}  # fmt: skip
    chi2 = sps.friedmanchisquare(*means.to_numpy().T)
    w = chi2.statistic / (n * (k - 1))
    q = sps.studentized_range.ppf(1 - stats.ALPHA, k, 1e6) / math.sqrt(2)  # df -> infinity
    cd = q * math.sqrt(k * (k + 1) / (6 * n))
    mean_rank = ranks.mean()
    apart = sum(abs(mean_rank[a] - mean_rank[b]) > cd for a, b in itertools.combinations(methods, 2))
    return {
        "methods": k,
        "tasks": n,
        "friedman_p": float(chi2.pvalue),
        "kendall_w": float(w),
        "cd": float(cd),
        "pairs": k * (k - 1) // 2,
        "apart": int(apart),
    }


def headline(
    frame: pd.DataFrame,
    metric: str = "test-at-best-train",
    baseline: str = adapters.BASELINE,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> pd.DataFrame:
    """One row per trained method, sorted by ratio (NaN last): method, seeds, runs ((task, seed) pairs it ran), finite
    (of them, pairs with the baseline where both stayed finite), divergence (share of runs diverged), ratio,
    ci_low, ci_high, x_frozen, x_mean, place, place_low, place_high, told_apart (how many methods it is told apart
    from), group (the methods it cannot be told apart from, in board order), top (cannot be told from the first)."""
    table = score_table(frame, metric)
    if baseline not in table:
        raise ValueError(f"the frame has no {baseline!r} rows to take ratios to")
    methods = [m for m in table.columns if m not in stats.REFERENCE]
    r = _finite_log_ratio(table, baseline)[methods]
    w = _draws(table.index, resamples, seed)
    boot = _weighted_mean(w, r.to_numpy())  # (draws, methods)
    point = r.mean().to_numpy()  # (methods,): every finite pair weighs alike, as in a draw of weight 1 each
    drawn_places = places(boot)
    point_places = places(point[None, :])[0]
    rows = []
    for i, m in enumerate(methods):
        seeds = table[m].notna()
        with np.errstate(invalid="ignore"):
            lo, hi = np.nanquantile(boot[:, i], [0.025, 0.975]) if np.isfinite(boot[:, i]).any() else (np.nan,) * 2
        ref = {}
        for name in stats.REFERENCE:
            ref[name] = math.exp(_finite_log_ratio(table, name)[m].mean()) if name in table else math.nan
        rows.append(
            {
                "method": m,
                "seeds": int(table.index[seeds].get_level_values("seed").nunique()),
                "runs": int(seeds.sum()),
                "finite": int(r[m].notna().sum()),
                "divergence": float(np.isinf(table.loc[seeds, m]).mean()),
                "ratio": math.exp(point[i]) if np.isfinite(point[i]) else math.nan,
                "ci_low": math.exp(lo),
                "ci_high": math.exp(hi),
                "x_frozen": ref.get("frozen", math.nan),
                "x_mean": ref.get("mean", math.nan),
                "place": int(point_places[i]),
                "place_low": int(np.quantile(drawn_places[:, i], 0.025, method="inverted_cdf")),
                "place_high": int(np.quantile(drawn_places[:, i], 0.975, method="inverted_cdf")),
            }
        )
    board = pd.DataFrame(rows).sort_values(["ratio", "method"], na_position="last", kind="stable")
    board = board.reset_index(drop=True)
    sep = separation(frame, metric, board["method"])
    apart = {(a, b) for a, b, x in sep[["a", "b", "apart"]].itertuples(index=False) if x}
    apart |= {(b, a) for a, b in apart}
    order = board["method"].tolist()
    board["told_apart"] = [sum((m, o) in apart for o in order) for m in order]
    board["group"] = [[o for o in order if o != m and (m, o) not in apart] for m in order]
    board["top"] = [m == order[0] or (m, order[0]) not in apart for m in order]
    return board


def _power(n: int, effect: float, sd: float, alpha: float) -> float:
    """Power of a two-sided one-sample t-test on n task means of spread sd, for a true mean of `effect`."""
    if sd == 0:
        return 1.0
    df, nc = n - 1, effect / (sd / math.sqrt(n))
    t = sps.t.ppf(1 - alpha / 2, df)
    power = float(sps.nct.sf(t, df, nc) + sps.nct.cdf(-t, df, nc))
    return power if math.isfinite(power) else 1.0  # scipy's noncentral t gives NaN far out in its tail


def power_plan(
    frame: pd.DataFrame,
    metric: str = "test-at-best-train",
    baseline: str = adapters.BASELINE,
    effect: float = 1.1,
    power: float = 0.8,
    comparisons: int = 1,
    seeds=(5, 10, 20),
    most_tasks: int = 500,
) -> dict:
    """How many tasks (and seeds per task) a board needs to see a ratio of `effect` to `baseline` across tasks with
    `power`, by the test `separation` makes (a t-test over tasks of per-task mean log ratios; alpha 0.05 over
    `comparisons`, Bonferroni, as Holm's first step). The spread of a task mean is taken from `frame`: sd_task, the
    median over methods of the between-task standard deviation of the true per-task log ratio (the spread of the task
    means less their seed noise), and sd_seed, the median within-task standard deviation over seeds (finite pairs).
    Returns {sd_task, sd_seed, effect, power, alpha, tasks: {seeds: tasks needed, or None past most_tasks}}."""
    table = score_table(frame, metric)
    methods = [m for m in table.columns if m not in stats.REFERENCE and m != baseline]
    r = _finite_log_ratio(table, baseline)[methods]
    by_task = r.groupby(level="function")
    within = by_task.std().median()  # (methods,) -> per method median over tasks
    n_seeds = by_task.count().replace(0, np.nan)
    observed = by_task.mean().var()  # (methods,) variance of task means = true spread + seed noise
    noise = (by_task.var() / n_seeds).mean()  # (methods,) the seed noise part of a task mean's variance
    sd_task = float(np.sqrt((observed - noise).clip(lower=0)).median())
    sd_seed = float(within.median())
    alpha = stats.ALPHA / comparisons
    delta = math.log(effect)
    need = {}
    for s in seeds:
        sd = math.sqrt(sd_task**2 + sd_seed**2 / s)
        need[s] = next((n for n in range(3, most_tasks + 1) if _power(n, delta, sd, alpha) >= power), None)
    return {"sd_task": sd_task, "sd_seed": sd_seed, "effect": effect, "power": power, "alpha": alpha, "tasks": need}
