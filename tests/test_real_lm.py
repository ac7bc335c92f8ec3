"""qlbench real-lm (qlbench/experiments/real_lm.py): the tasks and both sequence layouts by hand, the engine's loss
against transformers' own on both, lora-matched's rank against a hand count, a tiny run of every method through the
runner (records, resume, table), damaged records and bad input."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from qlbench.experiments import real_lm, runner  # noqa: E402
from qlbench.records import store  # noqa: E402
from qlbench.settings import Execution  # noqa: E402

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


def test_the_instructed_layout_by_hand():
    """BOS, the instruction's words (PAD after them up to the longest instruction), the letters, SEP, the answer,
    EOS; the same letters as the plain layout; the three tasks' prompts differ in the instruction alone."""
    assert real_lm.words("Replace every letter by the next one in the alphabet, h by a.") == [
        "replace", "every", "letter", "by", "the", "next", "one", "in", "the", "alphabet", "h", "by", "a"]  # fmt: skip
    assert len(real_lm.WORDS) == 23 and real_lm.SAID == 13 and real_lm.VOCAB == 4 + 8 + 23
    assert TINY.key()["vocab_size"] == 35  # in the record's hash: a 12-token decoder's record is not resumed
    word = lambda w: real_lm.FIRST + real_lm.LETTERS + real_lm.WORDS.index(w)  # after PAD BOS SEP EOS and a..h
    said = ["write", "the", "letters", "in", "reverse", "order"]
    ids = real_lm.sequences("reverse", 4, 0, "train", instructed=True)
    assert ids.shape == (4, 26) and (ids[:, 0] == real_lm.BOS).all()
    assert ids[0, 1:7].tolist() == [word(w) for w in said] and (ids[:, 7:14] == real_lm.PAD).all()
    plain = real_lm.sequences("reverse", 4, 0, "train")
    assert torch.equal(ids[:, 14:19], plain[:, 1:6]) and (ids[:, 19] == real_lm.SEP).all()  # the same letters
    assert torch.equal(ids[:, 20:], plain[:, 7:]) and (ids[:, -1] == real_lm.EOS).all()  # the answer, EOS
    swap = real_lm.sequences("swap", 1, 0, "train", instructed=True)[0]
    assert swap[1:14].tolist()[-3:] == [word("last"), real_lm.PAD, real_lm.PAD]  # 11 words, 2 PAD
    prompts = {t: real_lm.sequences(t, 4, 0, "train", instructed=True)[:, :20] for t in real_lm.TASKS}
    for t, prompt in prompts.items():  # each task's letters are its plain layout's (which cannot tell tasks apart)
        assert torch.equal(prompt[:, 14:19], real_lm.sequences(t, 4, 0, "train")[:, 1:6])
    for a, b in itertools.combinations(prompts.values(), 2):  # around the letters, only the instruction differs
        assert torch.equal(a[:, [0, 19]], b[:, [0, 19]]) and (a[:, 1:14] != b[:, 1:14]).any(1).all()
        assert torch.equal(a[:, 1:14], a[:1, 1:14].expand(4, -1))  # one instruction per task
    with pytest.raises(ValueError, match="has no instruction"):
        real_lm.sequences("copy", 2, 0, "train", instructed=True)


@pytest.mark.parametrize("instructed", [False, True], ids=["plain", "instructed"])
def test_the_loss_the_engine_minimises_is_the_answer_cross_entropy(instructed):
    """mean(LMStack(x)^2) against transformers' own loss with the prompt's labels masked (-100), on both layouts
    (the prompt 7 tokens, or 20 with the instruction's words); a slice off by one position would fail it."""
    model = real_lm.decoder(0)
    ids = real_lm.sequences("reverse", 8, 0, "train", instructed=instructed)
    prompt = 20 if instructed else 7  # BOS (13 word slots) x1..x5 SEP, counted by hand
    assert ids.shape[1] == prompt + real_lm.ANSWER
    labels = ids.clone()
    labels[:, :prompt] = -100
    with torch.no_grad():
        want = model(input_ids=ids, labels=labels).loss
        got = real_lm.LMStack(model)(ids.unsqueeze(0)).pow(2).mean()
        labels[:, prompt] = -100  # the planted bug: one answer token fewer
        wrong = model(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, wrong, rtol=1e-3)


def test_lora_matched_takes_the_rank_nearest_instruct_queryables_count():
    """LoRA on 2 layers x {q_proj, v_proj} of width 64: A (r, 64) and B (64, r) each, 2*2*r*(64+64) = 512 r
    trainable parameters, counted here on peft's model at two ranks; the matched rank is the nearest multiple of
    512 to instruct-queryable's count (ties: the smaller), and lora-matched trains that many."""
    import peft

    count = lambda model: sum(p.numel() for p in model.parameters() if p.requires_grad)
    for r in (1, 3):
        assert count(peft.get_peft_model(real_lm.decoder(0), real_lm.lora(r))) == 2 * 2 * r * (64 + 64) == 512 * r
    target = count(real_lm.adapted("instruct-queryable", real_lm.decoder(0), TINY))
    want = min(range(1, 200), key=lambda r: (abs(512 * r - target), r))
    assert real_lm.matched_rank(TINY) == want and abs(512 * want - target) <= 256
    assert count(real_lm.adapted("lora-matched", real_lm.decoder(0), TINY)) == 512 * want
    torch.manual_seed(3)
    before = torch.rand(4)
    torch.manual_seed(3)
    real_lm.matched_rank.cache_clear()
    real_lm.matched_rank(TINY)  # counted on decoders of its own: torch's generator left as it was
    assert torch.equal(torch.rand(4), before)


def test_a_tiny_run_writes_records_resumes_and_tabulates(tmp_path):
    work = real_lm.plan(list(real_lm.METHODS), TINY, Execution(out_dir=tmp_path, device="cpu"))
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
    runner.run(
        real_lm.plan(list(real_lm.METHODS), TINY, Execution(out_dir=tmp_path, device="cpu")),
        progress=False,
        log=logged.append,
    )
    assert not any("seed" in m for m in logged)  # every record finished: nothing trains again
    table, legend = real_lm.table(paths)
    assert list(table["method"]) == list(real_lm.METHODS) and "instruction alone" in legend
    assert list(table.columns[1:3]) == ["trainable", "× LoRA"]
    rows = table.set_index("method")
    assert rows.loc["lora", "vs LoRA"] == "-" and rows.loc["base", "vs LoRA"] == "-"
    ratio = rows["× LoRA"]
    assert ratio["lora"] == "1.00" == ratio["lora-prompt"] and ratio["base"] == "-"
    assert abs(float(ratio["lora-matched"]) - float(ratio["instruct-queryable"])) <= 256 / 4096  # half a rank
    assert "lora-prompt reads the instruction's words" in legend and "outside the Holm family" in legend


def test_a_damaged_record_is_set_aside_and_recomputed(tmp_path):
    work = real_lm.plan(["lora"], TINY, Execution(out_dir=tmp_path, device="cpu"))
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
        (["real-lm", "--methods", "lora,lora"], ["given twice"]),
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
