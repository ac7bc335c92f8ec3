"""Suite runs on the engine: stages train only their own tasks, nothing is reset between stages, instructions are
read per sample, records resume, and the continual metrics come out of real runs as the definitions say."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from qlbench import cli, inputs, suites, zoo
from qlbench.experiments import ablation, multitask, runner
from qlbench.metrics import continual, suite_stats
from qlbench.records import results

from helpers import one_line_error, settings

pytestmark = pytest.mark.xdist_group("multitask")  # its module fixture trains once: its tests, one worker

FAST = dict(budget="smoke", seeds=2, backbone_init="kaiming", threads=1)


def plan(tmp_path, suite="zoo-4", schedule="sequential", methods=("lora",), **kw):
    return multitask.plan(suite, schedule, list(methods), **settings(**FAST | kw, arch="deep-narrow", out_dir=tmp_path))


def with_lr(p: multitask.SuitePlan, lr: float) -> multitask.SuitePlan:
    adapt = dataclasses.replace(p.budget.adapt, lr=lr)
    return dataclasses.replace(p, budget=dataclasses.replace(p.budget, adapt=adapt))


def seeds(p: multitask.SuitePlan, row: str) -> list[dict]:
    return results.read_record(p.record_path(row))["train_info"]["per_seed"]


@pytest.fixture(scope="module")
def zoo4(tmp_path_factory):
    """One sequential smoke run on zoo-4 (live backbone) of a static, a task and two instruction rows."""
    p = plan(tmp_path_factory.mktemp("zoo4"), methods=("lora", "lora-per-task", "instruct-queryable", "task-code"))
    runner.run(p, progress=False, log=lambda m: None)
    return p


def test_a_suite_record_holds_its_cards_and_one_made_from_an_edited_card_is_refused(zoo4, monkeypatch):
    rec = results.read_record(zoo4.record_path("lora"))
    assert rec["run_info"]["settings"]["cards"] == suites.cards("zoo-4")
    texts = dict(zoo._texts())
    texts["matyas"] = texts["matyas"].replace('instruction = "', 'instruction = "Edited: ')
    monkeypatch.setattr(zoo, "_texts", lambda: texts)
    with pytest.raises(inputs.Refused, match="was made from another version of card matyas than the installed one"):
        runner.run(zoo4, progress=False, log=lambda m: None)


def test_a_stage_trains_only_its_own_task(zoo4):
    """lora-per-task after stage 0 has moved task 0 only: every other task's MSE is its initial one, bit for bit
    (their factors got no gradient), and after stage t tasks t + 1.. are still untouched."""
    for s in seeds(zoo4, "lora-per-task"):
        R, initial = np.array(s["stage_task_mse"]), np.array(s["initial_task_mse"])
        assert R.shape == (4, 4)
        for t in range(4):
            assert (R[t, t + 1 :] == initial[t + 1 :]).all()
            assert R[t, t] != initial[t]
        assert continual.fwt(R, initial) == 0.0  # nothing transfers forward through separate adapters


def test_separate_adapters_forget_exactly_nothing(zoo4):
    """lora-per-task is the "no forgetting" reference: after stage t, task t's MSE stays bit for bit through every
    later stage (a real learning rate and AdamW's weight decay; before isolate_tasks the decay shrank earlier tasks'
    factors and this row "forgot" 0.0287 on zoo-4 at the quick budget), so forgetting and BWT are exactly 0."""
    for s in seeds(zoo4, "lora-per-task"):
        R = np.array(s["stage_task_mse"])
        for t in range(4):
            assert (R[t:, t] == R[t, t]).all()
        assert (continual.forgetting(R) == 0).all() and continual.bwt(R) == 0


def test_nothing_is_reset_between_stages(zoo4):
    """A shared adapter carries its parameters over: after stage 1, task 0's MSE is not back at its initial value
    (a reset would put it there) and differs from its stage-0 value (stage 1 changed the shared update)."""
    for s in seeds(zoo4, "lora"):
        R, initial = np.array(s["stage_task_mse"]), np.array(s["initial_task_mse"])
        assert R[1, 0] != initial[0] and R[1, 0] != R[0, 0]


def test_learning_rate_zero_forgets_nothing(tmp_path):
    """With lr 0 every stage leaves the parameters (and every task's MSE) exactly where they were: forgetting,
    BWT and FWT are 0 for a static and a routed row alike."""
    p = with_lr(plan(tmp_path, methods=("lora", "instruct-queryable")), 0.0)
    runner.run(p, progress=False, log=lambda m: None)
    for row in p.rows:
        for s in seeds(p, row):
            R, initial = np.array(s["stage_task_mse"]), np.array(s["initial_task_mse"])
            assert (R == initial).all()
            assert (continual.forgetting(R) == 0).all() and continual.bwt(R) == 0 and continual.fwt(R, initial) == 0


def test_shuffling_instructions_moves_instruction_methods_only(zoo4, tmp_path):
    """Routing with task t + 1's instruction changes an instruction method's error on zoo-4 (four sentences) and
    on task codes, and changes nothing, bit for bit, on the same-instruction control (four equal sentences)."""
    for row in ("instruct-queryable", "task-code"):
        for s in seeds(zoo4, row):
            assert s["shuffled_task_mse"] != s["stage_task_mse"][-1]
    assert all("shuffled_task_mse" not in s for s in seeds(zoo4, "lora"))
    control = plan(tmp_path, suite="zoo-4-same-instruction", methods=("instruct-queryable",))
    runner.run(control, progress=False, log=lambda m: None)
    for s in seeds(control, "instruct-queryable"):
        assert s["shuffled_task_mse"] == s["stage_task_mse"][-1]
        assert s["paraphrase_task_mse"] == s["stage_task_mse"][-1]  # its paraphrases are the same sentence too
    folded = suite_stats.load(control.store.root)  # the control joins its card's table as one row
    assert set(folded["suite"]) == {"zoo-4"} and set(folded["method"]) == {"same-instruction"}


def test_paraphrases_are_evaluated_for_sentences_not_for_codes(zoo4):
    assert all("paraphrase_task_mse" in s for s in seeds(zoo4, "instruct-queryable"))
    assert all("paraphrase_task_mse" not in s for s in seeds(zoo4, "task-code"))


COPIES = """
description = "four copies of one task"
bounds = [[-1.0, 1.0], [-1.0, 1.0]]
[source]
function = "ackley"
""" + "".join(
    f"""
[[task]]
name = "copy{i}"
function = "matyas"
instruction = "A smooth bowl."
paraphrases = ["A round basin.", "A smooth valley."]
"""
    for i in range(4)
)


def test_copies_of_one_task_use_the_atoms_alike(tmp_path, monkeypatch, zoo4):
    """Four copies of one task with one sentence route alike (final symmetric KL between their usage near 0; they
    differ only by their test samples), while zoo-4's four sentences already give the router distinct usage."""
    cards = dict(suites._cards()) | {"copies": suites.parse("copies", COPIES)}
    monkeypatch.setattr(suites, "_cards", lambda: cards)
    p = plan(tmp_path, suite="copies", schedule="joint", methods=("instruct-queryable",))
    runner.run(p, progress=False, log=lambda m: None)
    copies = [continual.symmetric_kl(np.array(s["usage"])[-1]).max() for s in seeds(p, "instruct-queryable")]
    distinct = [continual.symmetric_kl(np.array(s["usage"])[-1]).max() for s in seeds(zoo4, "instruct-queryable")]
    assert max(copies) < 0.01, copies
    assert min(distinct) > 10 * max(copies), (distinct, copies)


def test_held_out_task_is_zero_shot(tmp_path):
    """Under held-out the last task is never trained on: lora-per-task's output on it is the frozen backbone's
    (its factors never moved), while the trained tasks moved."""
    p = plan(tmp_path, suite="shifts-matyas", schedule="held-out", methods=("lora-per-task", "frozen"))
    runner.run(p, progress=False, log=lambda m: None)
    frozen = {s["seed"]: s["stage_task_mse"][-1] for s in seeds(p, "frozen")}
    for s in seeds(p, "lora-per-task"):
        final = s["stage_task_mse"][-1]
        assert final[-1] == frozen[s["seed"]][-1]
        assert all(a != b for a, b in zip(final[:-1], frozen[s["seed"]][:-1]))
    frame = suite_stats.load(p.store.root)
    assert frame.loc[frame["method"] == "lora-per-task", "held-out"].notna().all()


def test_a_suite_resumes_row_by_row_with_the_same_numbers(tmp_path):
    p = plan(tmp_path, schedule="joint", methods=("lora", "task-lora"))
    runner.run(p, progress=False, log=lambda m: None)
    before = seeds(p, "task-lora")
    p.record_path("task-lora").unlink()
    said = []
    runner.run(p, progress=False, log=said.append)
    assert any("1 row(s) already have a finished record" in m for m in said)
    assert seeds(p, "task-lora") == before


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["suite", "--suite", "nope"], ["'nope'", "zoo-4", "shifts-ackley"]),
        (["suite", "--suite", "zoo-4", "--schedule", "random"], ["'random'", "joint", "sequential", "held-out"]),
        (["suite", "--suite", "zoo-4", "--methods", "lora,moe"], ["'moe'", "lora-per-task", "task-code"]),
        (["suite", "--suite", "zoo-4", "--hp", "tasks=3"], ["tasks", "suite's task count"]),
        (["suite", "--suite", "zoo-4", "--seeds", "0"], ["seeds", ">= 1"]),
        # the rows that read each task's parameters, on a suite without them: the parametric suites named
        *(
            (["suite", "--suite", suite, "--methods", f"lora,{row}"], [row, "parametric", "param-sin-cos-64-n50"])
            for row in multitask.PARAMETRIC_ROWS
            for suite in ("zoo-4", "shifts-ackley-same-instruction")
        ),
        (
            ["suite", "--suite", "zoo-4", "--methods", "instruct-queryable", "--hp", "instruction_source=params"],
            ["instruct-queryable reads each task's parameters", "param-sin-cos-4"],
        ),
    ],
)
def test_bad_suite_input_is_one_line_exit_2(capsys, tmp_path, argv, expect):
    line = one_line_error(capsys, argv + ["--out", str(tmp_path / "out")])
    assert all(e in line for e in expect), line
    assert not (tmp_path / "out").exists()


def test_report_writes_the_suite_section(zoo4, tmp_path, capsys):
    """`qlbench report` on a folder holding only suite records: the suite table and the continual-routing figures;
    the single-task loaders ignore suite records, and `qlbench results` lists them."""
    assert cli.main(["results", str(zoo4.store.root)]) == 0
    listed = capsys.readouterr().out
    assert "Suite records" in listed and all(f"| {row} " in listed for row in zoo4.rows)
    out = tmp_path / "report"
    assert cli.main(["report", str(zoo4.store.root), "--out", str(out), "--format", "md,csv"]) == 0
    folder = out / "suites" / "deep-narrow-kaiming" / "smoke" / "zoo-4" / "sequential"
    table = (folder / "table.md").read_text()
    assert all(row in table for row in zoo4.rows) and "forgetting" in table
    for name in ("stage-task-mse", "instruct-queryable-usage", "instruct-queryable-drift", "task-code-kl-drift"):
        assert (folder / f"{name}.png").stat().st_size > 5_000
    assert "lora-per-task-usage.png" not in {p.name for p in folder.iterdir()}  # no router, no usage figure
    assert results.load(zoo4.store.root).empty


def test_suite_ablation_table_pairs_each_variant_with_the_card():
    rows = []
    for suite, method, averages in (
        ("zoo-4", "instruct-queryable", [1.0, 2.0, 3.0]),
        ("zoo-4", "task-code", [1.5, 2.4, 3.7]),
        ("zoo-4", "same-instruction", [1.0, 2.0, 3.0]),  # suite_stats.load folds the control into its card
    ):
        for seed, a in enumerate(averages):
            rows.append(
                dict(suite=suite, method=method, seed=seed, status="ok", trainable_params=10, average=a)
                | {k: float("nan") for k in ("paraphrased", "shuffled", "held-out", "usage-kl")}
            )
    table = ablation.suite_table(pd.DataFrame(rows)).set_index("variant")
    assert list(table.index) == ["card", "same-instruction", "task-code"]
    # by hand: differences 0.5, 0.4, 0.7, mean 0.533, sd 0.153, t = 6.05 on 2 degrees of freedom, p = 0.026
    assert table.loc["task-code", "diff vs card, p"] == "0.533, p = 0.026"
    assert table.loc["same-instruction", "diff vs card, p"].startswith("0,")
    assert table.loc["card", "average"] == "2.00 ± 1.0"
    # same-instruction's differences are all 0 (no p): the Holm family is task-code alone, not adjusted
    assert table.loc["task-code", "Holm p"] == "0.026" and table.loc["same-instruction", "Holm p"] == "nan"
    assert "Holm-adjusted over the table's 1 comparisons with card" in ablation.legend(table.reset_index())


def test_suite_ablation_table_adjusts_p_over_every_variant():
    """task-code's raw p 0.026 (differences 0.5, 0.4, 0.7) beside no-instruction's 0.89 (0.1, -0.2, 0.15): the
    table's 2 comparisons with the card give task-code Holm p = 2 x 0.0263 = 0.053, not below 0.05."""
    rows = []
    for method, averages in (
        ("instruct-queryable", [1.0, 2.0, 3.0]),
        ("task-code", [1.5, 2.4, 3.7]),
        ("no-instruction", [1.1, 1.8, 3.15]),
    ):
        for seed, a in enumerate(averages):
            rows.append(
                dict(suite="zoo-4", method=method, seed=seed, status="ok", trainable_params=10, average=a)
                | {k: float("nan") for k in ("paraphrased", "shuffled", "held-out", "usage-kl")}
            )
    table = ablation.suite_table(pd.DataFrame(rows))
    shown = table.set_index("variant")
    assert shown.loc["task-code", "diff vs card, p"] == "0.533, p = 0.026"
    assert shown.loc["task-code", "Holm p"] == "0.053" and shown.loc["no-instruction", "Holm p"] == "0.89"
    assert shown.loc["card", "Holm p"] == "-"
    assert "Holm-adjusted over the table's 2 comparisons with card" in ablation.legend(table)


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["ablate", "--suite", "zoo-4-same-instruction"], ["suite card, not a control", "'zoo-4'"]),
        (["ablate", "--function", "dropwave", "--schedule", "sequential"], ["--suite only"]),
        (["ablate", "--suite", "zoo-4", "--schedule", "nope"], ["'nope'", "held-out"]),
    ],
)
def test_bad_ablate_suite_input_is_one_line_exit_2(capsys, tmp_path, argv, expect):
    line = one_line_error(capsys, argv + ["--out", str(tmp_path / "out")])
    assert all(e in line for e in expect), line


@pytest.mark.slow
def test_separate_adapters_fit_conflicting_tasks_that_one_static_update_cannot(tmp_path):
    """zoo-4 maps the same x to four different labels: with a joint schedule every static adapter learns one update
    for all four, while lora-per-task keeps one per task. On a live backbone (the quick budget's 100 pretraining
    epochs, then 100 adaptation epochs; 2 seeds), lora-per-task's average test MSE is below the best static
    adapter's on every seed."""
    static = ("lora", "dora", "hyra", "replora", "doran")
    p = plan(tmp_path, schedule="joint", methods=(*static, "lora-per-task"), budget="quick", seeds=2)
    budget = dataclasses.replace(p.budget, adapt=dataclasses.replace(p.budget.adapt, epochs=100))
    p = dataclasses.replace(p, budget=budget)
    runner.run(p, progress=False, log=lambda m: None)
    frame = suite_stats.load(p.store.root).pivot(index="seed", columns="method", values="average")
    best_static = frame[list(static)].min(axis=1)
    assert (frame["lora-per-task"] < best_static).all(), frame
