"""qlbench real-lm (qlbench/real_lm.py): the tasks by hand, the engine's loss against transformers' own, a tiny run
through the runner (records, resume, table), damaged records and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from qlbench import real_lm, runner, store  # noqa: E402

from helpers import one_line_error  # noqa: E402

TINY = real_lm.LMConfig(pretrain_samples=64, pretrain_epochs=1, train_per_task=16, test_per_task=8, epochs=1,
                        seeds=(0,))  # fmt: skip


def test_the_tasks_and_their_sequences_by_hand():
    x = np.array([[0, 1, 2, 3, 7]])
    assert real_lm.answer("reverse", x).tolist() == [[7, 3, 2, 1, 0]]
    assert real_lm.answer("shift", x).tolist() == [[1, 2, 3, 4, 0]]  # h -> a
    assert real_lm.answer("swap", x).tolist() == [[1, 0, 3, 2, 7]]
    ids = real_lm.sequences("swap", 4, 0, "train")
    assert ids.shape == (4, 13) and (ids[:, 0] == real_lm.BOS).all() and (ids[:, 6] == real_lm.SEP).all()
    assert (ids[:, -1] == real_lm.EOS).all()
    letters = ids[:, 1:6] - real_lm.FIRST
    assert torch.equal(ids[:, 7:12] - real_lm.FIRST, torch.from_numpy(real_lm.answer("swap", letters.numpy())))
    assert torch.equal(ids, real_lm.sequences("swap", 4, 0, "train"))  # seeded
    assert not torch.equal(ids, real_lm.sequences("swap", 4, 0, "test"))  # test inputs are fresh


def test_the_loss_the_engine_minimises_is_the_answer_cross_entropy():
    """mean(LMStack(x)^2) against transformers' own loss with the prompt's labels masked (-100); a slice off by one
    position would fail it."""
    model = real_lm.decoder(0)
    ids = real_lm.sequences("reverse", 8, 0, "train")
    labels = ids.clone()
    labels[:, : real_lm.PROMPT] = -100
    with torch.no_grad():
        want = model(input_ids=ids, labels=labels).loss
        got = real_lm.LMStack(model)(ids.unsqueeze(0)).pow(2).mean()
        labels[:, real_lm.PROMPT] = -100  # the planted bug: one answer token fewer
        wrong = model(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, wrong, rtol=1e-3)


def test_a_tiny_run_writes_records_resumes_and_tabulates(tmp_path):
    work = real_lm.plan(list(real_lm.METHODS), TINY, tmp_path)
    logged = []
    paths = runner.run(work, progress=False, log=logged.append)
    assert [p.stem for p in paths] == list(real_lm.METHODS)
    for p in paths:
        rec = real_lm.check_record(store.read_json(p), p)
        (seed,) = rec["per_seed"]
        assert seed["status"] == "ok" and set(seed["per_task"]) == set(real_lm.TASKS)
        assert 0 <= seed["exact_match"] <= 1 and seed["answer_ce"] > 0
        assert (seed["trainable_params"] == 0) is (rec["method"] == "base")
    logged.clear()
    runner.run(real_lm.plan(list(real_lm.METHODS), TINY, tmp_path), progress=False, log=logged.append)
    assert not any("seed" in m for m in logged)  # every record finished: nothing trains again
    table, legend = real_lm.table(paths)
    assert list(table["method"]) == list(real_lm.METHODS) and "instruction alone" in legend
    assert table.set_index("method").loc["lora", "vs LoRA"] == "-"


def test_a_damaged_record_is_set_aside_and_recomputed(tmp_path):
    work = real_lm.plan(["lora"], TINY, tmp_path)
    path = work.unit_path("lora")
    path.parent.mkdir(parents=True)
    path.write_text('{"config_hash": "x", "per_seed": [{"seed": 0}]}')
    with pytest.raises(store.DamagedFile, match="without seed, status or every task"):
        real_lm.check_record(store.read_json(path), path)
    logged = []
    runner.run(work, progress=False, log=logged.append)
    assert real_lm.check_record(store.read_json(path), path)["per_seed"][0]["status"] == "ok"
    assert any("damaged" in m for m in logged)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["real-lm", "--methods", "lora,gpt"], ["unknown method gpt", "valid: base"]),
        (["real-lm", "--seeds", "0"], ["--seeds must be an integer from 1 to 100"]),
        (["real-lm", "--methods", "lora,lora"], ["listed twice"]),
        (["real-lm", "--epochs", "0"], ["epochs"]),
        (["real-lm", "--device", "tpu"], ["unknown device 'tpu'", "valid: auto, cpu, cuda"]),
        pytest.param(
            ["real-lm", "--device", "cuda"],
            ["CUDA is not available", "valid: auto, cpu"],
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: --device cuda is valid"),
        ),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, tmp_path, argv, words):
    line = one_line_error(capsys, [*argv, "--out", str(tmp_path / "out")])
    for word in words:
        assert word in line, line
    assert not (tmp_path / "out").exists()
