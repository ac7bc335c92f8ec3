"""`qlbench real`: the generated instructed tasks (against a parse of their own text), and a tiny end-to-end run
through the CLI (records, resume, report). Skipped without the hf extra."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("peft")

from qlbench import cli, real, store  # noqa: E402


def parse(text: str) -> tuple[str, dict[str, int]]:
    """(asked fruit, {fruit: count}) read back from a sample's text."""
    asked = re.match(r"How many (\w+) were bought\?", text).group(1)
    return asked, {fruit: int(n) for n, fruit in re.findall(r"(\d+) (apples|pears|plums)", text)}


def test_every_label_is_the_asked_count_read_back_from_the_text():
    texts, tasks, labels = real.sentences(50, seed=3, split="train")
    assert len(texts) == 150 and sorted(set(tasks)) == [0, 1, 2]
    for text, task, label in zip(texts, tasks, labels):
        asked, counts = parse(text)
        assert asked == real.FRUITS[task] and sorted(counts) == sorted(real.FRUITS)
        assert label == pytest.approx((counts[asked] - real.MEAN) / real.STD)


def test_the_sentences_are_seeded_and_the_splits_differ():
    assert real.sentences(5, 0, "train") == real.sentences(5, 0, "train")
    assert real.sentences(5, 0, "train")[0] != real.sentences(5, 0, "test")[0]
    assert real.sentences(5, 0, "train")[0] != real.sentences(5, 1, "train")[0]


def test_only_the_instruction_tells_the_tasks_apart():
    """Without its instruction a sentence says nothing of which count is asked: the three tasks' sentences come
    from one distribution (every fruit in every position), so the same sentence can carry any task's label."""
    texts, tasks, _ = real.sentences(300, seed=0, split="train")
    for task in range(3):
        firsts = {re.search(r"bought \d+ (\w+)", t).group(1) for t, k in zip(texts, tasks) if k == task}
        assert firsts == set(real.FRUITS)


def test_bad_input_is_one_line_and_exit_2(capsys):
    for argv, words in [
        (["real", "--methods", "moe"], "valid: head-only, lora, queryable, instruct-queryable"),
        (["real", "--threads", "999"], "--threads must be from 1 to"),
        (["real", "--seeds", "0"], "--seeds must be an integer >= 1"),
        (["real", "--epochs", "0"], "epochs must be an integer >= 1"),
    ]:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, err


def test_a_tiny_run_writes_records_resumes_and_reports(tmp_path, capsys, monkeypatch):
    argv = ["real", "--methods", "lora,instruct-queryable", "--seeds", "1", "--epochs", "1", "--train-per-task", "4"]
    argv += ["--out", str(tmp_path), "--no-progress"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "instruct-queryable" in out and "records and report in" in out
    (folder,) = (tmp_path / "real").iterdir()
    for method in ("lora", "instruct-queryable"):
        rec = store.read_json(folder / f"{method}.json")
        assert [s["seed"] for s in rec["per_seed"]] == [0] and rec["per_seed"][0]["status"] == "ok"
        assert set(rec["per_seed"][0]["test_mse_per_task"]) == set(real.FRUITS)
    assert {p.name for p in folder.iterdir()} >= {"real.md", "real.csv", "real.png", "real.pdf"}

    def refuse(*args, **kwargs):
        raise AssertionError("a finished (method, seed) was trained again")

    monkeypatch.setattr(real, "train_one", refuse)
    assert cli.main(argv) == 0  # resumed: everything on record
