"""What protocol zoo-v2 is built from: task variants with a scaled shift (zoo.split_name), the targets' validation sets
(zoo.Task.validation_data, --validation), a run at another adaptation rate (--lr) and the choice of a rate per method
on validation, never on test (metrics/board.py, tune). Oracles: a variant's coefficients computed here from the card's
TOML, the validation MSE of an untrained backbone computed here, and a frame whose test and validation orders differ."""

from __future__ import annotations

import math
from importlib.resources import files

import numpy as np
import pandas as pd
import pytest
import torch

from qlbench import engine, protocols, zoo
from qlbench.cli import main
from qlbench.engine.stack import StackedData
from qlbench.metrics import board
from qlbench.records import per_seed, results
from qlbench.records.store import Store
from qlbench.settings import Protocol

from helpers import one_line_error

# ---------------------------------------------------------------------------------------------------------------
# Task variants


def _card_toml(name: str) -> dict:
    return zoo.tomllib.loads((files("qlbench.functions") / f"{name}.toml").read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", ["dropwave", "langermann", "rastrigin"])
@pytest.mark.parametrize("s", [0.5, 2.0, 3.0])
def test_a_variant_moves_each_changed_coefficient_and_the_rotation_s_times_as_far(name, s):
    d = _card_toml(name)
    task = zoo.task(f"{name}@s{s:g}")
    for k, target in d["target"]["coefficients"].items():
        source = np.asarray(d["coefficients"][k], float)
        want = source + s * (np.asarray(target, float) - source)
        assert np.allclose(np.asarray(task.target.function.coefficients[k], float), want, rtol=0, atol=1e-12), k
    assert task.target.rotation_deg == pytest.approx(s * d["target"]["rotation_deg"])
    assert task.target.out_scale == pytest.approx(1 + s * (d["target"]["out_scale"] - 1))
    assert task.source.coefficients == zoo.task(name).source.coefficients


def test_a_variant_shares_its_cards_source_data_and_draws_its_own_target():
    card, variant = zoo.task("ackley"), zoo.task("ackley@s2")
    for a, b in zip(card.source_data(3), variant.source_data(3)):
        assert torch.equal(a, b)
    assert not torch.equal(card.target_data(3).x_train, variant.target_data(3).x_train)
    assert zoo.card_digest("ackley@s2") == zoo.card_digest("ackley")
    assert zoo.task("ackley@s2").target_data(3).y_test.equal(zoo.task("ackley@s2").target_data(3).y_test)


@pytest.mark.parametrize(
    "bad, phrase",
    [
        ("ackley@", "a variant is ackley@s<strength>"),
        ("ackley@s0", "0 < strength"),
        ("ackley@x2", "a variant is"),
        ("ackley@s11", "strength <= 10"),
        ("ackley@s1", "the card's own task; name it 'ackley'"),
        ("nope@s2", "unknown function 'nope'"),
    ],
)
def test_a_malformed_variant_is_one_line_naming_the_form(bad, phrase):
    with pytest.raises(ValueError, match=None) as err:
        zoo.task(bad)
    assert phrase in str(err.value) and "\n" not in str(err.value)


def test_a_malformed_variant_on_the_command_line_is_exit_2_before_any_work(tmp_path, capsys):
    line = one_line_error(capsys, ["run", "--function", "ackley@s0", "--out", str(tmp_path), "--budget", "smoke"])
    assert "ackley@s<strength>" in line
    assert not (tmp_path / "backbones").exists()


def test_a_variant_runs_on_its_cards_cached_backbones(tmp_path):
    store = Store(tmp_path)
    spec = engine.Backbones("deep-narrow", engine.budget("smoke", "deep-narrow").pretrain)
    card = engine.pretrain(spec, [("matyas", 0), ("matyas", 1)], device="cpu", store=store)
    assert not spec.needed([("matyas@s2", 0), ("matyas@s3", 1)], store)  # nothing to pretrain: the card's are there
    variant = engine.pretrain(spec, [("matyas@s2", 0), ("matyas@s3", 1)], device="cpu", store=store)
    for k, v in card.state.items():
        assert torch.equal(v, variant.state[k]), k


# ---------------------------------------------------------------------------------------------------------------
# Validation sets


def test_the_validation_set_is_its_own_draw_beside_train_and_test():
    t = zoo.task("levy")
    x_val, y_val = t.validation_data(0, dtype=torch.float64)
    split = t.target_data(0, dtype=torch.float64)
    assert x_val.shape == (zoo.VALIDATION_SIZE, 2)
    seen = torch.cat([split.x_train, split.x_test])
    assert not (x_val[:, None, :] == seen[None, :, :]).all(-1).any()  # no point shared with train or test
    # the labels are the target plus noise of the target's size: the clean residual has the noise's spread
    assert (y_val - t.target(x_val)).std().item() == pytest.approx(t.noise_std("target"), rel=0.15)


def _sweep(tmp_path, *extra) -> pd.DataFrame:
    out = tmp_path / "-".join(extra).replace("-", "") if extra else tmp_path / "plain"
    argv = ["sweep", "--functions", "matyas,ackley@s2", "--methods", "lora,frozen", "--budget", "smoke", "--seeds", "2"]
    assert main([*argv, "--out", str(out), "--no-progress", *extra]) == 0
    return results.load(out).sort_values(["function", "method", "seed"]).reset_index(drop=True)


def test_validation_scores_without_changing_a_number_of_training(tmp_path):
    plain, validated = _sweep(tmp_path), _sweep(tmp_path, "--validation")
    assert plain["val_at_best_train"].isna().all() and validated["val_at_best_train"].notna().all()
    for col in ("best_train_mse", "test_at_best_train", "best_test_mse"):
        assert np.array_equal(plain[col].to_numpy(), validated[col].to_numpy()), col
    assert (plain["config_hash"] != validated["config_hash"]).all()  # another config: another record
    # the frozen row's validation MSE is its backbone's on the validation set, computed here
    frozen = validated[(validated["method"] == "frozen") & (validated["function"] == "ackley@s2")]
    spec = engine.Backbones("deep-narrow", engine.budget("smoke", "deep-narrow").pretrain)
    members = [("ackley@s2", 0), ("ackley@s2", 1)]
    pre = engine.pretrain(spec, members, device="cpu", store=Store(tmp_path / "validation"))
    model = pre.model(device="cpu", dtype=torch.float32)
    data = StackedData.build(members, "target", device="cpu", dtype=torch.float32, validation=True)
    with torch.no_grad():
        want = (model(data.x_val) - data.y_val).pow(2).mean(1)  # (E,)
    assert np.allclose(frozen["val_at_best_train"].to_numpy(), want.numpy(), rtol=1e-6)


def test_a_validation_runs_per_seed_csv_keeps_its_scores_and_rate(tmp_path):
    frame = _sweep(tmp_path, "--validation", "--lr", "0.001")
    path = per_seed.write(frame, tmp_path / "p.csv")
    back = per_seed.load(path)
    assert np.allclose(back["val_at_best_train"], frame["val_at_best_train"])
    assert (back["lr"] == 0.001).all()
    committed = per_seed.load("docs/results/baselines/zoo-v1/per-seed.csv.gz")
    assert committed["lr"].isna().all() and committed["val_at_best_train"].isna().all()


# ---------------------------------------------------------------------------------------------------------------
# Another adaptation rate


def test_lr_replaces_the_budgets_adaptation_rate_only():
    base, fast = Protocol(budget="quick"), Protocol(budget="quick", lr=2e-3)
    assert fast.schedule.adapt.lr == 2e-3
    assert fast.schedule.pretrain == base.schedule.pretrain
    assert fast.schedule.adapt.epochs == base.schedule.adapt.epochs and fast.schedule.name == base.schedule.name


@pytest.mark.parametrize("bad", [0.0, -1e-3, 5.0, True, "fast"])
def test_a_bad_lr_is_refused(bad):
    with pytest.raises(ValueError, match="lr must be a number in"):
        Protocol(lr=bad)


def test_an_lr_run_trains_at_that_rate(tmp_path):
    plain, fast = _sweep(tmp_path), _sweep(tmp_path, "--lr", "0.003")
    lora = lambda f: f[f["method"] == "lora"]
    assert (lora(fast)["lr"] == 0.003).all() and (lora(plain)["lr"] == 5e-4).all()
    assert not np.array_equal(lora(plain)["best_train_mse"].to_numpy(), lora(fast)["best_train_mse"].to_numpy())


@pytest.mark.parametrize(
    "argv, phrase",
    [
        (["--protocol", "zoo-v1", "--lr", "0.001"], "--lr contradicts protocol zoo-v1"),
        (["--protocol", "zoo-v1", "--validation"], "--validation"),
        (["--protocol", "zoo-v2", "--lr", "0.0007"], "is not in protocol zoo-v2's grid"),
        (["--lr", "0"], "lr must be a number in (0, 1]"),
    ],
)
def test_a_rate_a_protocol_does_not_allow_is_exit_2(argv, phrase, tmp_path, capsys):
    line = one_line_error(
        capsys, ["sweep", "--functions", "matyas", "--methods", "lora", *argv, "--out", str(tmp_path)]
    )
    assert phrase in line


# ---------------------------------------------------------------------------------------------------------------
# Choosing the rate


def _grid_frame(val: dict, test: dict, diverged: dict | None = None) -> pd.DataFrame:
    """One method over 3 tasks x 4 seeds at each rate: val / test MSE = the rate's value x the task's scale."""
    rows = []
    for lr in val:
        for t, scale in enumerate((1.0, 10.0, 100.0)):
            for seed in range(4):
                bad = seed < (diverged or {}).get(lr, 0)
                rows.append(
                    dict(method="m", function=f"f{t}", seed=seed, lr=lr, status="diverged" if bad else "ok",
                         val_at_best_train=math.nan if bad else val[lr] * scale,
                         test_at_best_train=math.inf if bad else test[lr] * scale)
                )  # fmt: skip
    return pd.DataFrame(rows)


def test_the_rate_is_chosen_on_validation_never_on_test():
    grid = (1e-3, 2e-3, 4e-3)
    frame = _grid_frame({1e-3: 1.0, 2e-3: 0.5, 4e-3: 0.8}, {1e-3: 0.2, 2e-3: 0.9, 4e-3: 0.9})
    at, chosen = board.tune(frame, grid)
    assert chosen.set_index("method").loc["m", "lr"] == 2e-3  # best validation, though the worst test
    assert (at["lr"] == 2e-3).all() and len(at) == 12
    assert chosen.loc[0, "tried"] == 3


def test_fewer_divergences_win_over_a_lower_validation_mse():
    grid = (1e-3, 2e-3)
    frame = _grid_frame({1e-3: 1.0, 2e-3: 0.1}, {1e-3: 1.0, 2e-3: 0.1}, diverged={2e-3: 1})
    assert board.tune(frame, grid)[1].loc[0, "lr"] == 1e-3


def test_a_method_missing_a_rate_of_the_grid_is_refused():
    frame = _grid_frame({1e-3: 1.0, 2e-3: 0.5}, {1e-3: 1.0, 2e-3: 0.5})
    with pytest.raises(ValueError, match="m was not tried at lr 0.004 of the grid"):
        board.tune(frame, (1e-3, 2e-3, 4e-3))
    with pytest.raises(ValueError, match="outside the grid"):
        board.tune(frame, (1e-3,))


def test_without_a_grid_the_frame_is_as_it_is():
    frame = _grid_frame({5e-4: 1.0}, {5e-4: 1.0})
    at, chosen = board.tune(frame, ())
    assert at is frame and chosen.loc[0, "lr"] == 5e-4


def test_a_record_at_a_rate_of_the_grid_is_under_zoo_v2_and_one_off_it_is_not(tmp_path):
    v2 = protocols.get("zoo-v2")
    config = {
        "function": v2.functions[0],
        "arch": v2.arch,
        "backbone_init": v2.backbone_init,
        "noise": v2.noise,
        "dtype": v2.dtype,
        "seeds": list(v2.seeds),
        "validation": True,
        "budget": v2.budget_fields() | {"seeds": len(v2.seeds)},
    }
    for lr in v2.lrs:
        at = config | {"budget": config["budget"] | {"adapt": config["budget"]["adapt"] | {"lr": lr}}}
        assert v2.differences(at) == [], lr
    off = config | {"budget": config["budget"] | {"adapt": config["budget"]["adapt"] | {"lr": 7e-4}}}
    assert v2.differences(off) and protocols.of_config(off) is None
    assert v2.differences(config | {"validation": False}) == ["no validation set"]


# ---------------------------------------------------------------------------------------------------------------
# A grid on the pages: the leaderboard's chosen rate, a report per rate, the export of every config


def _grid_baselines(tmp_path) -> str:
    """A zoo-v2-shaped per-seed CSV: 4 methods x 6 tasks x 5 seeds at each rate of zoo-v2's grid; at 1e-3 dora's
    validation is its best, at 1.5e-4 its test is (the page must show 1.5e-3 and its test MSEs)."""
    rng = np.random.default_rng(0)
    v2, rows = protocols.get("zoo-v2"), []
    factor = {"lora": 1.0, "dora": 0.7, "hyra": 1.3, "frozen": 5.0, "mean": 8.0}
    for t, function in enumerate(v2.functions):
        for method, f in factor.items():
            for lr in v2.lrs:
                good = method == "dora" and lr == 1.5e-3
                for seed in range(5):
                    test = f * (0.5 if method == "dora" and lr == 1.5e-4 else 1.0) * math.exp(0.05 * rng.normal())
                    rows.append(
                        dict(arch="deep-narrow", budget="quick", backbone_init="kaiming", function=function,
                             method=method, seed=seed, status="ok", cell_status="ok", lr=lr,
                             val_at_best_train=(0.3 if good else 1.0) * f * (t + 1), best_train_mse=test,
                             best_test_mse=test, test_at_best_train=test * (t + 1),
                             trainable_params=0 if method in ("frozen", "mean") else 100, total_params=1000,
                             wall_time_s=1.0, record=f"records/{function}/{method}/{lr}.json", commit="a" * 40,
                             dirty=False)
                    )  # fmt: skip
    path = tmp_path / "zoo-v2.csv.gz"
    per_seed.write(pd.DataFrame(rows), path)
    return str(path)


def test_the_leaderboard_under_a_grid_shows_each_methods_rate_and_its_records_at_it(tmp_path, capsys):
    baselines = _grid_baselines(tmp_path)
    assert main(["compare", "--protocol", "zoo-v2", "--leaderboard", "--baselines", baselines]) == 0
    page = capsys.readouterr().out
    head = next(line for line in page.splitlines() if line.startswith("| place"))
    dora = next(line for line in page.splitlines() if "| dora " in line)
    cells = dict(zip([c.strip() for c in head.split("|")], [c.strip() for c in dora.split("|")]))
    assert cells["lr"] == "0.0015"  # chosen on validation (its test is best at 0.00015)
    assert 0.65 < float(cells["× LoRA"]) < 0.75  # its records at 0.0015, not the 0.35 of 0.00015
    assert "grid 0.00015, 0.0005, 0.0015, 0.005" in page


def test_a_grid_without_a_rate_for_a_method_is_one_line(tmp_path, capsys):
    frame = per_seed.load(_grid_baselines(tmp_path))
    path = tmp_path / "gap.csv.gz"
    per_seed.write(frame[~((frame["method"] == "dora") & (frame["lr"] == 5e-3))], path)
    argv = ["compare", "--protocol", "zoo-v2", "--leaderboard", "--baselines", str(path)]
    assert "dora was not tried at lr 0.005 of the grid" in one_line_error(capsys, argv)


def test_a_report_of_a_grid_shows_each_rate_and_keeps_the_names_in_its_csv(tmp_path, capsys):
    baselines = _grid_baselines(tmp_path)
    assert main(["report", baselines, "--format", "md,csv", "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "dora @ lr 0.0015" in md and "lora @ lr 0.00015" in md
    again = per_seed.load(tmp_path / "rep" / per_seed.FILE)
    assert set(again["method"]) == {"lora", "dora", "hyra", "frozen", "mean"} and again["lr"].nunique() == 4


def test_results_per_seed_exports_every_config_of_a_folder(tmp_path, capsys):
    _sweep(tmp_path, "--validation")
    _sweep(tmp_path, "--validation", "--lr", "0.001")  # a second folder; merge both into one to export
    assert main(["results", str(tmp_path / "validation"), "--per-seed", str(tmp_path / "a.csv.gz")]) == 0
    frame = per_seed.load(tmp_path / "a.csv.gz")
    assert len(frame) == 8 and frame["val_at_best_train"].notna().all() and (frame["lr"] == 5e-4).all()
    assert "name a .csv" in one_line_error(capsys, ["results", str(tmp_path), "--per-seed", str(tmp_path / "a.txt")])


def test_items_on_a_panel_uses_only_its_methods_and_seeds(tmp_path, capsys):
    frame = per_seed.load(_grid_baselines(tmp_path))
    one = per_seed.write(frame[frame["lr"] == 5e-4].drop(columns=["lr", "val_at_best_train"]), tmp_path / "one.csv")
    assert main(["items", str(one), "--methods", "lora,dora,frozen,mean", "--seeds", "4"]) == 0
    page = capsys.readouterr().out
    assert "Methods: the panel lora, dora, frozen, mean, seeds 0-3." in page
    head = next(line for line in page.splitlines() if line.startswith("| arch"))
    row = next(line for line in page.splitlines() if "| ackley " in line)
    cells = dict(zip([c.strip() for c in head.split("|")], [c.strip() for c in row.split("|")]))
    assert (cells["methods"], cells["seeds"]) == ("2", "4")  # the trained ones of the panel
    assert "nope is in no CSV" in one_line_error(capsys, ["items", str(one), "--methods", "lora,nope"])
    assert main(["items", _grid_baselines(tmp_path)]) == 0  # a grid: each rate its own method
    page = capsys.readouterr().out
    row = next(line for line in page.splitlines() if "| ackley " in line)
    assert dict(zip([c.strip() for c in head.split("|")], [c.strip() for c in row.split("|")]))["methods"] == "12"


def test_a_variant_record_holds_its_cards_version_and_zoo_v2_checks_it(tmp_path):
    argv = ["sweep", "--functions", "matyas@s2", "--methods", "frozen", "--budget", "smoke", "--seeds", "2"]
    assert main([*argv, "--out", str(tmp_path), "--no-progress"]) == 0
    rec = results.read_record(next((tmp_path / "records").rglob("*.json")))
    assert rec["run_info"]["settings"]["cards"] == {"matyas": zoo.card_digest("matyas")}
    v2 = protocols.get("zoo-v2")
    config = {"function": "matyas@s2", "arch": v2.arch, "backbone_init": v2.backbone_init, "noise": v2.noise,
              "dtype": v2.dtype, "seeds": [0], "validation": True,
              "budget": v2.budget_fields() | {"seeds": 1}}  # fmt: skip
    assert v2.differences(config, {"matyas": zoo.card_digest("matyas")}) == []
    assert v2.differences(config, {"matyas": "0" * 16}) == ["another version of card matyas than the protocol's"]


def test_a_sweep_under_zoo_v2_runs_its_tasks_at_every_rate_of_its_grid(tmp_path, capsys):
    out = tmp_path / "v2"
    assert main(["sweep", "--protocol", "zoo-v2", "--methods", "frozen", "--seeds", "1", "--out", str(out)]) == 0
    frame = results.load(out)
    v2 = protocols.get("zoo-v2")
    assert sorted(frame["function"].unique()) == sorted(v2.functions)  # "all" under a protocol: its tasks
    assert sorted(frame["lr"].unique()) == sorted(v2.lrs) and frame["val_at_best_train"].notna().all()
    assert {protocols.of_config(results.read_record(r)["run_info"]["config"]) for r in set(frame["record"])} == {
        "zoo-v2"
    }


# ---------------------------------------------------------------------------------------------------------------
# The per-seed CSV's schema (every reader of one goes through per_seed.load)


def _damaged(tmp_path, change) -> str:
    frame = pd.read_csv("docs/results/baselines/zoo-v1-aa/per-seed.csv.gz", dtype=str, keep_default_na=False)
    path = tmp_path / "damaged.csv"
    change(frame).to_csv(path, index=False)
    return str(path)


@pytest.mark.parametrize(
    "change, phrase",
    [
        (lambda f: f.assign(best_test_mse=["x"] + list(f["best_test_mse"][1:])), "line 2: column best_test_mse"),
        (lambda f: f.iloc[:0], "has no rows"),
        (lambda f: f.assign(test_at_best_train=["-1.5"] + list(f["test_at_best_train"][1:])),
         "line 2: column test_at_best_train: greater_than_or_equal_to(0) (value -1.5)"),
        (lambda f: f.assign(best_train_mse=[""] + list(f["best_train_mse"][1:])),
         "line 2: an ok seed without best_train_mse"),
        (lambda f: pd.concat([f, f.iloc[[3]]]), "line 5: a second row of the same arch, budget"),
        (lambda f: f.assign(status=["fine"] + list(f["status"][1:])), "line 2: column status"),
        (lambda f: f.assign(seed=["-1"] + list(f["seed"][1:])), "line 2: column seed"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("command", ["report", "compare"])
def test_a_per_seed_csv_that_breaks_the_schema_is_one_line_naming_line_and_column(
    command, change, phrase, tmp_path, capsys
):
    path = _damaged(tmp_path, change)
    argv = ["report", path, "--out", str(tmp_path / "r")] if command == "report" else ["compare", "--leaderboard"]
    argv += [] if command == "report" else ["--baselines", path]
    line = one_line_error(capsys, argv)
    assert f"per-seed CSV {path}" in line and phrase in line, line


def test_zoo_v2s_tasks_are_the_ones_its_committed_item_analysis_keeps():
    """The protocol is what its analysis chose: the candidates' item page (rebuilt from its per-seed CSV by
    tests/test_board.py) says "keep" for exactly these 24 tasks."""
    items = pd.read_csv("docs/results/items/candidates/items.csv")
    assert list(items.loc[items["verdict"] == "keep", "function"]) == list(protocols.get("zoo-v2").functions)
