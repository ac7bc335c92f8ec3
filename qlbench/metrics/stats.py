"""Seed-level statistics for qlbench results: per-cell summaries, paired tests against a baseline, win/tie/loss
counts across functions, and paired log-ratios. Pandas/scipy on the tidy frame of `results.load`; the method groups
(full fine-tuning, static, routed, reference) come from the registry's kinds (`adapters.of_kind`).

Conventions (docs/methods.md, "Interpretations in the statistics", says the same in prose):

- **Diverged = inf.** A seed whose status is "diverged" scores +inf in every ranking, "best" mark and test, whatever
  finite value its metric column holds (that value is the best before it blew up). The paper writes "inf" for such
  runs (its threshold is MSE > 1e5; qlbench goes by the engine's status: a non-finite loss or metric, or an MSE
  above engine.DIVERGENCE_FACTOR times the larger of the member's initial MSE and its label variance).
- **Failed = missing.** A seed of a failed cell (status "failed", no metrics), or an "ok" seed whose metric is NaN,
  has no measurement: it is never best and drops out of the pairs of a paired test.
- **Paired by seed.** Within one (arch, budget, function), seed s of every method shares data and backbone, so a
  method is compared with a baseline on the differences d_s = metric(method, s) - metric(baseline, s) (negative =
  the method has the lower MSE). Both seeds diverged: d_s = 0 (both worst, a tie).
- **Tests.** Paired t-test and a 95 % t-interval of mean(d) when every pair is finite (n/a otherwise: inf has no
  mean or variance); Wilcoxon signed-rank always (ranks of |d|, inf ranks above everything; zero differences are
  dropped, scipy's "wilcox" convention; exact, by exhaustive sign flips when |d| has ties, up to 13 pairs).
  The primary p is the t-test's when defined, else Wilcoxon's. Outcome: "win" / "loss" when p < ALPHA, there
  are at least MIN_PAIRS pairs, and the method is lower / higher (sign of mean(d) for the t-test, of the
  signed-rank sums for Wilcoxon); otherwise "tie".
- **Multiplicity.** A table asks many questions at once (every function x trained method against the baseline), so
  `compare` decides on Holm-adjusted p over that family (`holm`, per (arch, budget) and metric), not on each raw p:
  a win or loss (the tables' † and win/tie/loss) needs p_holm < ALPHA. The raw p stays beside it. The reference rows
  (`frozen`, `mean`) are printed with their raw p, but they are not hypotheses and are not in the family.
  `paired_test` alone decides one comparison on its raw p; a caller that runs a family of them adjusts it.
- **Minimum seeds.** An exact two-sided Wilcoxon (or sign) test on n pairs cannot go below 2 / 2**n: 0.25 for n = 3,
  0.0625 for n = 5, 0.03125 for n = 6. With 5 seeds only the t-test can reach p < 0.05, so a comparison that
  involves a diverged seed is always a tie below 6 seeds. Fewer than MIN_PAIRS = 3 pairs is always a tie.
  (scipy >= 1.15's "auto" method; older scipy approximates when there are ties.)
- **Best static adapter** (baseline "best-static"): per (arch, budget, function), the static adapter (STATIC) with
  the lowest inf-aware mean, ties broken by STATIC order. It is chosen on the same seeds it is compared on, which
  favours the baseline: comparisons against it are conservative.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

from qlbench import adapters


@dataclass(frozen=True)
class Metric:
    """A per-seed metric: its name on the command line, its column in `results.load`'s frame, its table label."""

    name: str
    column: str
    label: str


METRICS = {
    m.name: m
    for m in (
        Metric("best-train", "best_train_mse", "best train MSE"),
        Metric("best-test", "best_test_mse", "best test MSE (test-selected)"),
        Metric("test-at-best-train", "test_at_best_train", "test MSE @ best-train epoch"),
    )
}
CELL = ["arch", "budget", "function"]  # one comparison unit: same data, backbone and protocol
FULL = adapters.of_kind("full")  # full fine-tuning: not an adapter
STATIC = adapters.of_kind("static")  # static adapters, in tie-break order
TASK = adapters.of_kind("task")  # task-conditioned adapters (multi-task suites)
ROUTED = adapters.of_kind("routed")  # routed adapters
REFERENCE = adapters.of_kind("reference")  # no training: reference rows, never ranked


def by_rate(frame: pd.DataFrame) -> pd.DataFrame:
    """A frame whose trained methods ran at several adaptation rates (a learning-rate grid) with each of those methods
    named by its rate, "lora @ lr 0.001", so that a table never averages two rates, and each reference row at one
    rate (its smallest: nothing trains, every rate scores the same); the frame as it is otherwise."""
    if "lr" not in frame or frame.empty or frame["lr"].isna().all():
        return frame
    several = frame.groupby("method")["lr"].nunique() > 1
    if not several.any():
        return frame
    reference = frame["method"].isin(REFERENCE)
    smallest = frame.groupby("method")["lr"].transform("min")
    frame = frame[~reference | (frame["lr"] == smallest)]
    renamed = frame["method"].map(several) & ~frame["method"].isin(REFERENCE)
    named = frame["method"] + " @ lr " + frame["lr"].map(lambda x: f"{x:g}")
    return frame.assign(method=named.where(renamed, frame["method"]))


ORDER = (*FULL, *STATIC, *TASK, *ROUTED, *REFERENCE)  # display order
ALPHA = 0.05
MIN_PAIRS = 3  # fewer pairs never give a win or loss (a 2-pair t-test has 1 degree of freedom)
BEST_STATIC = "best-static"


def is_full(method: str) -> bool:
    """Full fine-tuning (every backbone weight trains): not an adapter. An unregistered name (an old record's) is
    full fine-tuning when it starts with "full-", as the registered ones do."""
    kind = adapters.kind_of(method)
    return kind == "full" if kind else method.startswith("full-")


def is_adapter(method: str) -> bool:
    """A PEFT adapter: neither full fine-tuning nor a reference row."""
    return not is_full(method) and method not in REFERENCE


def method_order(methods) -> list[str]:
    """Known methods in ORDER (full fine-tuning, static, task-conditioned, routed, reference), unknown ones
    alphabetically before the reference rows, so frozen and mean always come last."""
    methods = list(dict.fromkeys(methods))
    known = [m for m in ORDER if m in methods and m not in REFERENCE]
    rest = sorted(m for m in methods if m not in ORDER)
    return known + rest + [m for m in REFERENCE if m in methods]


def metric(name: str) -> Metric:
    """The metric of a name (best-train | best-test | test-at-best-train) or of a frame column; ValueError
    otherwise."""
    for m in METRICS.values():
        if name in (m.name, m.column):
            return m
    raise ValueError(f"unknown metric {name!r}; valid: {', '.join(METRICS)}")


def metric_column(name: str) -> str:
    """The frame column of a metric name (best-train | best-test | test-at-best-train); ValueError otherwise."""
    return metric(name).column


def scores(frame: pd.DataFrame, column: str) -> pd.Series:
    """Per-seed value used by every ranking and test: the metric for an "ok" seed, +inf for a diverged seed (its
    finite column value is ignored), NaN for a failed seed or a missing value. Aligned with `frame`'s index."""
    value = frame[column].astype(float).where(frame["status"] == "ok")
    return value.mask(frame["status"] == "diverged", math.inf)


# --------------------------------------------------------------------------------------------------------------
# Per-cell summary: what a table cell shows and what ranks it.


def _summary_row(g: pd.DataFrame, column: str) -> dict:
    s = scores(g, column)  # (seeds,)
    ok = s[np.isfinite(s)]
    measured = s.dropna()  # ok + diverged seeds
    return {
        "n": len(g),  # seeds the cell has
        "n_ok": len(ok),  # seeds mean_ok / std_ok stand on
        "n_diverged": int((g["status"] == "diverged").sum()),
        "n_failed": int((g["status"] == "failed").sum()),
        "mean_ok": ok.mean() if len(ok) else math.nan,
        "std_ok": ok.std(ddof=1) if len(ok) > 1 else math.nan,
        # inf-aware mean over every measured seed: inf when any diverged, NaN when nothing was measured
        "value": measured.mean() if len(measured) else math.nan,
    }


def summarize(frame: pd.DataFrame, column: str) -> pd.DataFrame:
    """One row per (arch, budget, function, method): n, n_ok, n_diverged, n_failed, mean_ok and std_ok (sample std)
    over the finished seeds, and `value`, the inf-aware mean that rankings use."""
    keys = CELL + ["method"]
    rows = [{**dict(zip(keys, key)), **_summary_row(g, column)} for key, g in frame.groupby(keys, sort=False)]
    return pd.DataFrame(rows, columns=keys + ["n", "n_ok", "n_diverged", "n_failed", "mean_ok", "std_ok", "value"])


def best_mask(summary: pd.DataFrame, among) -> pd.Series:
    """True where a row of `summary` has the lowest finite `value` of its (arch, budget, function) among the
    methods for which `among(method)` holds (all of them on an exact tie). Diverged (inf) and failed (NaN) cells
    are never best; a cell where every candidate diverged has no best."""
    eligible = summary["method"].map(among).astype(bool) & np.isfinite(summary["value"])
    v = summary["value"].where(eligible)
    return eligible & (v == v.groupby([summary[k] for k in CELL]).transform("min"))


def best_static(summary: pd.DataFrame) -> pd.DataFrame:
    """Per (arch, budget, function) the static adapter with the lowest inf-aware mean (NaN-valued cells skipped,
    ties by STATIC order): columns arch, budget, function, baseline."""
    s = summary[summary["method"].isin(STATIC) & summary["value"].notna()].copy()
    s["rank"] = s["method"].map(STATIC.index)
    s = s.sort_values(["value", "rank"], kind="stable").drop_duplicates(CELL)
    return s[CELL + ["method"]].rename(columns={"method": "baseline"}).reset_index(drop=True)


# --------------------------------------------------------------------------------------------------------------
# Paired comparisons.


def pairs(frame: pd.DataFrame, column: str, baseline: str = adapters.BASELINE) -> pd.DataFrame:
    """One row per (arch, budget, function, method, seed) where both the method and the baseline have a measurement:
    columns CELL, method, baseline, seed, a (method score), b (baseline score); scores as `scores` (inf = diverged).
    `baseline` is a method name or "best-static" (chosen per cell by `best_static`)."""
    tidy = frame[CELL + ["method", "seed"]].assign(score=scores(frame, column)).dropna(subset=["score"])
    if baseline == BEST_STATIC:
        chosen = best_static(summarize(frame, column))
    else:
        chosen = tidy[CELL].drop_duplicates().assign(baseline=baseline)
    base = tidy.merge(chosen, on=CELL).query("method == baseline")[CELL + ["baseline", "seed", "score"]]
    out = tidy.merge(base, on=CELL + ["seed"], suffixes=("", "_b")).query("method != baseline")
    return out.rename(columns={"score": "a", "score_b": "b"})[CELL + ["method", "baseline", "seed", "a", "b"]]


def differences(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Paired differences a - b, with both-diverged pairs (inf - inf) counted as 0: equally worst."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    both = np.isinf(a) & np.isinf(b)
    return np.where(both, 0.0, a - np.where(both, 0.0, b))  # no inf - inf is ever evaluated


def _mean(d: np.ndarray) -> float:
    """Mean with inf allowed: +inf and -inf together (or no values) give NaN, without a numpy warning."""
    with np.errstate(invalid="ignore"):
        return float(d.mean()) if len(d) else math.nan


def _wilcoxon(d: np.ndarray) -> tuple[float, int]:
    """Two-sided Wilcoxon signed-rank p on the nonzero differences (inf allowed) and the direction of the signed-rank
    sums (+1: the method ranks higher = worse, -1: lower, 0: balanced or no nonzero pair)."""
    d = d[d != 0]
    if len(d) == 0:
        return math.nan, 0
    ranks = stats.rankdata(np.abs(d))
    direction = int(np.sign(ranks[d > 0].sum() - ranks[d < 0].sum()))
    return float(stats.wilcoxon(d).pvalue), direction


def paired_test(a, b, alpha: float = ALPHA) -> dict:
    """Compare paired scores a (method) and b (baseline), same seeds in the same order; inf = diverged.

    Returns n, n_div (method), n_div_base, mean_diff (inf-aware mean of a - b), ci_low/ci_high (95 % t-interval,
    finite pairs only), t_p (paired t, n/a = NaN unless all pairs are finite and n >= 2), wilcoxon_p, p (the
    primary: t_p when defined, else wilcoxon_p) and outcome win | tie | loss ("win" = significantly lower MSE;
    "tie" also when fewer than MIN_PAIRS pairs).
    """
    a, b = np.asarray(a, float), np.asarray(b, float)
    d = differences(a, b)  # (n,)
    n, finite = len(d), bool(np.isfinite(a).all() and np.isfinite(b).all())
    out = {
        "n": n,
        "n_div": int(np.isinf(a).sum()),
        "n_div_base": int(np.isinf(b).sum()),
        "mean_diff": _mean(d),
        "ci_low": math.nan,
        "ci_high": math.nan,
        "t_p": math.nan,
    }
    if finite and n >= 2:
        half = stats.t.ppf(1 - alpha / 2, n - 1) * d.std(ddof=1) / math.sqrt(n)
        with warnings.catch_warnings():  # near-constant differences: scipy warns of precision loss, p is ~0 or NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            t_p = float(stats.ttest_rel(a, b).pvalue)
        out |= {"ci_low": out["mean_diff"] - half, "ci_high": out["mean_diff"] + half, "t_p": t_p}
    out["wilcoxon_p"], direction = _wilcoxon(d)
    use_t = not math.isnan(out["t_p"])
    out["p"] = out["t_p"] if use_t else out["wilcoxon_p"]
    if use_t:
        direction = int(np.sign(out["mean_diff"]))
    significant = n >= MIN_PAIRS and out["p"] < alpha  # NaN compares False: no evidence is a tie
    out["outcome"] = ("win" if direction < 0 else "loss") if significant and direction else "tie"
    return out


def holm(pvalues) -> np.ndarray:
    """Holm (1979) step-down adjusted p-values of one family, in the input's order: with the m non-NaN p sorted
    ascending, p_(i) becomes max over j <= i of min(1, (m - j + 1) p_(j)). Rejecting where the adjusted p < alpha
    keeps the chance of any false claim in the family at most alpha, whatever the tests' dependence, and never
    rejects less than Bonferroni. NaN (no test) stays NaN and is not counted in m."""
    p = np.asarray(pvalues, float)
    out = np.full(p.shape, math.nan)
    tested = ~np.isnan(p)
    order = np.argsort(p[tested], kind="stable")  # ascending; ties keep input order and get the same value
    m = len(order)
    steps = (m - np.arange(m)) * p[tested][order]  # (m - j + 1) p_(j), j = 1..m
    adjusted = np.empty(m)
    adjusted[order] = np.minimum(1.0, np.maximum.accumulate(steps))  # monotone in p, capped at 1
    out[tested] = adjusted
    return out


def compare(frame: pd.DataFrame, metric: str, baseline: str = adapters.BASELINE) -> pd.DataFrame:
    """Every method against `baseline` (a method name or "best-static") in every (arch, budget, function): one row
    with CELL, method, baseline, the fields of `paired_test` and p_holm, its p Holm-adjusted over the family of one
    table (every (function, trained method) of the same (arch, budget)). `outcome` is decided on p_holm: a raw win or
    loss whose p_holm is not below ALPHA is a tie. The reference rows (frozen, mean) keep their raw p, but they are
    not hypotheses: p_holm NaN, outcome "reference", outside the family. Empty when the baseline is absent."""
    p = pairs(frame, metric_column(metric), baseline)
    rows = [
        {**dict(zip(CELL + ["method", "baseline"], key)), **paired_test(g["a"], g["b"])}
        for key, g in p.groupby(CELL + ["method", "baseline"], sort=False)
    ]
    cols = CELL + [
        "method",
        "baseline",
        "n",
        "n_div",
        "n_div_base",
        "mean_diff",
        "ci_low",
        "ci_high",
        "t_p",
        "wilcoxon_p",
        "p",
        "outcome",
    ]
    out = pd.DataFrame(rows, columns=cols)
    out.insert(cols.index("p") + 1, "p_holm", _holm_trained(out, ["arch", "budget"]))
    out["outcome"] = out["outcome"].where(out["p_holm"] < ALPHA, "tie")  # p_holm >= p: only fewer claims
    out.loc[out["method"].isin(REFERENCE), "outcome"] = REFERENCE_OUTCOME
    return out


REFERENCE_OUTCOME = "reference"  # a reference row's outcome: its raw p is shown, it is not a hypothesis


def _holm_trained(comparison: pd.DataFrame, family: list[str]) -> pd.Series:
    """Holm-adjusted p over each family (rows sharing the `family` columns) of the comparisons between trained
    methods; a reference row (frozen, mean: printed, not a hypothesis) gets NaN and is not counted in the family."""
    trained = ~comparison["method"].isin(REFERENCE)
    adjusted = comparison[trained].groupby(family)["p"].transform(holm)
    return adjusted.reindex(comparison.index)


def win_tie_loss(comparison: pd.DataFrame) -> pd.DataFrame:
    """Across functions, per (arch, budget, trained method): wins, ties, losses from `compare` (its outcome, decided
    on the Holm-adjusted p; reference rows are not counted) and the two-sided sign test on wins vs losses (ties
    dropped; NaN when there is no win or loss).
    With f decided functions its p cannot go below 2 / 2**f."""
    rows = []
    trained = comparison[~comparison["method"].isin(REFERENCE)]
    for (arch, budget, method), g in trained.groupby(["arch", "budget", "method"], sort=False):
        wins, ties, losses = (int((g["outcome"] == o).sum()) for o in ("win", "tie", "loss"))
        rows.append(
            {
                "arch": arch,
                "budget": budget,
                "method": method,
                "functions": len(g),
                "wins": wins,
                "ties": ties,
                "losses": losses,
                "sign_p": stats.binomtest(wins, wins + losses).pvalue if wins + losses else math.nan,
            }
        )
    return pd.DataFrame(rows, columns=["arch", "budget", "method", "functions", "wins", "ties", "losses", "sign_p"])


def log_ratios(frame: pd.DataFrame, metric: str, baseline: str = adapters.BASELINE) -> pd.DataFrame:
    """Per (arch, budget, function, method): mean over paired seeds of log10(metric_method / metric_baseline).
    A seed where only the method diverged gives +inf, only the baseline -inf, both 0; +inf and -inf together give
    NaN (undefined). Columns CELL, method, log_ratio, n, n_div, n_div_base."""
    p = pairs(frame, metric_column(metric), baseline)
    with np.errstate(divide="ignore", invalid="ignore"):
        p["r"] = np.where(np.isinf(p["a"]) & np.isinf(p["b"]), 0.0, np.log10(p["a"] / p["b"]))
        g = p.groupby(CELL + ["method"], sort=False)
        out = g.agg(
            log_ratio=("r", "mean"),
            n=("r", "size"),
            n_div=("a", lambda s: int(np.isinf(s).sum())),
            n_div_base=("b", lambda s: int(np.isinf(s).sum())),
        )  # mean(+inf, -inf) = NaN
    return out.reset_index()


# --------------------------------------------------------------------------------------------------------------
# Across functions: does a method beat the baseline on the zoo, not on one function?

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0  # the resampling's generator: the same frame always gives the same interval


def ln_ratio(a, b) -> np.ndarray:
    """r = ln(a / b) of paired scores (inf = diverged): both diverged 0, only a +inf, only b -inf."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.log(a / b)
    return np.where(np.isinf(a) & np.isinf(b), 0.0, r)


def claimed(outcome, p_holm, low, high, null: float):
    """The qlbench interpretation of a claim, wherever a test has an interval beside it: `outcome` (win / loss) stands
    where the Holm p is below ALPHA and the interval [low, high] excludes `null` (1 for a ratio, 0 for a difference),
    else "tie". Scalars or arrays (a scalar call returns a 0-d array: str() it)."""
    keep = (np.asarray(p_holm, float) < ALPHA) & ((np.asarray(low, float) > null) | (np.asarray(high, float) < null))
    return np.where(keep, outcome, "tie")


def log_ratio_pairs(frame: pd.DataFrame, column: str, baseline: str = adapters.BASELINE) -> pd.DataFrame:
    """`pairs` with r = ln(a / b) per (function, seed) (`ln_ratio`)."""
    p = pairs(frame, column, baseline)
    return p.assign(r=ln_ratio(p["a"], p["b"]))


def hierarchical_bootstrap(groups: list[np.ndarray], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED):
    """Bootstrap distribution of the mean over every value of `groups` (one array per function, its seeds' values):
    each resample draws the functions with replacement, then within each drawn function its seeds with replacement,
    so the interval carries both how much functions differ and how much seeds do. Returns (resamples,) means."""
    sizes = np.array([len(g) for g in groups])  # (F,)
    padded = np.full((len(groups), sizes.max()), np.nan)  # (F, S_max)
    for i, g in enumerate(groups):
        padded[i, : len(g)] = g
    rng = np.random.default_rng(seed)
    f = rng.integers(len(groups), size=(resamples, len(groups)))  # (B, F): the drawn functions
    n = sizes[f]  # (B, F): each drawn function's seed count
    s = (rng.random((resamples, len(groups), sizes.max())) * n[..., None]).astype(int)  # (B, F, S_max)
    drawn = padded[f[..., None], s]  # (B, F, S_max)
    keep = np.arange(sizes.max()) < n[..., None]  # a function with fewer seeds draws only that many
    with np.errstate(invalid="ignore"):  # +inf and -inf in one resample: NaN, as their mean is undefined
        return np.where(keep, drawn, 0.0).sum(axis=(1, 2)) / keep.sum(axis=(1, 2))


def across_functions(frame: pd.DataFrame, metric: str, baseline: str = adapters.BASELINE) -> pd.DataFrame:
    """Every trained method against `baseline` across the functions of each (arch, budget): one row per method.

    The question a reader asks of a zoo ("does X beat LoRA here?"), asked once per method rather than per function:
    - the pairs are every (function, seed) where both have a measurement, on r = ln(MSE_method / MSE_baseline), so
      every function weighs by its seeds whatever its scale;
    - effect: the geometric-mean ratio exp(mean r) (below 1 = lower MSE than the baseline); a diverged seed makes it
      inf (or 0 where only the baseline diverged), never hidden;
    - ci_low, ci_high: its 95 % percentile interval from `hierarchical_bootstrap` over functions and seeds;
    - p: `paired_test` of r against 0: the t-test on r (Wilcoxon signed-rank when a seed diverged);
      p_holm: Holm over the table's methods (trained methods only; frozen and mean are not hypotheses);
    - outcome: win / loss when p_holm < ALPHA and the interval excludes 1 (qlbench interpretation: the pooled test
      treats the (function, seed) pairs as exchangeable, the bootstrap does not, and a claim needs both); else tie.
    Columns: arch, budget, method, baseline, functions, n, n_div, n_div_base, gm_ratio, ci_low, ci_high, p, p_holm,
    outcome. Empty when the baseline is absent."""
    cols = ["arch", "budget", "method", "baseline", "functions", "n", "n_div", "n_div_base", "gm_ratio"]
    cols += ["ci_low", "ci_high", "p", "p_holm", "outcome"]
    p = log_ratio_pairs(frame, metric_column(metric), baseline)
    p = p[~p["method"].isin(REFERENCE)]
    rows = []
    for (arch, budget, method), g in p.groupby(["arch", "budget", "method"], sort=False):
        r = g["r"].to_numpy(float)  # (pairs,)
        test = paired_test(r, np.zeros_like(r))  # the t-test (or Wilcoxon) of the log ratios against 0
        groups = [fg["r"].to_numpy(float) for _, fg in g.groupby("function", sort=True)]
        boot = hierarchical_bootstrap(groups)
        # inverted_cdf picks resampled values (no interpolation), so an inf end stays inf; NaN: undefined resamples
        ci = (math.nan, math.nan)
        if not np.isnan(boot).any():
            ci = tuple(math.exp(q) for q in np.quantile(boot, [0.025, 0.975], method="inverted_cdf"))
        rows.append(
            {
                "arch": arch,
                "budget": budget,
                "method": method,
                "baseline": baseline,
                "functions": len(groups),
                "n": test["n"],
                "n_div": int(np.isinf(g["a"]).sum()),
                "n_div_base": int(np.isinf(g["b"]).sum()),
                "gm_ratio": math.exp(_mean(r)),
                "ci_low": ci[0],
                "ci_high": ci[1],
                "p": test["p"],
                "outcome": test["outcome"],
            }
        )
    out = pd.DataFrame(rows, columns=[c for c in cols if c != "p_holm"])
    out.insert(cols.index("p_holm"), "p_holm", out.groupby(["arch", "budget"])["p"].transform(holm))
    out["outcome"] = claimed(out["outcome"], out["p_holm"], out["ci_low"], out["ci_high"], null=1.0)
    return out
