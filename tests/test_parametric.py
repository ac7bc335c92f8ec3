"""Parametric suites: every sentence states the parameters its task's data is made with (parsed back, and checked
against the surface itself), the pools nest across T, held-out tasks never reach a training batch, and the
grouped sequential schedule's continual metrics reduce to GEM's."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from qlbench import adapters, continual, engine, multitask, parametric, runner, suite_stats, suites, text
from qlbench.report import heldout

F64 = torch.float64
LARGEST = f"{parametric.PREFIX}{max(parametric.SIZES)}"


def test_every_sentence_states_the_parameters_the_data_is_made_with():
    s = suites.get(LARGEST)
    assert len(s.tasks) == max(parametric.SIZES) + parametric.N_INTERPOLATION + parametric.N_EXTRAPOLATION
    for t in s.tasks:
        for sentence in (t.instruction, *t.paraphrases):
            assert parametric.parse(sentence) == parametric.params(t), sentence
    assert len({t.instruction for t in s.tasks}) == len(s.tasks)


def surface(z: torch.Tensor) -> torch.Tensor:
    """sin(z1) + cos(z2): the Sin-Cos source surface, written out (the oracle does not call the zoo)."""
    return torch.sin(z[..., 0]) + torch.cos(z[..., 1])


def placed(p: parametric.Params, z: torch.Tensor) -> torch.Tensor:
    """Where the words put the feature the plain surface has at z: shifted by (dx, dy), k times closer together
    about the moved centre (the box centre is 0), turned theta degrees clockwise."""
    dx, dy, k, theta = p
    a = -math.radians(theta)  # clockwise
    turn = torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]], dtype=F64)
    return z @ turn.T / k + torch.tensor([dx, dy], dtype=F64)


@pytest.mark.parametrize("words", ["as stated", "counter-clockwise", "shift before steepness"])
def test_the_words_are_true_of_the_surface(words):
    """A task's clean label at the point where its sentence puts a feature equals the plain surface's value at that
    feature, for every task; reading "clockwise" the other way, or scaling the shift with the steepness, fails."""
    s = suites.get(LARGEST)
    z = (torch.rand(64, 2, generator=torch.Generator().manual_seed(0), dtype=F64) * 2 - 1) * math.pi
    worst = 0.0
    for t in s.tasks:
        dx, dy, k, theta = parametric.params(t)
        p = {
            "as stated": (dx, dy, k, theta),
            "counter-clockwise": (dx, dy, k, -theta),
            "shift before steepness": (dx / k, dy / k, k, theta),
        }[words]
        worst = max(worst, (t.clean(placed(p, z), s.box) - surface(z)).abs().max().item())
    if words == "as stated":
        assert worst < 1e-12
    else:
        assert worst > 0.1


def test_pools_nest_and_every_size_holds_out_the_same_tasks():
    by_size = {T: suites.get(f"{parametric.PREFIX}{T}") for T in parametric.SIZES}
    held = None
    for T, s in by_size.items():
        trained = [t for t in s.tasks if t.split == "train"]
        out = [s.tasks[i] for i in s.held_out]
        assert len(trained) == T and s.train_per_task * T == parametric.TRAIN_TOTAL
        assert trained == list(by_size[max(parametric.SIZES)].tasks[:T])
        held = held or out
        assert out == held
    train = [parametric.params(t) for t in by_size[max(parametric.SIZES)].tasks if t.split == "train"]
    for t in held:
        p = parametric.params(t)
        assert p not in train and parametric.nearest(p, train) > 0
        if t.split == "extrapolation":
            assert p[3] > max(parametric.TRAIN_ANGLES)
        else:
            assert min(parametric.TRAIN_ANGLES) <= p[3] <= max(parametric.TRAIN_ANGLES)


def test_a_parsed_sentence_with_a_missing_parameter_is_refused():
    with pytest.raises(ValueError, match="theta is stated 0 times"):
        parametric.parse("A sine-cosine wave surface shifted 1 units right and 2 units up, 1 times as steep.")


def test_card_suites_keep_their_config_without_the_new_fields():
    """card_config leaves the parametric fields out where they hold their defaults, so the committed records of the
    card suites keep their hashes; a parametric card carries them."""
    card = suites.card_config(suites.get("zoo-4"))
    assert not set(suites.CARD_DEFAULTS) & set(card)
    assert not set(suites.TASK_DEFAULTS) & set(card["tasks"][0])
    param = suites.card_config(suites.get(LARGEST))
    assert param["stages"] == parametric.STAGES and param["tasks"][0]["split"] == "train"


@pytest.mark.parametrize("schedule", ["held-out", "sequential"])
def test_held_out_tasks_never_reach_a_training_batch(tmp_path, monkeypatch, schedule):
    """Every stage's data, and the labels a row is built from (mean's), hold trained tasks only, and every batch
    the engine draws comes from them; the held-out tasks are still evaluated after every stage."""
    seen, built = [], []
    fit = engine.fit

    def spy(model, stages, **kw):
        for st in stages:
            seen.append(set(st.data.task_train.unique().tolist()))
        return fit(model, stages, **kw)

    mean = adapters.get("mean")
    build = mean.build
    monkeypatch.setattr(multitask.engine, "fit", spy)
    monkeypatch.setattr(mean, "build", lambda *a: built.append(a[3].shape) or build(*a))
    p = multitask.plan(
        suite=f"{parametric.PREFIX}4",
        schedule=schedule,
        arch="deep-narrow",
        methods=["lora", "mean"],
        out_dir=tmp_path,
        budget="smoke",
        seeds=2,
        threads=1,
    )
    runner.run(p, progress=False, log=lambda m: None)
    held = set(p.suite.held_out)
    assert seen and all(not (s & held) for s in seen)
    assert set().union(*seen) == set(range(len(p.suite.tasks))) - held
    trained = 4 * p.suite.train_per_task  # the built stack's labels (and the cost's one member's; not the dry build)
    assert (len(engine.padded(p.members)), trained) in built and all(n in (1, trained) for _, n in built)
    frame = suite_stats.load(p.store.root)
    for _, row in frame.iterrows():
        R = row["R"]
        assert R.shape == (len(p.suite.schedule_stages(schedule)), len(p.suite.tasks))
        assert row["held-out"] == pytest.approx(R[-1, sorted(held)].mean())


def test_grouped_stages_reduce_to_gem_with_one_task_per_stage():
    """continual's metrics with stage_of: one task per stage gives the square formulas; by hand on two stages of
    two tasks and one never-trained task."""
    g = np.random.default_rng(0)
    R, initial = g.random((4, 4)), g.random(4)
    assert continual.bwt(R, np.arange(4)) == continual.bwt(R)
    assert continual.fwt(R, initial, np.arange(4)) == continual.fwt(R, initial)
    assert (continual.forgetting(R, np.arange(4)) == continual.forgetting(R)).all()
    R = np.array([[1.0, 2.0, 5.0, 7.0, 9.0], [3.0, 6.0, 0.5, 0.25, 8.0]])  # (S=2, T=5); task 4 held out
    stage = np.array([0, 0, 1, 1, -1])
    assert continual.bwt(R, stage) == pytest.approx(((1 - 3) + (2 - 6)) / 2)
    assert continual.fwt(R, [10, 10, 10, 10, 10], stage) == pytest.approx(((10 - 5) + (10 - 7)) / 2)
    assert continual.forgetting(R, stage).tolist() == [2.0, 4.0]


def test_suites_cli_shows_a_parametric_suite_in_summary(capsys):
    from qlbench import cli

    assert cli.main(["suites", f"{parametric.PREFIX}16"]) == 0
    out = capsys.readouterr().out
    assert "16 trained and 16 held out" in out and "Spearman correlation of cosine with parameter distance" in out
    assert out.count("(interpolation) |") == 2 and "extrap-7" in out  # two shown per split; every held-out summarised


def test_task_data_sizes_follow_the_card():
    s = suites.get(f"{parametric.PREFIX}16")
    d = s.task_data(0, seed=0)
    assert len(d.y_train) == parametric.TRAIN_TOTAL // 16 and len(d.y_test) == parametric.TEST_PER_TASK


@pytest.mark.slow  # 19 s on 2 cores: under -m slow (CI), so the default suite stays within about 10 minutes
def test_the_held_out_report_reads_the_records(tmp_path, capsys):
    """`qlbench report` on a parametric held-out run writes the held-out table and figures; its interpolation cell
    for lora is the mean over the record's interpolation tasks of their final MSE, recomputed here from the JSON."""
    import json

    from qlbench import cli

    p = multitask.plan(
        suite=f"{parametric.PREFIX}4",
        schedule="held-out",
        arch="deep-narrow",
        methods=["lora", "task-code", "instruct-queryable"],
        out_dir=tmp_path / "r",
        budget="smoke",
        seeds=2,
        threads=1,
    )
    runner.run(p, progress=False, log=lambda m: None)
    assert cli.main(["report", str(tmp_path / "r"), "--out", str(tmp_path / "out")]) == 0
    folder = tmp_path / "out" / "heldout" / "deep-narrow" / "smoke" / "held-out"
    assert (folder / "distance.png").is_file() and (folder / "table.md").is_file()
    rows = {r["method"]: r for r in pd.read_csv(folder / "table.csv").to_dict("records")}
    assert set(rows) == {"lora", "task-code", "instruct-queryable"}
    for split in ("interpolation", "extrapolation"):  # only a language row is tested, each split apart
        assert rows["lora"][f"vs code ({split})"] == rows["task-code"][f"vs lora ({split})"] == "-"
    rec = json.loads(p.record_path("lora").read_text())
    split = [t["split"] for t in rec["run_info"]["config"]["suite_card"]["tasks"]]
    per_seed = [np.mean([s["stage_task_mse"][-1][i] for i, v in enumerate(split) if v == "interpolation"])
                for s in rec["train_info"]["per_seed"]]  # fmt: skip
    assert rows["lora"]["interpolation"].split(" ± ")[0] == text.num(float(np.mean(per_seed)), 3)
    for column in heldout.TESTS:
        assert rows["instruct-queryable"][column].split()[-1] in ("win", "tie", "loss")
    assert "## Held-out tasks" in capsys.readouterr().out


def test_the_held_out_tests_are_one_family_across_t_and_splits():
    """Two T, two splits, instruct-queryable against task-code and against LoRA: 8 paired tests, one Holm family.
    At T = 4 its interpolation MSE is 0.5 below the others' on every seed but for a little noise (raw p tiny); the
    other tests are nulls. Every Holm p equals the step-down formula over all eight raw p (scipy's paired t-test,
    computed here); Holm within one T (a family of four) would give other values."""
    from scipy import stats as sps

    rows = []
    noise = [0.01, -0.02, 0.015, -0.005, 0.0]
    for T in (4, 16):
        for method in ("lora", "task-code", "instruct-queryable"):
            for seed, e in enumerate(noise):
                for split in ("interpolation", "extrapolation"):
                    base = 1.0 + 0.1 * seed + (0.3 * e if method == "lora" else e if method == "task-code" else -e)
                    effect = -0.5 if (T, split, method) == (4, "interpolation", "instruct-queryable") else 0.0
                    rows.append({"arch": "deep-narrow", "backbone_init": "kaiming", "budget": "quick",
                                 "schedule": "held-out", "T": T, "method": method, "seed": seed, "task": f"{split}-0",
                                 "split": split, "distance": 0.1, "mse": base + effect, "paraphrased": np.nan,
                                 "shuffled": np.nan})  # fmt: skip
    tasks = pd.DataFrame(rows)
    frame = pd.DataFrame(columns=["suite", "method", "schedule", "average", "status"])
    table = heldout.summary(tasks, frame).set_index(["T", "method"])
    raw = {}
    for (T, split), g in tasks.groupby(["T", "split"]):
        w = g.pivot(index="seed", columns="method", values="mse")
        for who, other in (("code", "task-code"), ("lora", "lora")):
            raw[(T, f"vs {who} ({split})")] = sps.ttest_rel(w["instruct-queryable"], w[other]).pvalue
    order = sorted(raw, key=raw.get)  # Holm by hand: (m - j + 1) p_(j), running max, capped at 1
    holm, running = {}, 0.0
    for j, k in enumerate(order):
        running = max(running, min(1.0, (len(order) - j) * raw[k]))
        holm[k] = running
    assert len(raw) == 8
    for (T, column), p_holm in holm.items():
        cell = table.loc[(T, "instruct-queryable"), column]
        assert f"Holm {text.num(p_holm, 2)})" in cell and f"(p {text.num(raw[(T, column)], 2)}," in cell
    assert table.loc[(4, "instruct-queryable"), "vs code (interpolation)"].endswith("win")
    assert table.loc[(16, "instruct-queryable"), "vs code (interpolation)"].endswith("tie")
    assert table.loc[(4, "lora"), "vs code (interpolation)"] == "-"
