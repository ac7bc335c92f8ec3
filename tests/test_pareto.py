"""`qlbench pareto`: the grid (axes per method, k > M skipped, alpha = 2 r), the non-dominated frontier against hand
examples, and the command end to end on a function and a suite (one record per point, resumed, table and figure)."""

import json

import numpy as np
import pandas as pd
import pytest

from qlbench import cli
from qlbench.experiments import pareto
from qlbench.records import results


def test_the_grid_is_the_papers_narrowed_by_the_user():
    assert pareto.parse_grid(None) == pareto.PAPER_GRID
    g = pareto.parse_grid("r=4,8 k=1,2")
    assert g["r"] == (4, 8) and g["k"] == (1, 2) and g["M"] == pareto.PAPER_GRID["M"]
    cases = (("q=1", "AXIS one of: r, M, k"), ("r=a", "integers"), ("r=0", ">= 1"), ("r", "AXIS="), ("k=1,1", "twice"))
    for bad, says in cases:
        with pytest.raises(ValueError, match=says):
            pareto.parse_grid(bad)


def test_points_skip_k_above_m_and_keep_the_scale():
    valid, skipped = pareto.points("queryable", pareto.parse_grid("r=4 M=2,4 k=1,4"))
    assert [p.values for p in valid] == [{"r": 4, "M": 2, "k": 1}, {"r": 4, "M": 4, "k": 1}, {"r": 4, "M": 4, "k": 4}]
    assert skipped == ["r=4 M=2 k=4 (k > M)"]
    assert valid[0].overrides == {"r": 4, "n_atoms": 2, "top_k": 1, "alpha": 8.0}
    moe, _ = pareto.points("moe-lora", pareto.parse_grid("r=2 M=3 k=2"))
    assert moe[0].overrides == {"r": 2, "n_experts": 3, "top_k": 2, "alpha": 4.0}
    lora, skipped = pareto.points("lora", pareto.parse_grid("r=4,16 M=2 k=8"))  # lora has r only
    assert [p.overrides for p in lora] == [{"r": 4, "alpha": 8.0}, {"r": 16, "alpha": 32.0}] and skipped == []
    with pytest.raises(ValueError, match="valid: queryable, instruct-queryable, moe-lora, lora"):
        pareto.points("dora", pareto.PAPER_GRID)


def test_frontier_keeps_exactly_the_non_dominated_points():
    f = pd.DataFrame(
        {
            "cost": [1.0, 2.0, 2.0, 3.0, 4.0, 0.5, 5.0],
            "mean": [5.0, 3.0, 4.0, 3.0, 1.0, 9.0, 0.5],
            "n_diverged": [0, 0, 0, 0, 0, 0, 1],
        }
    )
    # (2, 4) is dominated by (2, 3); (3, 3) by (2, 3); the diverged (5, 0.5) is never on it and dominates nothing
    assert pareto.frontier(f, "cost").tolist() == [True, True, False, False, True, True, False]
    f.loc[1, "mean"] = np.nan  # a point with no finished seed drops out: (2, 4) and (3, 3) are no longer dominated
    assert pareto.frontier(f, "cost").tolist() == [True, False, True, True, True, True, False]


def _main(*argv):
    return cli.main(list(argv))


def test_pareto_on_a_function_writes_one_record_per_point_and_resumes(tmp_path, capsys):
    argv = ["pareto", "--function", "matyas", "--methods", "queryable,lora", "--grid", "r=4 M=2 k=1,4",
            "--budget", "smoke", "--out", str(tmp_path), "--threads", "1", "--no-progress"]  # fmt: skip
    assert _main(*argv) == 0
    out, err = capsys.readouterr()
    assert "r=4 M=2 k=4 (k > M)" in err and "2 grid point(s)" in out
    records = sorted((tmp_path / "records").rglob("*.json"))
    assert len(records) == 2  # queryable r=4 M=2 k=1 and lora r=4, each its own config
    configs = [results.read_record(p)["run_info"]["config"]["method_config"] for p in records]
    assert sorted((c["r"], c.get("n_atoms", 0), c.get("top_k", 0)) for c in configs) == [(4, 0, 0), (4, 2, 1)]
    folder = tmp_path / "pareto" / "matyas-deep-narrow-smoke"
    assert {p.name for p in folder.iterdir()} >= {"pareto.md", "pareto.csv", "pareto.png", "pareto.pdf"}
    table = pd.read_csv(folder / "pareto.csv")
    assert len(table) == 2 and table["trainable_params"].tolist() != [None, None]
    # the frontier column agrees with a brute-force check of the two points
    a, b = table.to_dict("records")
    dominated = lambda p, q: (
        q["trainable_params"] <= p["trainable_params"]
        and q["mean"] <= p["mean"]
        and (q["trainable_params"] < p["trainable_params"] or q["mean"] < p["mean"])
    )
    assert [bool(r["front_params"]) for r in (a, b)] == [not dominated(a, b), not dominated(b, a)]
    mtimes = [p.stat().st_mtime_ns for p in records]
    assert _main(*argv) == 0  # resumed: nothing trains, nothing is rewritten
    assert "already have a finished record" in capsys.readouterr().err
    assert [p.stat().st_mtime_ns for p in records] == mtimes


def test_pareto_on_a_suite(tmp_path, capsys):
    argv = ["pareto", "--suite", "zoo-4", "--methods", "queryable", "--grid", "r=2 M=2 k=1",
            "--budget", "smoke", "--out", str(tmp_path), "--threads", "1", "--no-progress"]  # fmt: skip
    assert _main(*argv) == 0
    (record,) = (tmp_path / "suites").rglob("*.json")
    rec = json.loads(record.read_text())
    assert rec["run_info"]["config"]["method_config"]["n_atoms"] == 2 and "cost" in rec["train_info"]
    assert (tmp_path / "pareto" / "zoo-4-joint-deep-narrow-smoke" / "pareto.png").exists()


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--function", "matyas", "--methods", "dora"], "no Pareto grid for method 'dora'"),
        (["--function", "matyas", "--grid", "z=1"], "bad item 'z=1'"),
        (["--function", "nope"], "unknown function"),
        (["--function", "matyas", "--grid", "M=1 k=2"], "no valid point"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv, says, tmp_path, capsys):
    assert _main("pareto", *argv, "--budget", "smoke", "--out", str(tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1
