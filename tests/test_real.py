"""`qlbench real`: the generated instructed tasks (against a parse of their own text), and a tiny end-to-end run
through the CLI (records, resume, report). Skipped without the hf extra."""

from __future__ import annotations

import json
import re
import shutil

import pytest

pytest.importorskip("peft")

from qlbench import cli  # noqa: E402
from qlbench.experiments import real, runner
from qlbench.records import store
from qlbench.settings import Execution

# General knowledge, written here apart from qlbench/experiments/real.py's tables: the yes answers.
MAMMALS = {"cat", "dog", "horse", "whale", "mouse", "bat"}
WARM = {"red", "orange", "yellow", "pink", "gold", "crimson"}
EUROPE = {"Paris", "Rome", "Berlin", "Madrid", "Oslo", "Vienna"}
QUESTIONS = {"Is the animal a mammal?": 0, "Is the colour a warm colour?": 1, "Is the city in Europe?": 2}


def parse(text: str) -> tuple[int, tuple[str, str, str]]:
    """(asked slot, (animal, colour, city)) read back from a sample's text."""
    m = re.fullmatch(r"(Is the .+\?) The (\w+) sat near a (\w+) car in (\w+)\.", text)
    return QUESTIONS[m.group(1)], (m.group(2), m.group(3), m.group(4))


def test_every_label_answers_the_question_about_the_asked_word():
    texts, tasks, labels = real.sentences(60, seed=3, split="train")
    assert len(texts) == 180 and sorted(set(tasks)) == [0, 1, 2]
    for text, task, label in zip(texts, tasks, labels):
        asked, words = parse(text)
        assert asked == task
        assert label == (1.0 if words[task] in (MAMMALS, WARM, EUROPE)[task] else -1.0), text
    for task in range(3):  # balanced: a constant prediction scores 1
        assert sum(label for t, label in zip(tasks, labels) if t == task) == 0


def test_the_sentences_are_seeded_and_the_splits_differ():
    assert real.sentences(5, 0, "train") == real.sentences(5, 0, "train")
    assert real.sentences(5, 0, "train")[0] != real.sentences(5, 0, "test")[0]
    assert real.sentences(5, 0, "train")[0] != real.sentences(5, 1, "train")[0]


def test_only_the_instruction_tells_the_tasks_apart():
    """Without its instruction a sentence does not say which word is asked about: the same sentence, under two
    questions, has two different answers somewhere in the data (the tasks share one sentence distribution)."""
    texts, tasks, labels = real.sentences(300, seed=0, split="train")
    answers: dict[tuple, set] = {}
    for text, label in zip(texts, labels):
        answers.setdefault(parse(text)[1], set()).add(label)
    assert any(len(v) == 2 for v in answers.values())


def test_bad_input_is_one_line_and_exit_2(capsys):
    for argv, words in [
        (["real", "--methods", "moe"], "valid: head-only, lora, lora-matched, queryable, instruct-queryable"),
        (["real", "--threads", "999"], "threads must be an integer from 1 to"),
        (["real", "--seeds", "0"], "--seeds must be an integer from 1 to 100"),
        (["real", "--epochs", "0"], "epochs must be an integer >= 1"),
    ]:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, err


DAMAGED_ADAPTER = {  # how -> what the one line says
    "truncated weights": "cannot be loaded",
    "random weights": "cannot be loaded",
    "empty weights": "cannot be loaded",
    "no weights": "no adapter_model.safetensors",
    "unknown peft_type": "'NOPE' adapter config",
    "config a list": "is damaged (a JSON list",
    "edited r": "cannot be loaded",
}


def damage_adapter(folder, how: str) -> None:
    weights, config = folder / "adapter_model.safetensors", folder / "adapter_config.json"
    if how == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:100])
    elif how == "random weights":
        weights.write_bytes(bytes(range(256)) * 8)
    elif how == "empty weights":
        weights.write_bytes(b"")
    elif how == "no weights":
        weights.unlink()
    else:
        saved = json.loads(config.read_text())
        if how == "unknown peft_type":
            saved["peft_type"] = "NOPE"
        elif how == "config a list":
            saved = [saved]
        else:
            saved["r"] = 2 * saved["r"]  # the weights' shapes no longer match
        config.write_text(json.dumps(saved))


@pytest.mark.slow  # 29 s on 2 cores: under -m slow (CI), so the default suite stays within about 10 minutes
def test_a_tiny_run_writes_records_resumes_and_reports(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QLBENCH_CACHE", str(tmp_path / "cache"))  # the instructions' embeddings, not in ~/.cache
    argv = ["real", "--methods", "lora,instruct-queryable", "--seeds", "1", "--epochs", "1", "--train-per-task", "4"]
    argv += ["--out", str(tmp_path), "--no-progress"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "instruct-queryable" in out and "records and report in" in out
    (folder,) = (tmp_path / "real").iterdir()
    for method in ("lora", "instruct-queryable"):
        rec = store.read_json(folder / f"{method}.json")
        assert [s["seed"] for s in rec["per_seed"]] == [0] and rec["per_seed"][0]["status"] == "ok"
        assert set(rec["per_seed"][0]["test_mse_per_task"]) == set(real.TASKS)
    assert {p.name for p in folder.iterdir()} >= {"real.md", "real.csv", "real.png", "real.pdf"}

    def refuse(*args, **kwargs):
        raise AssertionError("a finished (method, seed) was trained again")

    monkeypatch.setattr(real, "train_one", refuse)
    assert cli.main(argv) == 0  # resumed: everything on record
    capsys.readouterr()

    # the saved instruct-queryable adapter, checked by qlbench verify on its base model (the bundled MiniLM)
    adapter = folder / "adapters" / "instruct-queryable-seed0"
    assert (adapter / "adapter_config.json").is_file() and not (folder / "adapters" / "lora-seed0").exists()
    assert cli.main(["verify", "--peft", str(adapter)]) == 0
    out = capsys.readouterr().out
    assert "prop:app_convex_hull_bound" in out and "VIOLATED" not in out
    assert store.read_json(adapter / "verify.json")["violated"] == 0
    assert cli.main(["verify", "--peft", str(tmp_path)]) == 2
    assert "not a peft adapter folder" in capsys.readouterr().err
    for how, words in DAMAGED_ADAPTER.items():  # each one line and exit 2, never a traceback nor the hub
        broken = tmp_path / f"broken-{how.replace(' ', '-')}"
        shutil.copytree(adapter, broken)
        damage_adapter(broken, how)
        assert cli.main(["verify", "--peft", str(broken)]) == 2, how
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (how, err)

    # qlbench report has a section for them; a damaged record is said and skipped, never a traceback
    (folder / "queryable.json").write_text("{not json")
    assert cli.main(["report", str(tmp_path), "--out", str(tmp_path / "report")]) == 0
    captured = capsys.readouterr()
    assert "On a real model" in captured.out and "queryable.json: unreadable real-model record" in captured.err
    assert len(captured.err.strip().splitlines()) == 1, captured.err  # the real records are not cell records
    assert (tmp_path / "report" / "real" / folder.name / "real.png").is_file()


def test_lora_matched_is_lora_of_instruct_queryables_size():
    """On the real model the size control is peft's LoRA at the rank whose encoder count is nearest
    instruct-queryable's (r = 9: 82,944 against 87,356; LoRA r = 8: 73,728, 0.84 times), with LoRA's alpha = 2 r."""
    config = real.RealConfig()
    methods = ("lora", "lora-matched", "instruct-queryable")
    sizes = {m: real.trainable(real.build(m, config, 0).encoder) for m in methods}
    assert real.matched_rank(config) == 9
    assert abs(sizes["lora-matched"] / sizes["instruct-queryable"] - 1) <= 0.10
    assert abs(sizes["lora"] / sizes["instruct-queryable"] - 1) > 0.10
    assert sizes["lora-matched"] == 9 * sizes["lora"] // 8  # LoRA's count is linear in r


def test_the_runner_completes_a_record_keeps_its_seeds_and_leaves_a_locked_method(tmp_path, monkeypatch):
    """real runs through qlbench.experiments.runner: a record missing seeds is completed (the seeds it held kept), a
    damaged one is set aside and retrained, a method another process holds is left to it."""
    trained = []

    def fake(method, config, seed, *args):
        trained.append((method, seed))
        return {"seed": seed, "status": "ok", "test_mse": float(seed), "trainable_params": 1,
                "test_mse_per_task": dict.fromkeys(real.TASKS, float(seed))}  # fmt: skip

    monkeypatch.setattr(real, "train_one", fake)
    one, three = real.RealConfig(epochs=1, seeds=(0,)), real.RealConfig(epochs=1, seeds=(0, 1, 2))
    runner.run(real.plan(["lora"], one, Execution(out_dir=tmp_path, device="cpu")))
    runner.run(real.plan(["lora"], three, Execution(out_dir=tmp_path, device="cpu")))
    path = real.record_path(tmp_path, three, "lora")
    assert trained == [("lora", 0), ("lora", 1), ("lora", 2)]
    assert [s["seed"] for s in store.read_json(path)["per_seed"]] == [0, 1, 2]
    runner.run(
        real.plan(["lora"], real.RealConfig(epochs=1, seeds=(3,)), Execution(out_dir=tmp_path, device="cpu"))
    )  # another seed: added,
    assert trained[3:] == [("lora", 3)] and [s["seed"] for s in store.read_json(path)["per_seed"]] == [0, 1, 2, 3]
    runner.run(
        real.plan(["lora"], one, Execution(out_dir=tmp_path, device="cpu"))
    )  # and a run of seeds on record trains nothing
    assert len(trained) == 4

    path.write_text('{"config_hash": "x"}')  # damaged: no per-seed list
    messages = []
    runner.run(real.plan(["lora"], one, Execution(out_dir=tmp_path, device="cpu")), log=messages.append)
    assert trained[4:] == [("lora", 0)]
    assert any("is damaged" in m and m.endswith("the method is recomputed") for m in messages)
    assert list(path.parent.glob("lora.json.damaged-*"))

    with store.claim([real.record_path(tmp_path, three, "queryable")]):  # another process trains it
        messages = []
        runner.run(real.plan(["queryable"], three, Execution(out_dir=tmp_path, device="cpu")), log=messages.append)
    assert trained[5:] == [] and "1 method(s) are being trained by another process: left to it" in messages
