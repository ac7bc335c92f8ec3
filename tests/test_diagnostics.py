"""Routing diagnostics (qlbench/diagnostics.py) against hand-computed values, routes read from the model's own
forward, the concentration comparison against scipy, and the commands: `qlbench diagnose`, `qlbench signal` and
the report's backbone-init slices and gradient section."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from scipy import stats as sps

from qlbench import cli, diagnostics, report, zoo
from qlbench.adapters import queryable
from qlbench.experiments import experiment, runner
from qlbench.settings import Execution, Protocol
from qlbench.theory import tracing

from helpers import one_line_error

pytestmark = pytest.mark.xdist_group("diagnostics")  # its module fixture trains once: its tests, one worker

LOG2, LOG4 = math.log(2), math.log(4)


def test_route_stats_on_hand_made_routes():
    """2 blocks, 4 inputs, M = 4 atoms, k = 2. Block 0: every input routes (0.5, 0.5) to atoms 0 and 1. Block 1:
    inputs 0, 1 route (0.5, 0.5) to atoms 2, 3; inputs 2, 3 route (0.75, 0.25) to atoms 0, 2."""
    alpha = torch.zeros(1, 2, 4, 4)
    alpha[0, 0, :, :2] = 0.5
    alpha[0, 1, :2, 2:] = 0.5
    alpha[0, 1, 2:, 0], alpha[0, 1, 2:, 2] = 0.75, 0.25
    s = diagnostics.route_stats(alpha)
    torch.testing.assert_close(s["usage"][0, 0], torch.tensor([0.5, 0.5, 0, 0], dtype=torch.float64))
    torch.testing.assert_close(s["usage"][0, 1], torch.tensor([0.375, 0, 0.375, 0.25], dtype=torch.float64))
    torch.testing.assert_close(s["selection"][0, 1], torch.tensor([0.5, 0, 1.0, 0.5], dtype=torch.float64))
    h_mixed = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert s["route_entropy"][0].tolist() == pytest.approx([LOG2, (2 * LOG2 + 2 * h_mixed) / 4])
    assert s["usage_entropy"][0, 0].item() == pytest.approx(LOG2)
    assert s["usage_entropy"][0, 1].item() == pytest.approx(-(2 * 0.375 * math.log(0.375) + 0.25 * math.log(0.25)))
    assert s["effective_atoms"][0, 0].item() == pytest.approx(2.0)
    # input dependence: 0 when every input has the block's mean route; block 1: TV(input, mean) is
    # |0 - .375| + |0 - 0| + |.5 - .375| + |.5 - .25| = 0.75 -> 0.375 for inputs 0, 1, and
    # |.75 - .375| + 0 + |.25 - .375| + |0 - .25| = 0.75 -> 0.375 for inputs 2, 3
    assert s["input_dependence"][0].tolist() == pytest.approx([0.0, 0.375])
    # atom 0: usage 0.5 (block 0) and 0.375 (block 1); atom 1 only block 0; atom 3 only block 1
    p = torch.tensor([0.5, 0.375]) / 0.875
    expect = [-(p * p.log()).sum().item(), 0.0, 0.0, 0.0]
    assert s["atom_block_entropy"][0].tolist() == pytest.approx(expect)
    empty = torch.zeros(1, 2, 4, 4)
    empty[..., 0] = 1.0  # only atom 0 is ever used: the others have no usage distribution
    assert torch.isnan(diagnostics.route_stats(empty)["atom_block_entropy"][0, 1:]).all()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A smoke-trained queryable cell (3 seeds) rebuilt from its record."""
    folder = tmp_path_factory.mktemp("queryable")
    plan = experiment.plan(
        functions=["levy"],
        methods=["queryable"],
        protocol=Protocol(arch="deep-narrow", seeds=3, budget="smoke"),
        execution=Execution(device="cpu", out_dir=folder),
    )
    (record,) = runner.run(plan, progress=False, log=lambda m: None)
    return diagnostics.load_cell(record)


def test_routes_come_from_the_forward_per_input(trained):
    model, data, _ = trained
    x = data.x_test[:, :50]  # (3, 50, 2)
    alpha, pred = diagnostics.capture_routes(model, x)
    B, M, k = 4, 8, model.shared[queryable.NAME].config.top_k
    assert alpha.shape == (3, B, 50, M)
    assert ((alpha > 0).sum(-1) == k).all() and torch.allclose(alpha.sum(-1), torch.ones(3, B, 50))
    torch.testing.assert_close(pred, model(x))
    chunked, _ = diagnostics.capture_routes(model, x, chunk=7)
    torch.testing.assert_close(chunked, alpha, rtol=1e-6, atol=1e-7)
    for n in (0, 13, 49):  # an input's route does not depend on the rest of the batch
        alone, _ = diagnostics.capture_routes(model, x[:, n : n + 1])
        torch.testing.assert_close(alone[:, :, 0], alpha[:, :, n], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(alpha[:, 0, 0], alpha[:, 0, 1:].mean(1))  # routes differ between inputs
    routes = tracing.trace(model, x).routes  # verify's reading of the same forward, block by block
    for b in range(B):
        torch.testing.assert_close(alpha[:, b], routes[b].alpha.detach())


def test_route_maps_cover_the_input_box(trained):
    model, _, _ = trained
    maps = diagnostics.route_maps(model, "levy", n=9)
    lo, hi = zoo.task("levy").bounds
    assert maps["grid"][0, 0].tolist() == lo.tolist() and maps["grid"][-1, -1].tolist() == hi.tolist()
    assert maps["alpha"].shape == (3, 4, 9, 9, 8) and maps["dominant"].shape == (3, 4, 9, 9)
    torch.testing.assert_close(maps["target"], zoo.task("levy").target(maps["grid"]))
    # the dominant atom at one grid point is the argmax of that point's own route
    point = maps["grid"][4, 2].to(torch.float32).expand(3, 1, 2)
    alpha, pred = diagnostics.capture_routes(model, point)
    assert maps["dominant"][:, :, 4, 2].tolist() == alpha[:, :, 0].argmax(-1).tolist()
    torch.testing.assert_close(maps["prediction"][:, 4, 2], pred[:, 0])


def test_concentration_comparison_matches_scipy():
    rows = [
        {"function": "f", "method": m, "seed": s, "concentration": v}
        for m, values in {"lora": [4.0, 5.0, 6.5], "queryable": [2.0, 3.5, 3.0]}.items()
        for s, v in enumerate(values)
    ]
    per_seed = pd.DataFrame(rows).assign(arch="a", budget="b", backbone_init="default")
    out = diagnostics.compare_concentration(per_seed).set_index("method")
    assert math.isnan(out.loc["lora", "t_p"])  # the baseline is not compared with itself
    q = out.loc["queryable"]
    assert q["t_p"] == pytest.approx(sps.ttest_rel([2.0, 3.5, 3.0], [4.0, 5.0, 6.5]).pvalue)
    assert q["mean_diff"] == pytest.approx(17 / 6 - 31 / 6) and q["mean"] == pytest.approx(17 / 6)
    assert q["outcome"] == ("win" if q["t_p"] < 0.05 else "tie")
    assert q["p_holm"] == pytest.approx(q["t_p"])  # a family of one comparison is not adjusted


def concentration_rows(budget: str, values: dict[str, dict[str, list[float]]]) -> list[dict]:
    """per-seed rows of one (arch, budget) table: {function: {method: [index per seed]}}."""
    return [
        {"arch": "a", "budget": budget, "backbone_init": "default", "function": f, "method": m, "seed": s}
        | {"concentration": v}
        for f, methods in values.items()
        for m, seeds in methods.items()
        for s, v in enumerate(seeds)
    ]


def test_concentration_outcome_is_decided_on_holm_over_the_table():
    """queryable on f is lower than LoRA on every seed: differences -0.5, -0.4, -0.7, paired t p = 0.0263 (as in
    test_suite_ablation_table_pairs_each_variant_with_the_card, sign flipped). Alone in its table (budget c) that is
    a win. In budget b the table also compares queryable with LoRA on g (differences 0.1, -0.2, 0.15, p = 0.89):
    a family of 2, Holm p = min(1, 2 x 0.0263) = 0.0525 >= 0.05, a tie, though the raw p is below 0.05. The other
    table's comparison is not in b's family, and the legend states each table's count."""
    lora, lower, null = [1.0, 2.0, 3.0], [0.5, 1.6, 2.3], [1.1, 1.8, 3.15]
    rows = concentration_rows("b", {"f": {"lora": lora, "queryable": lower}, "g": {"lora": lora, "queryable": null}})
    rows += concentration_rows("c", {"f": {"lora": lora, "queryable": lower}})
    out = diagnostics.compare_concentration(pd.DataFrame(rows)).set_index(["budget", "function", "method"])
    raw = sps.ttest_rel(lower, lora).pvalue
    alone, family = out.loc[("c", "f", "queryable")], out.loc[("b", "f", "queryable")]
    assert alone["p"] == pytest.approx(raw) and alone["p_holm"] == pytest.approx(raw) and alone["outcome"] == "win"
    assert raw < 0.05 and family["p"] == pytest.approx(raw) and family["p_holm"] == pytest.approx(2 * raw)
    assert family["outcome"] == "tie" and out.loc[("b", "g", "queryable"), "outcome"] == "tie"
    assert math.isnan(out.loc[("b", "f", "lora"), "p_holm"]) and pd.isna(out.loc[("b", "f", "lora"), "outcome"])

    table_b = out.loc["b"].reset_index().assign(budget="b")
    shown = report.concentration_table(table_b).set_index(["function", "method"])
    assert shown.loc[("f", "queryable"), ["t p", "Holm p", "result"]].tolist() == ["0.0263", "0.0525", "tie"]
    assert "Holm-adjusted over the table's 2 comparisons with LoRA" in report.concentration_legend(table_b)
    assert "Holm p < 0.05" in report.concentration_legend(table_b)
    with pytest.raises(ValueError, match="one \\(arch, budget, init\\), got 2"):
        report.concentration_legend(out.reset_index())


# --------------------------------------------------------------------------------------------------------------
# Commands on a smoke store with both backbone inits.


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    folder = tmp_path_factory.mktemp("store")
    for init in ("default", "kaiming"):
        argv = ["sweep", "--functions", "matyas", "--budget", "smoke", "--seeds", "3", "--out", str(folder)]
        argv += ["--methods", "lora,queryable,instruct-queryable,mean", "--backbone-init", init, "--no-progress"]
        assert cli.main(argv) == 0
    return folder


def test_report_has_a_slice_per_init_and_a_gradient_section(store, capsys):
    capsys.readouterr()
    assert cli.main(["report", str(store), "--out", str(store / "r"), "--format", "md"]) == 0
    out = capsys.readouterr().out
    default, kaiming = store / "r" / "deep-narrow" / "smoke", store / "r" / "deep-narrow-kaiming" / "smoke"
    for folder in (default, kaiming):
        table = (folder / "gradient-concentration.md").read_text()
        assert "| matyas   | instruct-queryable | 3 |" in table and "baseline" in table
        assert (folder / "gradient-profile.png").stat().st_size > 10_000
        assert (folder / "gradient-concentration.png").stat().st_size > 10_000
    assert "deep-narrow, kaiming init, budget smoke" in out and "older config" not in out
    assert "Gradient concentration index, deep-narrow, budget smoke" in out
    # one init only
    assert cli.main(["report", str(store), "--out", str(store / "k"), "--backbone-init", "kaiming"]) == 0
    assert not (store / "k" / "deep-narrow").exists() and (store / "k" / "deep-narrow-kaiming").exists()


def test_diagnose_writes_route_maps_and_gradient_figures(store, capsys):
    capsys.readouterr()
    argv = ["diagnose", str(store), "--function", "matyas", "--method", "instruct-queryable"]
    assert cli.main([*argv, "--backbone-init", "kaiming", "--grid", "21", "--seed", "2"]) == 0
    out = capsys.readouterr().out
    assert "instruct-queryable on matyas (deep-narrow, kaiming init, budget smoke" in out
    assert "| seed | block | route_entropy | usage_entropy | effective_atoms | input_dependence | atom 0 |" in out
    assert "### Gradient concentration (instruct-queryable, lora, queryable)" in out
    folder = store / "diagnose" / "deep-narrow-kaiming" / "smoke" / "matyas"
    for name in ("route-map", "atom-weights", "atom-usage"):
        assert (folder / f"instruct-queryable-{name}.png").stat().st_size > 10_000
    assert (folder / "gradient-profile.png").exists() and (folder / "gradient-concentration.png").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--function", "matyas", "--method", "lora"], "unknown routed method 'lora'; valid: queryable"),
        (["--function", "nosuch"], "unknown function 'nosuch'"),
        (["--function", "levy"], "no finished queryable record for levy"),
        (["--function", "matyas"], "several queryable cells for matyas"),
        (["--function", "matyas", "--backbone-init", "he"], "unknown backbone init 'he'"),
        (["--function", "matyas", "--backbone-init", "default", "--seed", "7"], "seed 7 is not in the cell"),
        (["--function", "matyas", "--backbone-init", "default", "--grid", "1"], "--grid must be between"),
    ],
)
def test_diagnose_bad_input_is_one_line(store, capsys, extra, message):
    assert message in one_line_error(capsys, ["diagnose", str(store), *extra])


def test_diagnose_needs_an_existing_folder(capsys, tmp_path):
    assert "does not exist" in one_line_error(capsys, ["diagnose", str(tmp_path / "no"), "--function", "levy"])


def test_signal_command_prints_a_table_and_writes_a_figure(capsys, tmp_path):
    argv = ["signal", "--function", "levy", "--budget", "smoke", "--seeds", "2", "--backbone-init", "default,kaiming"]
    assert cli.main([*argv, "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "| layer | default, init | default, pretrained | kaiming, init | kaiming, pretrained |" in out
    assert (tmp_path / "signal" / "deep-narrow-levy-smoke.png").stat().st_size > 10_000
    assert len(list((tmp_path / "backbones").glob("*.pt"))) == 4  # cached: 2 seeds x 2 inits
    assert "valid: paper, quick, smoke" in one_line_error(capsys, ["signal", "--function", "levy", "--budget", "x"])
