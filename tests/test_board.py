"""The leaderboard's headline with its uncertainty, the item analysis and external validity (qlbench/metrics/board.py,
items.py, validity.py), against plain numpy/scipy computations, a Monte Carlo oracle for the power, and the numbers
a reviewer measured on the zoo-v1 baselines with other code (Friedman p 0.047, Kendall's W 0.15, Nemenyi critical
difference 23.8, 11 of 946 pairs)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps
from test_stats import Div, make_frame

from qlbench import compare
from qlbench.metrics import board, items, validity
from qlbench.records import per_seed

from helpers import table_differences


def zoo(tasks: int, seeds: int, methods: dict, noise: float = 0.05, seed: int = 0) -> pd.DataFrame:
    """A frame of `tasks` functions x `seeds` seeds; each method's MSE = base_t x factor x exp(noise N(0, 1)), with
    base_t drawn per task (tasks differ in scale) and `methods` {name: factor or per-task factors}."""
    rng = np.random.default_rng(seed)
    spec = {}
    for t in range(tasks):
        base = float(np.exp(rng.normal(0, 2)))
        spec[f"f{t}"] = {
            m: [base * (f[t] if np.ndim(f) else f) * math.exp(noise * rng.normal()) for _ in range(seeds)]
            for m, f in methods.items()
        }
    return make_frame(spec)


def test_the_ratio_is_the_geometric_mean_over_finite_pairs_and_divergence_is_counted_apart():
    f = zoo(6, 5, {"lora": 1.0, "dora": 0.8, "frozen": 3.0, "mean": 4.0})
    clean = board.headline(f, resamples=200).set_index("method")
    a = f[f.method == "dora"].sort_values(["function", "seed"])["test_at_best_train"].to_numpy()
    b = f[f.method == "lora"].sort_values(["function", "seed"])["test_at_best_train"].to_numpy()
    assert math.isclose(clean.loc["dora", "ratio"], float(np.exp(np.mean(np.log(a / b)))), rel_tol=1e-12)
    assert clean.loc["dora", "divergence"] == 0 and clean.loc["dora", "finite"] == 30
    # planted: one seed of dora diverges; the ratio is over the other 29 pairs, the divergence 1 in 30
    g = f.copy()
    row = (g.method == "dora") & (g.function == "f0") & (g.seed == 0)
    g.loc[row, "status"] = "diverged"
    div = board.headline(g, resamples=200).set_index("method")
    keep = np.ones(30, bool)
    keep[0] = False
    assert math.isclose(div.loc["dora", "ratio"], float(np.exp(np.mean(np.log(a / b)[keep]))), rel_tol=1e-12)
    assert div.loc["dora", "divergence"] == pytest.approx(1 / 30) and div.loc["dora", "finite"] == 29
    assert math.isclose(clean.loc["dora", "x_frozen"], 0.8 / 3.0, rel_tol=0.1)  # against the reference rows too


def test_a_clear_winner_places_first_and_is_told_apart_and_a_twin_ties():
    rng = np.random.default_rng(1)
    twin = np.exp(rng.normal(0, 0.1, 12))  # per task: lora's twin is within 10 % either way, no consistent sign
    f = zoo(12, 5, {"lora": 1.0, "twin": twin, "better": 0.5, "frozen": 3.0, "mean": 4.0})
    b = board.headline(f, resamples=500).set_index("method")
    assert b.loc["better", "place"] == 1 and (b.loc["better", "place_low"], b.loc["better", "place_high"]) == (1, 1)
    assert b.loc["better", "told_apart"] == 2 and b.loc["better", "top"]
    assert not b.loc["twin", "top"] and "lora" in b.loc["twin", "group"]
    assert b.loc["twin", "ci_low"] < 1 < b.loc["twin", "ci_high"]
    assert b.loc["twin", "place_low"] <= b.loc["twin", "place"] <= b.loc["twin", "place_high"]


def test_separation_is_a_t_test_over_task_means_with_holm():
    f = zoo(10, 4, {"lora": 1.0, "a": 0.9, "b": 0.7}, noise=0.1, seed=3)
    sep = board.separation(f, methods=["lora", "a", "b"]).set_index(["a", "b"])
    t = board.score_table(f)
    p = []
    for x, y in [("lora", "a"), ("lora", "b"), ("a", "b")]:
        task_means = np.log(t[x] / t[y]).groupby(level="function").mean()
        p.append(sps.ttest_1samp(task_means, 0).pvalue)
    p = np.array(p)
    order = np.argsort(p)
    holm = np.maximum.accumulate(np.minimum(1, p[order] * (3 - np.arange(3))))
    want = np.empty(3)
    want[order] = holm
    got = [sep.loc[k, "p_holm"] for k in [("lora", "a"), ("lora", "b"), ("a", "b")]]
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_nemenyi_on_the_zoo_v1_baselines_gives_the_reviewers_numbers():
    f = per_seed.load(compare.baselines_file("zoo-v1"))
    n = board.nemenyi(f)
    assert (n["methods"], n["tasks"], n["pairs"], n["apart"]) == (44, 9, 946, 11)
    assert round(n["friedman_p"], 3) == 0.047 and round(n["kendall_w"], 2) == 0.15 and round(n["cd"], 1) == 23.8


def test_a_board_of_fewer_than_three_trained_methods_skips_friedman_and_says_why():
    """A board still being built (LoRA and its A/A twin beside the references): Friedman's test is not defined for
    two methods (scipy refuses), so the separation line says it was not run and why; the pairwise count stands."""
    f = zoo(6, 5, {"lora": 1.0, "twin": 1.0, "frozen": 3.0, "mean": 4.0})
    n = board.nemenyi(f)
    assert (n["methods"], n["pairs"], n["friedman_p"], n["cd"], n["apart"]) == (2, 1, None, None, None)
    line = compare.separation_line(compare.leaderboard(f), f, "test-at-best-train")
    assert "Pairs told apart: 0 of 1" in line and "not run (2 trained methods; Friedman's test needs 3)" in line
    three = board.nemenyi(zoo(6, 5, {"lora": 1.0, "twin": 1.0, "a": 0.5, "frozen": 3.0, "mean": 4.0}))
    assert three["friedman_p"] is not None and three["pairs"] == 3


def test_the_power_of_the_task_t_test_matches_a_simulation():
    rng = np.random.default_rng(0)
    n, effect, sd = 12, math.log(1.1), 0.12
    x = rng.normal(effect, sd, size=(20_000, n))
    simulated = float((sps.ttest_1samp(x, 0, axis=1).pvalue < 0.05).mean())
    assert board._power(n, effect, sd, 0.05) == pytest.approx(simulated, abs=0.015)


def test_the_power_plan_reads_task_spread_apart_from_seed_noise():
    """Methods whose ratio to LoRA varies by task (sd 0.2 in ln) with little seed noise need more tasks than methods
    with the same seed noise and no task spread; more comparisons need more tasks."""
    rng = np.random.default_rng(2)
    spread = {m: np.exp(rng.normal(0, 0.2, 16)) for m in ("a", "b", "c")}
    wide = board.power_plan(zoo(16, 5, {"lora": 1.0, **spread}, noise=0.02))
    flat = board.power_plan(zoo(16, 5, {"lora": 1.0, "a": 1.0, "b": 1.0, "c": 1.0}, noise=0.02))
    assert wide["sd_task"] == pytest.approx(0.2, abs=0.08) and flat["sd_task"] < 0.02
    assert wide["tasks"][5] > flat["tasks"][5]
    assert (
        board.power_plan(zoo(16, 5, {"lora": 1.0, **spread}, noise=0.02), comparisons=40)["tasks"][5] > wide["tasks"][5]
    )


# ----------------------------------------------------------------------------------------------------------------
# Item analysis


def one_task(methods: dict, seeds: int = 8, noise: float = 0.05, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    spec = {"f0": {m: [v * math.exp(noise * rng.normal()) for _ in range(seeds)] for m, v in methods.items()}}
    return make_frame(spec).assign(backbone_init="kaiming")


def test_a_task_that_orders_methods_by_clear_gaps_is_reliable_and_kept():
    row = items.analyse(one_task({"lora": 1.0, "a": 2.0, "b": 4.0, "c": 8.0, "frozen": 20.0, "mean": 30.0}))
    row = row.iloc[0]
    assert row["reliability"] > 0.95 and row["verdict"] == "keep"
    assert row["headroom_frozen"] == pytest.approx(20.0, rel=0.1) and row["worse_than_frozen"] == 0


def test_a_task_where_methods_are_alike_is_unreliable_and_one_where_they_harm_is_flagged():
    same = {m: 1.0 for m in ("lora", "a", "b", "c", "d", "e", "f", "g", "frozen")}
    alike = pd.concat([items.analyse(one_task(same, noise=0.3, seed=s)) for s in range(6)])
    assert abs(alike["reliability"].mean()) < 0.3 and alike["verdict"].str.startswith("drop").mean() > 0.5
    harm = items.analyse(one_task({"lora": 2.0, "a": 4.0, "b": 8.0, "c": 0.5, "frozen": 1.0}, noise=0.01)).iloc[0]
    assert harm["worse_than_frozen"] == 0.75 and harm["reliability"] > 0.95
    assert harm["verdict"].startswith("re-parameterise") and "75% of methods end worse than frozen" in harm["verdict"]


def test_split_half_reliability_is_spearman_brown_of_the_halves():
    """Oracle: with 4 seeds every split is one of 3 pairings; 2r/(1+r), r the mean over them of the Spearman of the
    halves' mean ln MSE (numpy and scipy), against the same over 200 random splits (the same 3 pairings)."""
    f = one_task({"lora": 1.0, "a": 1.1, "b": 1.3, "c": 0.9, "d": 1.2}, seeds=4, noise=0.2, seed=5)
    t = board.score_table(f).droplevel("function")[["lora", "a", "b", "c", "d"]]
    logs = np.log(t.to_numpy())
    r = []
    for first in ([0, 1], [0, 2], [0, 3]):
        second = [s for s in range(4) if s not in first]
        r.append(sps.spearmanr(logs[first].mean(0), logs[second].mean(0)).statistic)
    stepped = lambda r: 2 * r / (1 + r)
    got = items._reliability(t, splits=200, seed=0)
    assert stepped(min(r)) <= got <= stepped(max(r)) and got == pytest.approx(stepped(np.mean(r)), abs=0.1)


# ----------------------------------------------------------------------------------------------------------------
# External validity


def test_each_tuner_stands_at_its_best_configuration(tmp_path):
    ref = validity.load_reference(compare.REPOSITORY / "docs/results/validity/peft-metamathqa-design.csv")
    assert len(ref) == 20 and ref["tuner"].is_unique
    lora = ref.set_index("tuner").loc["lora"]
    assert lora["accuracy"] == 0.5133 and lora["config"] == "rank64-rslora"
    bad = tmp_path / "x.csv"
    bad.write_text("tuner,accuracy\nlora,0.5\n")
    with pytest.raises(validity.store.DamagedFile, match="lacks column"):
        validity.load_reference(bad)


def test_a_board_in_the_reference_order_correlates_plus_one_and_reversed_minus_one():
    accuracy = {"a": 0.5, "b": 0.4, "c": 0.3, "d": 0.2, "e": 0.1}
    ref = pd.DataFrame({"tuner": list(accuracy), "config": "x", "accuracy": list(accuracy.values())})
    factors = {"lora": 1.0} | {f"peft:{t}": 1 + i for i, t in enumerate(accuracy)}  # a best: lowest MSE
    f = zoo(5, 3, factors, noise=0.0)
    table = validity.correlate(f, ref, resamples=100)["table"].set_index("aggregate")
    assert table.loc["ratio_finite", "spearman"] == pytest.approx(1.0)
    assert table.loc["ratio_finite", "kendall"] == pytest.approx(1.0)
    reversed_ = {"lora": 1.0} | {f"peft:{t}": 5 - i for i, t in enumerate(accuracy)}
    table = validity.correlate(zoo(5, 3, reversed_, noise=0.0), ref, resamples=100)["table"].set_index("aggregate")
    assert table.loc["ratio_finite", "spearman"] == pytest.approx(-1.0)


def test_a_diverged_seed_ranks_last_in_the_ratio_over_every_pair():
    ref = pd.DataFrame({"tuner": ["a", "b", "c"], "config": "x", "accuracy": [0.5, 0.4, 0.3]})
    spec = {"f0": {"lora": [1, 1, 1], "peft:a": [0.5, 0.5, Div(0.5)], "peft:b": [0.8, 0.8, 0.8], "peft:c": [0.9] * 3}}
    agg = validity.aggregates(make_frame(spec))
    assert agg.loc["peft:a", "ratio_all"] == math.inf and agg.loc["peft:a", "ratio_finite"] == pytest.approx(0.5)
    table = validity.correlate(make_frame(spec), ref, resamples=50)["table"].set_index("aggregate")
    assert table.loc["ratio_all", "spearman"] == pytest.approx(-0.5)  # a last, b, c: against 0.5 > 0.4 > 0.3
    assert table.loc["ratio_finite", "spearman"] == pytest.approx(1.0)


PANEL = "frozen,mean,lora,dora,replora,peft:ia3,peft:ln_tuning,peft:miss,peft:road"  # the Makefile's ITEM_PANEL


@pytest.mark.parametrize(
    "page, sources, extra",
    [
        ("items", ["baselines/zoo-v1/per-seed.csv.gz", "zoo/per-seed.csv.gz", "paper/per-seed.csv.gz"], []),
        (  # zoo-v2's candidate tasks, on the panel every one of them ran
            "items/candidates",
            ["candidates/per-seed.csv.gz", "baselines/zoo-v1/per-seed.csv.gz"],
            ["--methods", PANEL, "--seeds", "5"],
        ),
    ],
)
def test_the_committed_item_analysis_is_rebuilt_from_the_per_seed_csvs(page, sources, extra, tmp_path, capsys):
    from qlbench import cli

    results = compare.REPOSITORY / "docs" / "results"
    cwd = Path.cwd()
    os.chdir(results)  # the page names its sources as given, relative to docs/results
    try:
        assert cli.main(["items", *sources, *extra, "--out", str(tmp_path)]) == 0
    finally:
        os.chdir(cwd)
    capsys.readouterr()
    assert (tmp_path / "items.md").read_text() == (results / page / "items.md").read_text()
    made, committed = (tmp_path / "items.csv").read_text(), (results / page / "items.csv").read_text()
    assert table_differences(made, committed, ".csv") == []
