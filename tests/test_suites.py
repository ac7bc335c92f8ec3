"""Suite cards: parsing, the tasks' functions against the zoo's own construction, standardisation, data, bad cards."""

from __future__ import annotations

import pytest
import torch

from qlbench import parametric, suites, zoo

F64 = torch.float64


def test_every_suite_loads_with_tasks_paraphrases_and_a_control():
    names = suites.card_names()
    assert suites.names() == [*names, *parametric.names()]
    assert {"zoo-4", "zoo-4-same-instruction"} <= set(names)
    assert {f"shifts-{f}" for f in zoo.names()} <= set(names)
    for name in names:
        s = suites.get(name)
        assert s.name == name and len(s.tasks) == 4
        for t in s.tasks:
            assert len(t.paraphrases) >= suites.MIN_PARAPHRASES
            assert t.instruction not in t.paraphrases or name.endswith(suites.CONTROL_SUFFIX)
        instructions = set(s.instructions())
        if name.endswith(suites.CONTROL_SUFFIX):
            assert instructions == {suites.SAME_INSTRUCTION}
        else:
            assert len(instructions) == len(s.tasks)  # every task its own sentence


def test_unknown_suite_lists_the_valid_names():
    with pytest.raises(ValueError, match="unknown suite 'nope'.*zoo-4"):
        suites.get("nope")


def test_shift_tasks_are_the_source_function_translated():
    """Oracle written from the card's definition: task 'right' at x is the source function at x - width / 4."""
    s = suites.get("shifts-levy")
    x = zoo.grid(s.box, 16)  # (256, 2)
    width = s.box[1] - s.box[0]
    f = zoo.function("levy")
    for t, offset in zip(s.tasks, ([0.25, 0.0], [0.0, 0.25], [-0.25, 0.0], [0.0, -0.25])):
        expected = f(x - torch.tensor(offset, dtype=F64) * width)
        torch.testing.assert_close(t.clean(x, s.box), expected, rtol=1e-12, atol=1e-12)


def test_zoo4_tasks_are_the_cards_targets_on_a_mapped_box():
    """Each zoo-4 task is its card's single-task target (zoo.task(...).target, the zoo's own construction of the
    coefficient shift and rotation), read at the common box mapped onto the card's box."""
    s = suites.get("zoo-4")
    x = zoo.grid(s.box, 16)  # (256, 2) in [-1, 1]^2
    for t in s.tasks:
        own = torch.tensor(zoo.card(t.function).bounds, dtype=F64).T  # (2, 2)
        mapped = own[0] + (x + 1) / 2 * (own[1] - own[0])
        torch.testing.assert_close(t.clean(x, s.box), zoo.task(t.function).target(mapped), rtol=1e-12, atol=1e-9)


def test_flip_turns_the_surface_upside_down():
    s = suites.get("shifts-matyas")
    t = s.tasks[0]
    x = zoo.grid(s.box, 8)
    flipped = suites.SuiteTask(**{**t.__dict__, "flip": True})
    torch.testing.assert_close(flipped.clean(x, s.box), -t.clean(x, s.box))


@pytest.mark.parametrize("name", ["zoo-4", "shifts-styblinski-tang"])
def test_labels_are_standardised_with_noise_of_the_stated_size(name):
    """On an independent sample (uniform, 20,000 points, another seed than the grid's), every task's clean labels
    have mean about 0 and std about 1, and its noisy training labels differ from them by noise of std 0.05."""
    s = suites.get(name)
    g = torch.Generator().manual_seed(123)
    lo, hi = s.box
    x = lo + (hi - lo) * torch.rand(20_000, 2, generator=g, dtype=F64)
    for t, task in enumerate(s.tasks):
        y = s.labels(task, x)
        assert abs(y.mean().item()) < 0.05 and abs(y.std().item() - 1) < 0.05, (task.name, y.mean(), y.std())
        d = s.task_data(t, seed=0, dtype=F64)
        noise = d.y_train - s.labels(task, d.x_train)
        assert abs(noise.std().item() - zoo.NOISE_FRACTION) < 0.01, noise.std()
        assert d.x_train.shape == (zoo.TARGET_TRAIN, 2) and d.x_test.shape == (zoo.TARGET_SIZE - zoo.TARGET_TRAIN, 2)
    src = s.source_data(seed=0, dtype=F64)
    assert src.x_train.shape == (zoo.SOURCE_TRAIN, 2) and abs(src.y_train.std().item() - 1) < 0.1


def test_data_is_seeded_per_task_and_shared_with_the_control():
    s, c = suites.get("zoo-4"), suites.get("zoo-4-same-instruction")
    a, b = s.task_data(1, seed=3), s.task_data(1, seed=3)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert all(torch.equal(u, v) for u, v in zip(a, c.task_data(1, seed=3)))  # the control: the same data
    assert not torch.equal(a.x_train, s.task_data(1, seed=4).x_train)
    assert not torch.equal(a.x_train, s.task_data(2, seed=3).x_train)
    f32 = s.task_data(1, seed=3, dtype=torch.float32)
    torch.testing.assert_close(f32.y_test, s.task_data(1, seed=3, dtype=F64).y_test.float())


GOOD = """
description = "two tasks"
bounds = [[-1.0, 1.0], [-1.0, 1.0]]
[source]
function = "ackley"
[[task]]
name = "a"
function = "matyas"
instruction = "A bowl."
paraphrases = ["A basin.", "A valley."]
[[task]]
name = "b"
function = "levy"
instruction = "Ridges."
paraphrases = ["Folds.", "Crests."]
"""


def test_a_good_card_parses():
    s = suites.parse("mine", GOOD)
    assert s.task_names == ["a", "b"] and s.source.function == "ackley" and s.bounds == ((-1.0, 1.0), (-1.0, 1.0))


@pytest.mark.parametrize(
    "edit, field, words",
    [
        (lambda t: t.replace('description = "two tasks"\n', ""), "description", "missing"),
        (lambda t: t.replace('function = "levy"', 'function = "levi"'), "task[1].function", "'levi'"),
        (
            lambda t: t.replace('paraphrases = ["Folds.", "Crests."]', 'paraphrases = ["Folds."]'),
            "task[1].paraphrases",
            "at least 2",
        ),
        (lambda t: t.replace('instruction = "Ridges."\n', ""), "task[1].instruction", "missing"),
        (lambda t: t.replace('instruction = "Ridges."', 'instruction = " "'), "task[1].instruction", "non-empty"),
        (lambda t: t.replace('name = "b"', 'name = "a"'), "task", "must differ"),
        (lambda t: t.replace("[[-1.0, 1.0], [-1.0, 1.0]]", "[[1.0, -1.0], [-1.0, 1.0]]"), "bounds", "lower bound"),
        (lambda t: t.replace('name = "a"\n', 'name = "a"\nscale = 2\n'), "task[0].scale", "unknown field"),
        (lambda t: t.replace('name = "a"\n', 'name = "a"\noffset = [1]\n'), "task[0].offset", "two numbers"),
        (lambda t: t.replace('name = "a"\n', 'name = "a"\ncoefficients = "other"\n'), "task[0].coefficients", "source"),
        (lambda t: t.split('[[task]]\nname = "b"')[0], "task", "from 2 to 256"),
        (lambda t: t.replace('name = "b"', 'name = "b\\u001b[2J"'), "task[1].name", "printable"),
        (
            lambda t: t.replace('instruction = "Ridges."', 'instruction = "Ridges.\\u0007"'),
            "task[1].instruction",
            "printable",
        ),  # fmt: skip
        (lambda t: t.replace("[[-1.0, 1.0], [-1.0, 1.0]]", "[[-1e300, 1.0], [-1.0, 1.0]]"), "bounds", "within +-1000"),
        (lambda t: t.replace('name = "a"\n', 'name = "a"\noffset = [1e300, 0]\n'), "task[0].offset", "within"),
        (
            lambda t: (
                t
                + "".join(
                    f'[[task]]\nname = "t{i}"\nfunction = "matyas"\ninstruction = "A."\nparaphrases = ["B.", "C."]\n'
                    for i in range(300)
                )
            ),
            "task",
            "from 2 to 256",
        ),
        (lambda t: t + "oops = [", "TOML", ""),
    ],
)
def test_a_bad_card_names_the_suite_and_the_field(edit, field, words):
    with pytest.raises(ValueError) as err:
        suites.parse("mine", edit(GOOD))
    message = str(err.value)
    assert message.startswith(f"suite 'mine': {field}:") and words in message and "\n" not in message, message


def test_cli_lists_shows_and_checks_suites(capsys, tmp_path):
    from qlbench import cli

    assert cli.main(["suites"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split("|")[1].strip() for r in rows] == suites.names()
    assert cli.main(["suites", "shifts-ackley"]) == 0
    out = capsys.readouterr().out
    for t in suites.get("shifts-ackley").tasks:
        assert t.instruction in out and all(p in out for p in t.paraphrases)
    card = tmp_path / "mine.toml"
    card.write_text(GOOD.replace('function = "levy"', 'function = "levi"'))
    assert cli.main(["suites", "--card", str(card)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "suite 'mine': task[1].function: unknown function 'levi'" in err[0]
    card.write_text(GOOD)
    assert cli.main(["suites", "--card", str(card)]) == 0 and "Folds." in capsys.readouterr().out
