"""Protocols, `qlbench compare` and the leaderboard (qlbench/protocols.py, qlbench/compare.py), against plain numpy and
scipy computations of the same quantities from the committed baselines."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from qlbench import cli, compare, protocols
from qlbench.metrics import board as board_metrics
from qlbench.records import per_seed

from helpers import one_line_error

ROOT = Path(__file__).resolve().parents[1]
BASELINES = compare.baselines_file("zoo-v1")


@pytest.fixture(scope="module")
def base():
    return per_seed.load(BASELINES)


def zoo_v1_config(**changes) -> dict:
    p = protocols.ZOO_V1
    config = {
        "backbone_init": "kaiming",
        "noise": "relative",
        "function": "levy",
        "arch": "deep-narrow",
        "method": "lora",
        "budget": p.budget_fields() | {"seeds": 10},
        "seeds": list(range(10)),
        "dtype": "float32",
    }
    return config | changes


def test_a_record_under_the_protocol_has_no_difference_and_each_change_is_named():
    p = protocols.ZOO_V1
    assert p.differences(zoo_v1_config()) == []
    assert p.differences(zoo_v1_config(seeds=[0, 1, 2])) == []  # a subset of the seeds is under it
    changed = {
        "arch": ("transformer", "arch 'transformer'"),
        "dtype": ("float64", "dtype 'float64'"),
        "backbone_init": ("orthogonal", "backbone init 'orthogonal'"),
        "noise": ("absolute", "label noise 'absolute'"),
        "eps": (1e-6, "eps 1e-06"),
        "function": ("rosenbrock", "function 'rosenbrock'"),
        "seeds": ([0, 11], "seeds [11] outside"),
    }
    for key, (value, phrase) in changed.items():
        diff = p.differences(zoo_v1_config(**{key: value}))
        assert len(diff) == 1 and phrase in diff[0], (key, diff)
    config = zoo_v1_config()
    del config["backbone_init"]  # a default-init record has no key
    assert "backbone init 'default'" in p.differences(config)[0]
    slower = zoo_v1_config()
    slower["budget"] = {**slower["budget"], "adapt": {**slower["budget"]["adapt"], "epochs": 500}}
    assert p.differences(slower) == ["budget 'quick' with other settings"]
    assert protocols.of_config(zoo_v1_config()) == "zoo-v1" and protocols.of_config(slower) is None


def test_the_committed_baselines_are_under_zoo_v1(base):
    assert set(base["arch"]) == {"deep-narrow"} and set(base["budget"]) == {"quick"}
    assert set(base["backbone_init"]) == {"kaiming"} and set(base["seed"]) <= set(range(10))
    assert {"lora", "frozen", "mean"} <= set(base["method"])


def test_compare_pairs_by_function_and_seed_as_scipy_does(base):
    """The across-function ratio and p of `queryable` (as "yours") against LoRA, recomputed with numpy and scipy from
    the same rows; a planted bug (seeds shuffled within each function) changes the p, so pairing is tested."""
    mine = base[base["method"] == "queryable"]
    out = compare.against(mine, base)
    row = out["across"].query("baseline == 'lora'").iloc[0]
    q = mine.set_index(["function", "seed"])["test_at_best_train"]
    lo = base[base["method"] == "lora"].set_index(["function", "seed"])["test_at_best_train"]
    r = np.log(q / lo.loc[q.index]).to_numpy()
    assert row["method"] == "queryable (yours)" and row["n"] == len(r) == 90
    assert math.isclose(row["gm_ratio"], math.exp(r.mean()), rel_tol=1e-12)
    assert math.isclose(row["p"], sps.ttest_1samp(r, 0.0).pvalue, rel_tol=1e-9)
    shuffled = mine.assign(seed=mine.groupby("function")["seed"].transform(lambda s: np.roll(s.to_numpy(), 1)))
    wrong = compare.against(shuffled, base)["across"].query("baseline == 'lora'").iloc[0]
    assert math.isclose(wrong["gm_ratio"], row["gm_ratio"], rel_tol=1e-9)  # the geometric mean ignores the pairing
    assert not math.isclose(wrong["p"], row["p"], rel_tol=1e-3)  # the paired test does not


def test_the_rank_is_the_mean_place_by_mean_mse(base):
    mine = base[base["method"] == "lora"]
    (rank,) = compare.against(mine, base)["rank"]
    means = base[~base["method"].isin(["frozen", "mean"])].groupby(["function", "method"])["test_at_best_train"].mean()
    places = [int((m < m.loc[(f, "lora")]).sum()) + 1 for f, m in means.groupby(level="function")]
    trained = base.loc[~base["method"].isin(["frozen", "mean"]), "method"].nunique()
    assert rank["of"] == trained + 1 and math.isclose(rank["mean_rank"], float(np.mean(places)))


def test_the_committed_leaderboard_is_rebuilt_from_the_baselines(base):
    bench = compare.bench_file("zoo-v1")
    made, _ = compare.leaderboard_markdown(
        base,
        protocols.ZOO_V1,
        bench=json.loads(bench.read_text()) if bench.is_file() else None,
        figure="leaderboard-forest.png",
        aa=per_seed.load(compare.aa_file("zoo-v1")),
    )
    assert (ROOT / "docs/results/leaderboard.md").read_text() == made


def test_compare_refuses_a_record_of_another_protocol_in_one_line(tmp_path, capsys):
    out = tmp_path / "results"
    argv = ["run", "--function", "matyas", "--budget", "smoke", "--backbone-init", "kaiming", "--methods", "lora"]
    assert cli.main([*argv, "--out", str(out), "--no-progress", "--threads", "1"]) == 0
    capsys.readouterr()
    (record,) = (out / "records/deep-narrow/matyas/lora").glob("*.json")
    assert "protocol" not in json.loads(record.read_text())["run_info"]["settings"]  # a smoke run is under none
    line = one_line_error(capsys, ["compare", str(out)])
    assert "was not made under zoo-v1" in line and "budget 'smoke'" in line
    line = one_line_error(capsys, ["compare", str(out), "--protocol", "zoo-v0"])
    assert "unknown protocol 'zoo-v0'; valid: zoo-v1" in line


def test_the_leaderboard_is_sorted_by_its_ratio_over_each_methods_own_finite_pairs(base):
    """A method run on fewer seeds (peft's tuners: 5 of 10) has its ratio over its own finite (function, seed) pairs,
    against a plain numpy oracle; the board is sorted by that ratio (not by a mean rank), and a diverged seed counts
    in the divergence column, not in the ratio."""
    board = compare.leaderboard(base).set_index("method")
    assert list(board["ratio"]) == sorted(board["ratio"])  # no NaN here: every method has a finite pair
    wide = base.pivot_table(index=["function", "seed"], columns="method", values="test_at_best_train")
    ok = base.pivot_table(index=["function", "seed"], columns="method", values="status", aggfunc="first") == "ok"
    for m in ("peft:pvera", "queryable", "peft:lokr"):
        both = ok[m] & ok["lora"]
        want = float(np.exp(np.mean(np.log(wide.loc[both, m] / wide.loc[both, "lora"]))))
        assert math.isclose(board.loc[m, "ratio"], want, rel_tol=1e-9), m
        runs = base[base["method"] == m]
        assert math.isclose(board.loc[m, "divergence"], float((runs["status"] == "diverged").mean())), m
    assert board.loc["peft:pvera", "divergence"] > 0 and math.isfinite(board.loc["peft:pvera", "ratio"])


def test_the_committed_validity_page_is_rebuilt_from_the_baselines(base):
    from qlbench.metrics import validity

    ref_file = ROOT / "docs/results/validity/peft-metamathqa-design.csv"
    ref = validity.load_reference(ref_file)
    page, _ = compare.validity_markdown(base, protocols.ZOO_V1, ref, ref_file.name, "test-at-best-train")
    assert (ROOT / "docs/results/validity/validity.md").read_text() == page


def test_step_times_take_the_path_each_method_trains_on():
    """µs / step: 1e6 over model-steps/s, qlbench's stacked rate, a tuner's stacked rate where it stacks and its loop's
    where it loops; the fewest members' row where there are several; other archs ignored."""
    report = {
        "throughput": [
            {"arch": "deep-narrow", "method": "lora", "members": 45, "stacked": 1000.0},
            {"arch": "deep-narrow", "method": "lora", "members": 5, "stacked": 400.0},
            {"arch": "transformer", "method": "lora", "members": 5, "stacked": 10.0},
        ],
        "members": [
            {"arch": "deep-narrow", "method": "peft:vera", "members": 5, "stacked": 200.0, "looped": 50.0},
            {"arch": "deep-narrow", "method": "peft:loha", "members": 5, "stacked": None, "looped": 25.0},
        ],
    }
    assert compare.step_times(report, "deep-narrow") == {"lora": 2500.0, "peft:vera": 5000.0, "peft:loha": 40000.0}


def test_a_method_run_on_one_function_and_seed_is_compared_on_them(base):
    """Records of one function and one seed (a user's first try): no crash on the seeds it lacks; its per-function
    row is that function alone, every mean on seed 0 (the baselines' other seeds left out), against plain pandas."""
    lora = base[(base["method"] == "lora") & (base["function"] == "matyas") & (base["seed"] == 0)]
    mine = lora.assign(method="mine", test_at_best_train=lora["test_at_best_train"] * 0.5)
    out = compare.against(mine, base)
    (row,) = out["functions"].to_dict("records")
    assert row["function"] == "matyas" and row["seeds"] == 1
    assert math.isclose(row["ratio_lora"], 0.5) and math.isclose(row["lora"], lora["test_at_best_train"].iloc[0])
    seed0 = base[(base["function"] == "matyas") & (base["seed"] == 0) & ~base["method"].isin(["frozen", "mean"])]
    place = int((seed0["test_at_best_train"] < mine["test_at_best_train"].iloc[0]).sum()) + 1
    (rank,) = out["rank"]
    assert rank["functions"] == 1 and rank["mean_rank"] == place


def test_the_short_comparison_is_against_lora_the_best_frozen_and_mean(base):
    """A method at half LoRA's MSE on every pair: x LoRA 0.5 [0.5, 0.5], a win; x frozen and x mean the geometric
    means of plain numpy over the finite pairs; one diverged seed counts in the divergence column, not in a ratio;
    and LoRA's own records, as a user's, tie with LoRA at 1."""
    lora = base[base["method"] == "lora"]
    half = lora.assign(method="half", test_at_best_train=lora["test_at_best_train"] * 0.5)
    half.loc[half.index[0], "status"] = "diverged"
    (row,) = compare.summary(half, base).to_dict("records")
    assert row["x_lora"] == pytest.approx(0.5) and row["lora_low"] == pytest.approx(0.5)
    assert row["lora_outcome"] == "win" and row["divergence"] == pytest.approx(1 / 90)
    wide = base.pivot_table(index=["function", "seed"], columns="method", values="test_at_best_train")
    finite = half.set_index(["function", "seed"])["test_at_best_train"][half["status"].to_numpy() == "ok"]
    for ref in ("frozen", "mean"):
        want = float(np.exp(np.mean(np.log(finite / wide.loc[finite.index, ref]))))
        assert row[f"x_{ref}"] == pytest.approx(want, rel=1e-9), ref
    assert row["place"] == 1 and row["of"] == 45
    (same,) = compare.summary(lora, base).to_dict("records")
    assert same["method"] == "lora (yours)" and same["x_lora"] == pytest.approx(1.0) and same["lora_outcome"] == "tie"


def test_the_a_a_rows_tie_with_lora_and_a_planted_tenth_is_found(base):
    """The committed A/A rows (LoRA as an outside method from its own random stream, and peft:lora from lora's
    start): each ties with LoRA, its ratio within 5 % of 1 and its interval containing 1. Planted: the twin 10 %
    worse on every seed is a loss, and 10 % better a win."""
    aa = per_seed.load(compare.aa_file("zoo-v1"))
    rows = compare.summary(aa, base).set_index("method")
    assert set(rows.index) == {"lora-twin", "peft:lora (yours)"}
    for m, r in rows.iterrows():
        assert r["lora_outcome"] == "tie" and abs(r["x_lora"] - 1) < 0.05 and r["lora_low"] < 1 < r["lora_high"], m
    twin = aa[aa["method"] == "lora-twin"]
    for factor, outcome in ((1.1, "loss"), (1 / 1.1, "win")):
        planted = twin.assign(test_at_best_train=twin["test_at_best_train"] * factor)
        (r,) = compare.summary(planted, base).to_dict("records")
        assert r["lora_outcome"] == outcome, (factor, r)


def test_own_lora_takes_the_ratios_to_the_lora_of_your_folder(base, tmp_path, capsys):
    """--own-lora: the twin's ratio is to the lora beside it in RESULTS (here peft:lora's records named lora, so the
    oracle differs from the committed lora's), by plain numpy over the pairs; without a lora in RESULTS, one line."""
    aa = per_seed.load(compare.aa_file("zoo-v1"))
    mine = aa.assign(method=aa["method"].replace({"peft:lora": "lora"}))
    rest, ref = compare.own_reference(mine, base)
    (row,) = compare.summary(rest, ref).to_dict("records")
    twin = mine[mine["method"] == "lora-twin"].set_index(["function", "seed"])["test_at_best_train"]
    own = mine[mine["method"] == "lora"].set_index(["function", "seed"])["test_at_best_train"]
    assert row["x_lora"] == pytest.approx(float(np.exp(np.mean(np.log(twin / own.loc[twin.index])))), rel=1e-9)
    with pytest.raises(ValueError, match="--own-lora needs lora in RESULTS"):
        compare.own_reference(aa[aa["method"] == "lora-twin"], base)


def test_zoo_v1_names_its_functions_and_each_has_its_pinned_card():
    """A published protocol's tasks are written out, not read from the cards present (a new card in functions/ must
    not join zoo-v1), and each is pinned to the card version its baselines were made from."""
    from qlbench import zoo

    p = protocols.ZOO_V1
    assert len(p.functions) == 9 and dict(p.cards).keys() == set(p.functions)
    assert all(zoo.card_digest(f) == d for f, d in p.cards)
    import importlib

    with pytest.MonkeyPatch.context() as m:  # planted: a tenth card appears in the zoo
        m.setattr(zoo, "names", lambda: [*p.functions, "rosenbrock"])
        assert importlib.reload(protocols).ZOO_V1.functions == p.functions
    importlib.reload(protocols)


def test_the_committed_zoo_v2_leaderboard_is_rebuilt_from_its_baselines_and_its_aa_pair_ties():
    """zoo-v2's baselines (one commit; the board still being built) rebuild their page and their external-validity
    page, and peft:lora (lora's scale and init, another implementation) ties with lora: a ratio near 1 whose interval
    holds 1, at the same chosen rate."""
    every = per_seed.load(compare.baselines_file("zoo-v2"))
    base = board_metrics.tune(every, protocols.ZOO_V2.lrs)[0]  # each method at its chosen rate, as compare reads it
    made, board = compare.leaderboard_markdown(base, protocols.ZOO_V2, figure="leaderboard-forest.png")
    assert (ROOT / "docs/results/leaderboard-zoo-v2/leaderboard.md").read_text() == made
    aa = board.set_index("method").loc["peft:lora"]
    assert abs(aa["ratio"] - 1) < 0.05 and aa["ci_low"] < 1 < aa["ci_high"], aa
    assert every["commit"].nunique() == 1 and not every["dirty"].any()
    from qlbench.metrics import validity

    ref_file = ROOT / "docs/results/validity/peft-metamathqa-design.csv"
    page, _ = compare.validity_markdown(
        base, protocols.ZOO_V2, validity.load_reference(ref_file), ref_file.name, "test-at-best-train"
    )
    assert (ROOT / "docs/results/validity-zoo-v2/validity.md").read_text() == page
