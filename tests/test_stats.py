"""qlbench.metrics.stats: diverged seeds score inf, methods are paired by seed, and every p-value and interval matches
scipy computed here independently (or by hand)."""

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from qlbench.metrics import stats, suite_stats


class Div(float):
    """A diverged seed whose metric column still holds this finite value (the best before it blew up)."""


def make_frame(spec: dict, arch: str = "deep-narrow", budget: str = "quick") -> pd.DataFrame:
    """A `results.load`-shaped frame from {function: {method: [per-seed value | Div(value) | "failed"]}}. All three
    metric columns get the value (test columns x2, so the metrics differ); a "failed" list entry makes the whole
    cell failed (status "failed", NaN metrics)."""
    rows = []
    for function, methods in spec.items():
        for method, values in methods.items():
            failed = "failed" in values
            diverged = any(isinstance(v, Div) for v in values)
            for seed, v in enumerate(values):
                status = "failed" if failed else "diverged" if isinstance(v, Div) else "ok"
                x = math.nan if failed else float(v)
                rows.append(
                    {
                        "function": function,
                        "arch": arch,
                        "method": method,
                        "budget": budget,
                        "seed": seed,
                        "cell_status": "failed" if failed else "diverged" if diverged else "ok",
                        "status": status,
                        "trainable_params": 0 if method in ("frozen", "mean") else 100,
                        "total_params": 1000,
                        "wall_time_s": 1.0,
                        "record": f"{function}/{method}.json",
                        "best_train_mse": x,
                        "best_test_mse": 2 * x,
                        "test_at_best_train": 2 * x,
                    }
                )
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------------------------------------------
# Scores and summaries


def test_a_diverged_seed_scores_inf_whatever_its_finite_value():
    f = make_frame({"f": {"lora": [1.0, Div(1e-9)], "dora": ["failed", "failed"]}})
    s = stats.scores(f, "best_train_mse")
    assert s.tolist()[:2] == [1.0, math.inf]
    assert s.iloc[2:].isna().all()  # failed = missing, not inf


def test_summary_counts_seeds_and_the_inf_aware_value():
    f = make_frame({"f": {"lora": [1.0, 3.0, Div(0.1)], "dora": [2.0, 4.0, 6.0], "hyra": ["failed"] * 3}})
    s = stats.summarize(f, "best_train_mse").set_index("method")
    assert s.loc["lora", ["n", "n_ok", "n_diverged", "n_failed"]].tolist() == [3, 2, 1, 0]
    assert s.loc["lora", "mean_ok"] == 2.0 and s.loc["lora", "std_ok"] == pytest.approx(math.sqrt(2))
    assert s.loc["lora", "value"] == math.inf
    assert s.loc["dora", "value"] == 4.0 and s.loc["dora", "std_ok"] == 2.0
    assert math.isnan(s.loc["hyra", "value"]) and s.loc["hyra", "n_failed"] == 3


def test_best_is_never_a_diverged_or_failed_cell_nor_a_reference():
    f = make_frame(
        {"f": {"lora": [1.0, 1.0], "dora": [Div(0.01), 0.01], "hyra": ["failed", "failed"], "mean": [0.5, 0.5]}}
    )
    s = stats.summarize(f, "best_train_mse")
    best = s.loc[stats.best_mask(s, lambda m: m not in stats.REFERENCE), "method"].tolist()
    assert best == ["lora"]


def test_best_static_skips_diverged_and_breaks_ties_by_order():
    f = make_frame(
        {
            "f": {"lora": [2.0, 2.0], "dora": [Div(0.1), 0.1], "hyra": [1.0, 1.0], "queryable": [0.5, 0.5]},
            "g": {"lora": [1.0, 1.0], "replora": [1.0, 1.0]},
        }
    )
    b = stats.best_static(stats.summarize(f, "best_train_mse")).set_index("function")["baseline"]
    assert b.to_dict() == {"f": "hyra", "g": "lora"}  # queryable is not static; g: tie -> STATIC order


def test_method_order_puts_full_first_and_references_last():
    assert stats.method_order(["mean", "zzz", "queryable", "lora", "frozen", "full-soap"]) == [
        "full-soap",
        "lora",
        "queryable",
        "zzz",
        "frozen",
        "mean",
    ]


def test_bad_metric_is_a_one_line_value_error():
    with pytest.raises(ValueError, match="unknown metric 'nope'; valid: best-train, best-test, test-at-best-train"):
        stats.metric_column("nope")


# ----------------------------------------------------------------------------------------------------------------
# Paired tests


def test_paired_test_matches_scipy_computed_independently():
    rng = np.random.default_rng(0)
    b = rng.uniform(1, 10, 5)
    a = b + rng.normal(-0.5, 0.3, 5)
    r = stats.paired_test(a, b)
    t = sps.ttest_rel(a, b)
    ci = t.confidence_interval(0.95)
    assert r["t_p"] == pytest.approx(t.pvalue) and r["p"] == r["t_p"]
    assert (r["ci_low"], r["ci_high"]) == pytest.approx((ci.low, ci.high))
    assert r["wilcoxon_p"] == pytest.approx(sps.wilcoxon(a, b).pvalue)
    assert r["mean_diff"] == pytest.approx(np.mean(a - b))


def test_paired_test_hand_computed():
    """d = (1, 2, 3): mean 2, sd 1, df 2. t = 2 sqrt(3); for df 2 the t CDF is 1/2 + t / (2 sqrt(t^2 + 2)), so
    p = 1 - t / sqrt(t^2 + 2) = 1 - sqrt(12/14). CI = 2 -+ t_.975,2 / sqrt(3) with t_.975,2 = 4.302653.
    Wilcoxon: all 3 signs positive, exact p = 2 / 2^3 = 0.25."""
    r = stats.paired_test([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
    assert r["mean_diff"] == 2.0
    assert r["t_p"] == pytest.approx(1 - math.sqrt(12 / 14))
    half = 4.302653 / math.sqrt(3)
    assert (r["ci_low"], r["ci_high"]) == pytest.approx((2 - half, 2 + half), abs=1e-5)
    assert r["wilcoxon_p"] == pytest.approx(0.25)
    assert r["outcome"] == "tie"  # p = 0.074


@pytest.mark.parametrize("n", [3, 4, 5, 6, 7])
def test_smallest_wilcoxon_p_is_two_over_two_to_the_n(n):
    """Every seed better: the exact two-sided p is 2 / 2^n, so < 0.05 needs 6 seeds."""
    a = np.arange(1.0, n + 1)
    r = stats.paired_test(a, a + np.arange(1.0, n + 1))  # d = -1, -2, ..., -n
    assert r["wilcoxon_p"] == pytest.approx(2 / 2**n)


def test_diverged_pairs_have_no_t_test_and_rank_highest_in_wilcoxon():
    inf = math.inf
    five = stats.paired_test([inf] * 5, [1.0, 2, 3, 4, 5])
    assert math.isnan(five["t_p"]) and math.isnan(five["ci_low"]) and five["mean_diff"] == inf
    assert five["wilcoxon_p"] == pytest.approx(2 / 2**5) and five["p"] == five["wilcoxon_p"]
    assert five["outcome"] == "tie" and five["n_div"] == 5 and five["n_div_base"] == 0
    six = stats.paired_test([inf] * 6, [1.0, 2, 3, 4, 5, 6])
    assert six["wilcoxon_p"] == pytest.approx(2 / 2**6) and six["outcome"] == "loss"
    # one diverged method seed among small improvements: its +inf difference gets the top rank
    mixed = stats.paired_test([inf, 0.5, 1.5, 2.5, 3.5], [1.0, 1.0, 2.0, 3.0, 4.0])
    assert mixed["wilcoxon_p"] == pytest.approx(sps.wilcoxon([1e300, -0.5, -0.5, -0.5, -0.5]).pvalue)


def test_both_diverged_is_a_zero_difference_and_drops_out():
    r = stats.paired_test([math.inf, 1.0, 2.0, 3.0], [math.inf, 0.0, 0.0, 0.0])
    assert r["wilcoxon_p"] == pytest.approx(0.25)  # the (1, 2, 3) case
    assert r["n"] == 4 and math.isnan(r["t_p"])


def test_outcome_direction_and_minimum_pairs():
    base = np.array([1.0, 5.0, 2.0, 8.0, 3.0])
    assert stats.paired_test(base - 0.1, base)["outcome"] == "win"  # constant shift: t p = 0
    assert stats.paired_test(base + [0.1, 0.11, 0.12, 0.1, 0.1], base)["outcome"] == "loss"
    assert stats.paired_test([1.0, 2.0], [1.1, 2.1001])["outcome"] == "tie"  # 2 pairs: never significant


def test_compare_pairs_by_seed_not_by_row_order():
    """Planted bug check: the per-seed spread dwarfs the effect, so only a by-seed pairing finds it. The frame's
    rows are shuffled; an implementation that paired by row order would get a large p."""
    base = [1.0, 50.0, 3.0, 90.0, 20.0]
    f = make_frame({"f": {"lora": base, "queryable": [v - 0.5 + 0.01 * i for i, v in enumerate(base)]}})
    shuffled = f.sample(frac=1, random_state=3).reset_index(drop=True)
    r = stats.compare(shuffled, "best-train", "lora").iloc[0]
    q = f[f.method == "queryable"].sort_values("seed")["best_train_mse"].to_numpy()
    assert r["t_p"] == pytest.approx(sps.ttest_rel(q, np.array(base)).pvalue)
    assert r["t_p"] < 1e-4 and r["outcome"] == "win"
    unpaired = sps.ttest_rel(
        shuffled.query("method == 'queryable'")["best_train_mse"], shuffled.query("method == 'lora'")["best_train_mse"]
    ).pvalue
    assert unpaired > 0.05  # what the planted bug would have reported


def test_compare_against_best_static_and_missing_baseline():
    f = make_frame({"f": {"lora": [2.0, 2.1, 2.2], "hyra": [1.0, 1.1, 1.3], "queryable": [0.9, 1.0, 1.1]}})
    c = stats.compare(f, "best-train", stats.BEST_STATIC).set_index("method")
    assert set(c.index) == {"lora", "queryable"} and (c["baseline"] == "hyra").all()
    assert c.loc["queryable", "mean_diff"] == pytest.approx(-0.1333333)
    assert stats.compare(f.query("method != 'lora'"), "best-train", "lora").empty


def test_win_tie_loss_and_sign_test():
    """Queryable wins on 5 functions, loses on 1, ties on 1: sign test p = 2 (C(6,5) + C(6,6)) / 2^6 = 0.21875."""
    base = [1.0, 5.0, 2.0, 8.0, 3.0]
    spec = {f"w{i}": {"lora": base, "queryable": [v - 0.1 for v in base]} for i in range(5)}
    spec["l"] = {"lora": base, "queryable": [v + 0.1 for v in base]}
    spec["t"] = {"lora": base, "queryable": [v + d for v, d in zip(base, [0.3, -0.3, 0.1, -0.2, 0.05])]}
    wtl = stats.win_tie_loss(stats.compare(make_frame(spec), "best-train")).iloc[0]
    assert (wtl["wins"], wtl["ties"], wtl["losses"], wtl["functions"]) == (5, 1, 1, 7)
    assert wtl["sign_p"] == pytest.approx(0.21875)
    assert wtl["sign_p"] == pytest.approx(sps.binomtest(5, 6, 0.5).pvalue)


# ----------------------------------------------------------------------------------------------------------------
# Multiplicity: Holm over one table's family


def test_holm_hand_computed_with_nan_left_out():
    """p = (0.01, 0.04, 0.03, 0.005), m = 4. Ascending: 0.005, 0.01, 0.03, 0.04 times m - j + 1 = 4, 3, 2, 1 gives
    0.02, 0.03, 0.06, 0.04; the running max makes the last 0.06. Back in input order: 0.03, 0.06, 0.06, 0.02.
    A NaN (no test) stays NaN and is not counted: (0.01, NaN, 0.02) is the m = 2 family (0.01, 0.02) ->
    (2 x 0.01, max(0.02, 1 x 0.02)) = (0.02, 0.02). Large p cap at 1: (0.9, 0.8) -> 2 x 0.8 = 1.6 -> 1, 1."""
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    adjusted = stats.holm([0.01, math.nan, 0.02])
    assert math.isnan(adjusted[1]) and adjusted[[0, 2]] == pytest.approx([0.02, 0.02])
    assert stats.holm([0.9, 0.8]).tolist() == [1.0, 1.0]
    assert stats.holm([0.04]).tolist() == [0.04] and len(stats.holm([])) == 0  # a family of one is not adjusted


def test_a_raw_win_is_a_tie_once_its_family_is_adjusted():
    """Planted bug check: a compare that decided on the raw p would call `target` a win in both frames.
    target: d = (-0.5, -0.4, -0.7), mean -8/15, variance 7/300, t^2 = 3 mean^2 / variance = 256/7 on 2 degrees of
    freedom, p = 1 - sqrt(t^2 / (t^2 + 2)) = 1 - sqrt(128/135) = 0.0263 < 0.05. Alone it is a family of one and a win;
    beside a null comparison (larger p) in the same (arch, budget) it is the smaller of m = 2 p: Holm 2 x 0.0263 =
    0.0527, a tie. The same null comparison in another arch is another table's family and changes nothing."""
    lora = [1.0, 2.0, 3.0]
    target = {"lora": lora, "queryable": [0.5, 1.6, 2.3]}
    null = {"lora": lora, "queryable": [1.1, 1.9, 3.05]}  # d = (0.1, -0.1, 0.05)
    raw = 1 - math.sqrt(128 / 135)
    alone = stats.compare(make_frame({"target": target}), "best-train").iloc[0]
    assert alone["p"] == pytest.approx(raw) and alone["p_holm"] == pytest.approx(raw) and alone["outcome"] == "win"
    family = stats.compare(make_frame({"target": target, "null": null}), "best-train").set_index("function")
    assert family.loc["target", "p"] == pytest.approx(raw) and raw < 0.05  # the raw p is kept beside the adjusted
    assert family.loc["null", "p"] > raw and family.loc["target", "p_holm"] == pytest.approx(2 * raw)
    assert family.loc["target", "outcome"] == "tie"
    assert stats.win_tie_loss(family.reset_index()).iloc[0][["wins", "ties", "losses"]].tolist() == [0, 2, 0]
    apart = pd.concat([make_frame({"target": target}), make_frame({"null": null}, arch="transformer")])
    c = stats.compare(apart, "best-train").set_index("function")
    assert c.loc["target", "p_holm"] == pytest.approx(raw) and c.loc["target", "outcome"] == "win"


def test_suite_table_decides_on_holm_over_its_rows():
    """One suite slice, LoRA's average (1, 2, 3) on 3 seeds. dora and hyra are constant shifts below it (t p = 0),
    task-code is 0.5, 0.4, 0.7 above it (raw p = 1 - sqrt(128/135) = 0.0263, as above), replora is noise (p large).
    Family of 4, ascending p: 0, 0, 0.0263, large; task-code's Holm p = max(0, 2 x 0.0263) = 0.0527: a tie, where
    its raw p alone would call it a loss. A second slice with only task-code is a family of one: a loss."""
    slice_ = dict(arch="deep-narrow", suite="zoo-4", schedule="joint", budget="quick", backbone_init="default")
    averages = {
        "lora": [1.0, 2.0, 3.0],
        "dora": [0.5, 1.5, 2.5],
        "hyra": [0.75, 1.75, 2.75],
        "task-code": [1.5, 2.4, 3.7],
        "replora": [1.1, 1.9, 3.05],
    }
    rows = [
        slice_
        | dict(method=method, seed=seed, status="ok", trainable_params=10, tasks=("a",), R=None, average=a)
        | {m: math.nan for m in suite_stats.METRICS if m != "average"}
        for method, values in averages.items()
        for seed, a in enumerate(values)
    ]
    other = [r | {"suite": "shifts-ackley"} for r in rows if r["method"] in ("lora", "task-code")]
    table = suite_stats.summary(pd.DataFrame(rows + other)).set_index(["suite", "method"])
    raw = 1 - math.sqrt(128 / 135)
    code = table.loc[("zoo-4", "task-code")]
    assert code["p"] == pytest.approx(raw) and code["p_holm"] == pytest.approx(2 * raw)
    assert code["outcome"] == "tie" and "Holm 0.053" in code["vs-lora"]
    assert table.loc[("zoo-4", "dora"), "outcome"] == "win" and table.loc[("zoo-4", "replora"), "outcome"] == "tie"
    assert table.loc[("shifts-ackley", "task-code"), "outcome"] == "loss"
    zoo = table.loc["zoo-4"].reset_index().assign(suite="zoo-4")
    assert "over the table's 4 comparisons with LoRA" in suite_stats.table_text(zoo)


def test_log_ratios_by_hand():
    f = make_frame(
        {
            "f": {"lora": [1.0, 10.0], "queryable": [10.0, 100.0], "dora": [Div(1.0), 10.0]},
            "g": {"lora": [Div(1.0), 2.0], "queryable": [Div(5.0), 0.2], "hyra": [0.3, Div(0.1)]},
        }
    )
    lr = stats.log_ratios(f, "best-train").set_index(["function", "method"])
    assert lr.loc[("f", "queryable"), "log_ratio"] == pytest.approx(1.0)  # log10(10) on both seeds
    assert lr.loc[("f", "dora"), "log_ratio"] == math.inf  # diverged where LoRA did not
    assert lr.loc[("g", "queryable"), "log_ratio"] == pytest.approx(-0.5)  # both diverged = 0; log10(0.1) = -1
    assert math.isnan(lr.loc[("g", "hyra"), "log_ratio"])  # -inf (LoRA diverged) and +inf: undefined
    assert lr.loc[("g", "hyra"), ["n", "n_div", "n_div_base"]].tolist() == [2, 1, 1]


def test_log_ratio_baseline_divergence_is_minus_inf():
    f = make_frame({"f": {"lora": [1.0, Div(1.0)], "hyra": [0.1, 1.0]}})
    assert stats.log_ratios(f, "best-train")["log_ratio"].iloc[0] == -math.inf
