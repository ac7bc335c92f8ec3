"""Parametric suites: every sentence states the parameters its task's data is made with (parsed back, and checked
against the surface itself), the pools nest across T, held-out tasks never reach a training batch, and the
grouped sequential schedule's continual metrics reduce to GEM's."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pandas as pd
import pytest
import torch

from qlbench import adapters, engine, parametric, suites, text
from qlbench.experiments import multitask, runner, suite_tasks
from qlbench.metrics import continual, stats, suite_stats
from qlbench.report import heldout
from qlbench.settings import Execution, Protocol

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
        methods=["lora", "mean"],
        protocol=Protocol(arch="deep-narrow", budget="smoke", seeds=2),
        execution=Execution(out_dir=tmp_path, threads=1),
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
        methods=["lora", "task-code", "instruct-queryable"],
        protocol=Protocol(arch="deep-narrow", budget="smoke", seeds=2),
        execution=Execution(out_dir=tmp_path / "r", threads=1),
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
    for column in heldout.TESTS:  # against its code row and LoRA; no param-code or nearest-task row: no column
        if column.startswith(("vs params", "vs nearest")):
            assert column not in rows["instruct-queryable"]
        else:
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


# ----------------------------------------------------------------------------------------------------------------
# Rows that can transfer without words: parameter codes and the nearest training task


def test_parameter_codes_are_deterministic_and_one_per_task_across_sizes():
    """The same matrix on every call (seeded, cached but handed out as a copy), and a task's code is the same in
    every suite of the family (T = 4's training tasks within T = 64's, and the held-out ones)."""
    a, b = parametric.code_matrix(384), parametric.code_matrix(384)
    assert torch.equal(a, b) and a.shape == (384, 4)
    a.zero_()  # a caller cannot change the codes
    assert parametric.code_matrix(384).abs().sum() > 0
    small, large = (suite_tasks.parameter_codes(suites.get(f"{parametric.PREFIX}{T}")) for T in (4, 64))
    assert torch.equal(small[:4], large[:4]) and torch.equal(small[4:], large[64:])
    config = adapters.get("instruct-queryable").make_config()  # the router's table: the codes at d_c = 384
    config.instruction_source = suite_tasks.PARAMETER_SOURCE
    assert torch.equal(suite_tasks.instruction_table(suites.get(f"{parametric.PREFIX}4"), config), small)


def test_parameter_codes_are_smooth_in_parameter_space():
    """code(p) = M u(p) with u(p) = (p - CENTRE) / RANGES, by hand; Lipschitz in parametric.distance with constant
    ||M||_F (sqrt of the sum of squares, computed here, an upper bound of the spectral norm): every pair of the
    pool's 80 tasks within it, and with a lower bound (the smallest singular value) no two tasks share a code.
    Two tasks 5 degrees apart differ by exactly M[:, 3] * 5 / 60."""
    M = parametric.code_matrix(384)
    frob = math.sqrt(sum(v * v for v in M.flatten().tolist()))
    low = torch.linalg.svdvals(M).min().item()
    assert 0.9 < low and frob < 2.2  # entries N(0, 1 / 384): about 1 along every axis, 2 = sqrt(4) in Frobenius
    p0 = (0.5, -1.0, 1.25, 30.0)
    by_hand = M @ torch.tensor([0.5 / 3, -1.0 / 3, 0.125 / 0.75, 0.0], dtype=F64)
    assert torch.allclose(parametric.codes([p0], 384)[0], by_hand, atol=1e-15)
    turned = parametric.codes([p0, (0.5, -1.0, 1.25, 35.0)], 384)
    assert torch.allclose(turned[1] - turned[0], M[:, 3] * 5 / 60, atol=1e-15)
    train, inter, extra = parametric.pool()
    ps = train + inter + extra
    c = parametric.codes(ps, 384)
    for i in range(len(ps)):
        for j in range(i + 1, len(ps)):
            gap, d = (c[i] - c[j]).norm().item(), parametric.distance(ps[i], ps[j])
            assert low * d - 1e-12 <= gap <= frob * d + 1e-12, (ps[i], ps[j])
            assert gap > 0


def test_parameter_codes_are_not_task_codes():
    """param-code's table is not task-code's: per task the two vectors are nearly orthogonal (a random 384-d
    direction against a fixed projection: |cosine| well below 0.3), and task-code's cannot be written as M u of
    any u (its residual off M's 4-d column space is most of it), while param-code's lies in that space exactly."""
    s = suites.get(f"{parametric.PREFIX}16")
    config = lambda source: dataclasses.replace(
        adapters.get("instruct-queryable").make_config(), instruction_source=source
    )
    random = suite_tasks.instruction_table(s, config("random"))
    params = suite_tasks.parameter_codes(s)
    cos = (random * params).sum(1) / (random.norm(dim=1) * params.norm(dim=1))
    assert cos.abs().max() < 0.3
    M = parametric.code_matrix(384)
    project = M @ torch.linalg.pinv(M)  # onto M's column space
    assert torch.allclose(project @ params.T, params.T, atol=1e-12)
    assert ((random.T - project @ random.T).norm(dim=0) / random.norm(dim=1)).min() > 0.9


def nearest_by_hand(held: parametric.Params, trained: list[parametric.Params]) -> int:
    """The index of the trained task nearest `held`: each parameter's difference divided by its range, squared,
    summed (the square root changes no order), the first of equal ones."""
    ranges = (3.0, 3.0, 0.75, 60.0)
    d = [sum(((a - b) / r) ** 2 for a, b, r in zip(held, p, ranges)) for p in trained]
    return d.index(min(d))


def hand_suite() -> suites.Suite:
    """Three training tasks and three held-out ones whose nearest training tasks are plain to see."""
    params = {
        "a": (0.0, 0.0, 1.0, 0.0, "train"),
        "b": (1.5, 1.5, 1.0, 0.0, "train"),
        "c": (0.0, 0.0, 1.5, 60.0, "train"),
        "near-a": (0.5, 0.0, 1.0, 5.0, "interpolation"),  # 0.19 from a, 0.61 from b
        "near-c": (0.0, 0.0, 1.5, 50.0, "interpolation"),  # 0.17 from c, 1.07 from a
        "near-b": (1.0, 1.5, 1.0, 10.0, "extrapolation"),  # 0.24 from b, 0.62 from a
    }
    tasks = [
        dict(name=n, function="sin-cos", shift=[dx, dy], steepness=k, rotation_deg=th, split=split,
             instruction=f"Task {n}.", paraphrases=[f"The task {n}.", f"Task called {n}."])
        for n, (dx, dy, k, th, split) in params.items()
    ]  # fmt: skip
    bounds = [[-math.pi, math.pi]] * 2
    return suites.from_dict(
        "hand", dict(description="by hand", bounds=bounds, source={"function": "sin-cos"}, task=tasks)
    )


def routes_are_nearest(s: suites.Suite, route: torch.Tensor) -> bool:
    """Every trained task routed to itself and every held-out one to its nearest trained task by hand."""
    trained = [i for i in range(len(s.tasks)) if i not in s.held_out]
    p = [parametric.params(t) for t in s.tasks]
    want = [i if i in trained else trained[nearest_by_hand(p[i], [p[j] for j in trained])] for i in range(len(p))]
    return route.tolist() == want


def test_nearest_task_routes_each_held_out_task_to_its_nearest_training_task(monkeypatch):
    """By hand on six tasks: near-a -> a, near-c -> c, near-b -> b, the trained ones to themselves; "own" is the
    identity; on param-sin-cos-16 every route's distance is parametric.nearest's. Planted bug: the farthest
    training task instead (parametric.closest as an argmax) fails the same check."""
    s = hand_suite()
    route = suite_tasks.held_out_routes(s, "held-out", "nearest")
    assert route.tolist() == [0, 1, 2, 0, 2, 1] and routes_are_nearest(s, route)
    assert suite_tasks.held_out_routes(s, "held-out", "own").tolist() == list(range(6))
    assert suite_tasks.held_out_routes(s, "joint", "nearest").tolist() == list(range(6))  # every task trained
    big = suites.get(f"{parametric.PREFIX}16")
    route = suite_tasks.held_out_routes(big, "held-out", "nearest")
    assert routes_are_nearest(big, route)
    p = [parametric.params(t) for t in big.tasks]
    trained = [p[i] for i in range(len(p)) if i not in big.held_out]
    for h in big.held_out:
        assert route[h] not in big.held_out
        assert parametric.distance(p[h], p[route[h]]) == parametric.nearest(p[h], trained)
    farthest = lambda q, among: max(range(len(among)), key=lambda i: parametric.distance(q, among[i]))
    monkeypatch.setattr(parametric, "closest", farthest)
    assert not routes_are_nearest(s, suite_tasks.held_out_routes(s, "held-out", "nearest"))
    assert not routes_are_nearest(big, suite_tasks.held_out_routes(big, "held-out", "nearest"))


def test_fixed_n_suites_hold_n_training_samples_per_task():
    """param-sin-cos-T-n50: listed and accepted, the same tasks as param-sin-cos-T with exactly FIXED_N training
    samples for every task (held-out ones included) and TEST_PER_TASK test samples; a task's training inputs are
    the first of param-sin-cos-4's 400 (one draw per task); the fixed-total cards keep the config their committed
    records were written under."""
    import json
    from pathlib import Path

    n = parametric.FIXED_N
    assert n not in {parametric.TRAIN_TOTAL // T for T in parametric.SIZES}  # no fixed-total card twice
    for T in parametric.SIZES:
        name = parametric.suite_name(T, n)
        assert name == f"{parametric.PREFIX}{T}-n{n}" and name in suites.names()
        s, twin = suites.get(name), suites.get(parametric.suite_name(T))
        assert s.tasks == twin.tasks and s.train_per_task == n and suites.data_name(name) == suites.data_name(twin.name)
        for t in range(len(s.tasks)) if T == 4 else (0, T - 1, len(s.tasks) - 1):
            d = s.task_data(t, seed=1)
            assert len(d.y_train) == n and len(d.x_train) == n and len(d.y_test) == parametric.TEST_PER_TASK
        first = suites.get(f"{parametric.PREFIX}4").task_data(0, seed=1).x_train  # 400 training inputs
        assert torch.equal(s.task_data(0, seed=1).x_train, first[:n])
    assert parametric.size(f"{parametric.PREFIX}16") == (16, None)
    with pytest.raises(ValueError, match="param-sin-cos-16-n50"):
        parametric.size(f"{parametric.PREFIX}16-n7")
    records = Path(__file__).parent.parent / "docs" / "results" / "language-records" / "suites" / "deep-narrow"
    for T in parametric.SIZES:
        record = next((records / parametric.suite_name(T)).rglob("*.json"))
        card = json.loads(record.read_text())["run_info"]["config"]["suite_card"]
        assert json.loads(json.dumps(suites.card_config(suites.get(parametric.suite_name(T))))) == card


def test_training_statistics_standardisation_by_hand():
    """Three tasks with own (mean, std) (1, 2), (0, 1), (3, 0.5); tasks 0 and 1 trained. Member 0's training labels
    y = 1, -1 (task 0: raw 3, -1) and 2 (task 1: raw 2), and a task-2 sample that must not count: raw labels 3, -1,
    2, mean 4/3, population variance ((5/3)^2 + (7/3)^2 + (2/3)^2) / 3 = 26/9. A held-out label 1 of task 2 (raw
    3.5) becomes (3.5 - 4/3) / sqrt(26/9)."""
    own = torch.tensor([[1.0, 2.0], [0.0, 1.0], [3.0, 0.5]], dtype=F64)
    y = torch.tensor([[1.0, -1.0, 2.0, 5.0], [0.0, 0.0, 1.0, 1.0]])
    task = torch.tensor([[0, 0, 1, 2], [0, 1, 0, 1]])
    pooled = suite_tasks.pooled_statistics(y, task, own, [0, 1])
    assert pooled[0, 0].item() == pytest.approx(4 / 3) and pooled[0, 1].item() == pytest.approx(math.sqrt(26 / 9))
    raw = [1.0, 0.0, 3.0, 1.0]  # member 1: 2*0+1, 1*0+0, 2*1+1, 1*1+0
    assert pooled[1, 0].item() == pytest.approx(np.mean(raw)) and pooled[1, 1].item() == pytest.approx(np.std(raw))
    held = suite_tasks.restandardise(torch.tensor([[1.0], [1.0]]), torch.tensor([[2], [2]]), own, pooled)
    assert held[0, 0].item() == pytest.approx((3.5 - 4 / 3) / math.sqrt(26 / 9))
    assert held[1, 0].item() == pytest.approx((3.5 - np.mean(raw)) / np.std(raw))
    same = suite_tasks.restandardise(y, task, own, torch.tensor([[1.0, 2.0], [1.0, 2.0]], dtype=F64))
    assert torch.allclose(same[0, :2], y[0, :2].double())  # task 0 by its own statistics: unchanged


def test_a_held_out_run_records_both_standardisations(tmp_path):
    """mean (a constant c per member, the trained labels' mean) on param-sin-cos-4 held-out: the record's pooled
    statistics are the raw training labels' of the 4 training tasks, recomputed here from the suite's data and each
    task's own statistics; the training-statistics MSE of each held-out task is mean((c - y')^2) over its test
    samples, y' = (sd_h y + mu_h - m) / s; null for the trained tasks. The per-task MSE (headline) is unchanged."""
    from qlbench.records import results

    p = multitask.plan(
        suite=f"{parametric.PREFIX}4",
        schedule="held-out",
        methods=["mean"],
        protocol=Protocol(arch="deep-narrow", budget="smoke", seeds=2),
        execution=Execution(out_dir=tmp_path, threads=1),
    )
    runner.run(p, progress=False, log=lambda m: None)
    s = p.suite
    for entry in results.read_record(p.record_path("mean"))["train_info"]["per_seed"]:
        data = [s.task_data(t, entry["seed"]) for t in range(len(s.tasks))]
        stats_of = [s.standardisation(t) for t in s.tasks]
        trained = [t for t in range(len(s.tasks)) if t not in s.held_out]
        raw = np.concatenate([stats_of[t][1] * data[t].y_train.double().numpy() + stats_of[t][0] for t in trained])
        m, sd = raw.mean(), raw.std()
        assert entry["train_label_stats"] == pytest.approx([m, sd], rel=1e-9)
        c = np.concatenate([data[t].y_train.numpy() for t in trained]).mean()
        for t, mse in enumerate(entry["train_standardised_task_mse"]):
            if t in trained:
                assert mse is None
                continue
            y = (stats_of[t][1] * data[t].y_test.double().numpy() + stats_of[t][0] - m) / sd
            assert mse == pytest.approx(np.mean((c - y) ** 2), rel=1e-5)
            assert entry["stage_task_mse"][-1][t] == pytest.approx(np.mean((c - data[t].y_test.numpy()) ** 2), rel=1e-5)


def test_param_code_trains_and_reports(tmp_path, capsys):
    """A smoke held-out run of instruct-queryable and param-code on param-sin-cos-4: param-code binds the parameter
    codes, has no paraphrase (no words) but a shuffled evaluation, and the report tests instruct-queryable against
    it on each split (vs params), with both standardisations shown; the columns of absent controls are left out."""
    from qlbench import cli
    from qlbench.records import results

    p = multitask.plan(
        suite=f"{parametric.PREFIX}4",
        schedule="held-out",
        methods=["instruct-queryable", "param-code"],
        protocol=Protocol(arch="deep-narrow", budget="smoke", seeds=2),
        execution=Execution(out_dir=tmp_path / "r", threads=1),
    )
    assert p.configs["param-code"].instruction_source == "params"
    assert p.cell_config("param-code")["method_config"]["instruction_source"] == "params"
    assert p.record_path("param-code") != p.record_path("instruct-queryable")
    runner.run(p, progress=False, log=lambda m: None)
    rec = results.read_record(p.record_path("param-code"))
    assert rec["train_info"]["status"] == "ok"
    for entry in rec["train_info"]["per_seed"]:
        assert "paraphrase_task_mse" not in entry and "shuffled_task_mse" in entry
        assert sum(v is not None for v in entry["train_standardised_task_mse"]) == len(p.suite.held_out)
    assert cli.main(["report", str(tmp_path / "r"), "--out", str(tmp_path / "out"), "--format", "md,csv",
                     "--no-figures"]) == 0  # fmt: skip
    capsys.readouterr()
    folder = tmp_path / "out" / "heldout" / "deep-narrow" / "smoke" / "held-out"
    rows = {r["method"]: r for r in pd.read_csv(folder / "table.csv").to_dict("records")}
    for split in ("interpolation", "extrapolation"):
        assert rows["instruct-queryable"][f"vs params ({split})"].split()[-1] in ("win", "tie", "loss")
        assert rows["param-code"][f"vs params ({split})"] == "-"
        assert rows["param-code"][f"{split} (train std)"] != "-"
        assert f"vs nearest ({split})" not in rows["param-code"]  # no nearest-task row: no column
    assert "vs params (split): instruct-queryable against param-code" in (folder / "table.md").read_text()


def test_the_transferable_controls_join_the_one_holm_family():
    """Both language rows against all four controls (code, lora, params, nearest) on both splits: 16 paired tests,
    one Holm family. instruct-queryable is 0.4 above param-code on interpolation (a loss, raw p tiny); every Holm p
    is the step-down formula over the 16 raw p (scipy's paired t-test, here), and the controls get no test of their
    own. Planted bug: pairing instruct-queryable with text-lora-params gives another raw p than the table's."""
    from scipy import stats as sps

    rows, noise = [], [0.01, -0.02, 0.015, -0.005, 0.0]
    methods = ("lora", "task-code", "param-code", "nearest-task", "instruct-queryable", "text-lora", "text-lora-code",
               "text-lora-params")  # fmt: skip
    for k, method in enumerate(methods):
        for seed, e in enumerate(noise):
            for split in ("interpolation", "extrapolation"):
                mse = 1.0 + 0.1 * seed + e * (k - 3.5)  # every pair of rows differs by a noise
                if (method, split) == ("instruct-queryable", "interpolation"):
                    mse += 0.4
                rows.append({"arch": "deep-narrow", "backbone_init": "kaiming", "budget": "quick",
                             "schedule": "held-out", "T": 16, "method": method, "seed": seed, "task": f"{split}-0",
                             "split": split, "distance": 0.1, "mse": mse, "paraphrased": np.nan,
                             "shuffled": np.nan})  # fmt: skip
    tasks = pd.DataFrame(rows)
    frame = pd.DataFrame(columns=["suite", "method", "schedule", "average", "status"])
    table = heldout.summary(tasks, frame).set_index("method")
    controls = {"code": ("task-code", "text-lora-code"), "lora": ("lora", "lora"),
                "params": ("param-code", "text-lora-params"), "nearest": ("nearest-task", "nearest-task")}  # fmt: skip
    raw = {}
    for split, g in tasks.groupby("split"):
        w = g.pivot(index="seed", columns="method", values="mse")
        for who, (iq, tl) in controls.items():
            raw[("instruct-queryable", f"vs {who} ({split})")] = sps.ttest_rel(w["instruct-queryable"], w[iq]).pvalue
            raw[("text-lora", f"vs {who} ({split})")] = sps.ttest_rel(w["text-lora"], w[tl]).pvalue
    order = sorted(raw, key=raw.get)
    holm, running = {}, 0.0
    for j, k in enumerate(order):
        running = max(running, min(1.0, (len(order) - j) * raw[k]))
        holm[k] = running
    assert len(raw) == 16
    for (method, column), p_holm in holm.items():
        cell = table.loc[method, column]
        assert f"Holm {text.num(p_holm, 2)})" in cell and f"(p {text.num(raw[(method, column)], 2)}," in cell
    assert table.loc["instruct-queryable", "vs params (interpolation)"].endswith("loss")
    for control in ("lora", "task-code", "param-code", "nearest-task", "text-lora-params"):
        assert (table.loc[control, list(heldout.TESTS)] == "-").all()
    w = tasks[tasks["split"] == "interpolation"].pivot(index="seed", columns="method", values="mse")
    wrong = sps.ttest_rel(w["instruct-queryable"], w["text-lora-params"]).pvalue
    assert f"(p {text.num(wrong, 2)}," not in table.loc["instruct-queryable", "vs params (interpolation)"]


def _held(values: dict[str, list[float]], split: str = "interpolation") -> pd.DataFrame:
    """A held-out tasks frame of one row: task -> its seeds' MSE."""
    rows = [
        {"task": t, "seed": s, "split": split, "mse": v} for t, seeds in values.items() for s, v in enumerate(seeds)
    ]
    return pd.DataFrame(rows)


def test_the_held_out_interval_draws_tasks_then_seeds():
    """A constant difference gives a point interval; two tasks that differ by +1 and -1 on every seed give [-1, 1]:
    a quarter of the resamples draw one task twice. A bootstrap over the pooled (task, seed) values, the planted
    bug, would give an interval near 0 instead (about +-0.45 with 10 values)."""
    from qlbench.report import heldout

    base = _held({"a": [1.0] * 5, "b": [2.0] * 5})
    assert heldout.interval(_held({"a": [1.3] * 5, "b": [2.3] * 5}), base, "interpolation") == pytest.approx((0.3, 0.3))
    low, high = heldout.interval(_held({"a": [2.0] * 5, "b": [1.0] * 5}), base, "interpolation")
    assert (low, high) == (-1.0, 1.0)
    pooled = stats.hierarchical_bootstrap([np.array([1.0] * 5 + [-1.0] * 5)])
    assert np.quantile(pooled, 0.975, method="inverted_cdf") < 0.7  # the planted bug: far narrower
    assert math.isnan(heldout.interval(_held({"a": [1.0]}), base, "extrapolation")[0])  # no pair on that split
