"""instruct-queryable end to end: each member routes with its own function's e(c), the instruction changes the
output (queryable's does not), `run --instruction`, the ablation's variants, and `qlbench verify` on a trained
instruct-queryable cell (its Lipschitz rows are no longer vacuous)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from qlbench import adapters, cli, instructions, zoo
from qlbench.adapters import instruct
from qlbench.backbones import build_backbone
from qlbench.experiments import ablation, adapted
from qlbench.records import results
from qlbench.settings import Execution, Protocol

from helpers import F64, TINY_DEEP_NARROW, gens, one_line_error

METHOD = adapters.get("instruct-queryable")


def e_of(members, **overrides) -> torch.Tensor:
    return METHOD.instructions(members, METHOD.make_config(**overrides))  # (E, d_c)


def test_the_projection_has_orthonormal_rows_scaled_to_keep_norms():
    P = instruct.projection(384, 8, torch.zeros((), dtype=F64))  # (8, 384)
    torch.testing.assert_close(P @ P.T, 48 * torch.eye(8, dtype=F64), rtol=0, atol=1e-10)


def test_the_router_reads_the_encoders_own_embedding_by_default():
    """The paper's path: d_c = 384 and e(c) is MiniLM's embedding itself (the old default squeezed it to 8
    numbers through a frozen projection); Q_ctx and R_ctx are learned on all 384 dimensions."""
    assert METHOD.make_config().instruction_dim == instructions.DIM == 384
    members = [("dropwave", 0), ("levy", 0), ("dropwave", 1)]
    e = e_of(members)
    cards = instructions.embed([zoo.card(f).instruction for f, _ in members]).to(F64)  # (3, 384)
    torch.testing.assert_close(e, cards, rtol=0, atol=0)
    torch.testing.assert_close(e[0], e[2])  # same function, other seed: the same sentence
    assert (e[0] - e[1]).norm() > 0.1 * e[0].norm()  # another function: another instruction
    from qlbench.backbones import DeepNarrowMLP

    model = METHOD.build(
        DeepNarrowMLP(gens("bb", members=[0]), TINY_DEEP_NARROW, dtype=F64),
        METHOD.make_config(n_blocks=2),
        gens("init", members=[0]),
        torch.zeros(1, 1, dtype=F64),
    )
    memory = model.shared["queryable"]
    d_k = memory.keys.shape[-1]
    assert memory.Q_ctx.shape == memory.R_ctx.shape == (1, d_k, 384)
    assert memory.Q_ctx.requires_grad and memory.R_ctx.requires_grad


def test_the_compressed_path_projects_the_embedding():
    members = [("dropwave", 0), ("levy", 0)]
    e = e_of(members, instruction_dim=8)
    P = instruct.projection(384, 8, e)
    cards = instructions.embed([zoo.card(f).instruction for f, _ in members]).to(F64)  # (2, 384)
    torch.testing.assert_close(e, cards @ P.T, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bad", [0, 385, 8.0])
def test_instruction_dim_must_be_a_size_up_to_the_encoders(bad):
    with pytest.raises(ValueError, match=r"instruction_dim must be an integer"):
        METHOD.make_config(instruction_dim=bad)


def test_the_compressed_path_distorts_the_cards_cosines_and_the_full_path_does_not():
    """Oracle: the cosine matrix recomputed here with numpy from the embeddings and the projection. Measured
    finding: squeezed to 8 numbers, some card sentences that the encoder finds alike (every pair's cosine is
    positive) look opposite to the router."""
    import numpy as np

    raw = instructions.embed([zoo.card(f).instruction for f in zoo.names()]).to(F64).numpy()  # (9, 384)
    P = instruct.projection(384, 8, torch.zeros((), dtype=F64)).numpy()  # (8, 384)
    cos = lambda m: (m / np.linalg.norm(m, axis=1, keepdims=True)) @ (m / np.linalg.norm(m, axis=1, keepdims=True)).T
    i, j = np.triu_indices(9, 1)
    before, after = cos(raw)[i, j], cos(raw @ P.T)[i, j]
    assert (before > 0).all()
    d8 = instruct.cosine_distortion(8)
    assert d8["max_abs_change"] == pytest.approx(np.abs(before - after).max(), abs=1e-6)
    assert d8["sign_flips"] == pytest.approx(np.mean(after <= 0), abs=1e-9) and d8["sign_flips"] > 0
    assert instruct.cosine_distortion(384) == dict(max_abs_change=0.0, mean_abs_change=0.0, sign_flips=0.0)


def test_sources_pick_the_documented_sentences():
    names = zoo.names()
    shuffled = instruct.sentences(names, METHOD.make_config(instruction_source="shuffled"))
    own = [zoo.card(f).instruction for f in names]
    assert sorted(shuffled) == sorted(own) and all(s != o for s, o in zip(shuffled, own))  # a derangement
    adversarial = instruct.sentences(names, METHOD.make_config(instruction_source="adversarial"))
    assert all(a and a != o for a, o in zip(adversarial, own))
    generic = instruct.sentences(names, METHOD.make_config(instruction_source="generic"))
    assert set(generic) == {instructions.GENERIC_INSTRUCTION}
    text = instruct.sentences(names[:2], METHOD.make_config(instruction="a bumpy bowl"))
    assert text == ["a bumpy bowl", "a bumpy bowl"]


def test_the_random_instruction_is_seeded_with_the_card_embeddings_norm():
    members = [("ackley", 0), ("matyas", 0)]
    a, b = e_of(members, instruction_source="random"), e_of(members, instruction_source="random")
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # seeded
    card = e_of(members)
    assert torch.all((a - card).norm(dim=1) > 0.1 * card.norm(dim=1))


@pytest.mark.parametrize("name", ["queryable", "instruct-queryable"])
def test_the_instruction_changes_the_output_only_with_the_channels_on(name):
    from qlbench.backbones import DeepNarrowMLP

    members = [0, 1]
    method = adapters.get(name)
    config = method.make_config(n_blocks=2, instruction_dim=8)
    bb = DeepNarrowMLP(gens("bb", members=members), TINY_DEEP_NARROW, dtype=F64)
    model = method.build(bb, config, gens("init", members=members), torch.zeros(2, 1, dtype=F64))
    with torch.no_grad():  # move off the zero-update start so routing reaches the output
        for n, p in model.named_parameters():
            if p.requires_grad and n.endswith(("_B", "_eta", "atoms")):
                p.normal_(0, 0.5, generator=gens("move", members=1)[0])
    x = torch.rand(2, 32, 2, generator=gens("x", members=1)[0], dtype=F64)
    outputs = []
    for tag in ("e", "e2"):
        e = torch.stack([torch.randn(8, generator=g, dtype=F64) for g in gens(tag, members=members)])
        model.shared[method.family].bind_instruction(e)
        with torch.no_grad():
            outputs.append(model(x))
    change = (outputs[0] - outputs[1]).abs().max().item()
    if name == "queryable":
        assert change == 0.0  # tau_lang = lambda_ctx = 0: routing ignores e
    else:
        assert change > 1e-6


def test_every_ablation_variant_has_the_same_trainable_parameters(tmp_path):
    plans = ablation.plans(
        function="matyas",
        protocol=Protocol(arch="deep-narrow", budget="smoke", seeds=2),
        execution=Execution(out_dir=tmp_path),
    )
    assert list(plans) == list(ablation.VARIANTS)
    counts, hashes = set(), set()
    for plan in plans.values():
        config = plan.configs[ablation.METHOD]
        bb = build_backbone("deep-narrow", [("matyas", 0)], device="meta")
        model = METHOD.build(bb, config, gens("x", members=1), torch.zeros(1, 1, device="meta"))
        counts.add(sum(p.numel() for p in model.parameters() if p.requires_grad))
        hashes.add(plan.record_path("matyas", ablation.METHOD).name)
    assert counts == {30_048} and len(hashes) == len(ablation.VARIANTS)  # one parameter count, eight cells


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["run", "--function", "dropwave", "--instruction", " "], ["--instruction", "empty"]),
        (["run", "--function", "dropwave", "--instruction", "x", "--methods", "lora"], ["instruct-queryable"]),
        (["verify", "--method", "lora"], ["queryable", "instruct-queryable", "'lora'"]),
        (["ablate", "--function", "nope"], ["'nope'", "dropwave"]),
        (["ablate", "--function", "matyas", "--budget", "huge"], ["'huge'", "smoke"]),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, expect):
    line = one_line_error(capsys, argv)
    for word in expect:
        assert word in line, line


def test_run_instruction_then_verify_the_trained_instruct_queryable_cell(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("QLBENCH_CACHE", str(tmp_path / "cache"))
    sentence = "a surface with a single narrow spike"
    args = ["run", "--function", "matyas", "--budget", "smoke", "--methods", "instruct-queryable", "--no-progress"]
    assert cli.main([*args, "--out", str(tmp_path), "--instruction", sentence]) == 0
    (record,) = results.find_records(tmp_path)
    rec = json.loads(record.read_text())
    assert rec["run_info"]["config"]["method_config"]["instruction"] == sentence
    assert rec["run_info"]["config"]["method_config"]["instruction_source"] == "text"
    capsys.readouterr()

    out = tmp_path / "verify.json"
    argv = ["verify", "--results", str(tmp_path), "--method", "instruct-queryable", "--out", str(out)]
    assert cli.main(argv) == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    assert report["method"] == "instruct-queryable" and "own e(c)" in report["instruction"]
    assert report["violated"] == 0
    lipschitz = [r for r in report["statements"] if r["label"] in ("prop:app_summary_lipschitz",)]
    assert lipschitz and all(r["observed"] > 0 and "vacuous" not in (r.get("note") or "") for r in lipschitz)

    # the trained model's bound e is the embedding of that sentence, not the card's
    model, _, _ = adapted.load_adapted(record)
    want = instructions.embed([sentence]).to(F64)  # (1, 384)
    got = model.shared["queryable"].instruction.to(F64)  # (E, 384)
    assert got.shape[0] == 2 and math.isclose((got - want).abs().max().item(), 0, abs_tol=1e-5)


def test_ablate_prints_a_row_per_variant_and_stores_every_cell(capsys, tmp_path, monkeypatch):
    variants = {k: ablation.VARIANTS[k] for k in ("no-instruction", "card", "shuffled", "instruction-only")}
    monkeypatch.setattr(ablation, "VARIANTS", variants)
    argv = ["ablate", "--function", "matyas", "--budget", "smoke", "--seeds", "3", "--out", str(tmp_path)]
    assert cli.main([*argv, "--no-progress"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "variant" not in line]
    assert [r.split("|")[1].strip() for r in rows] == list(variants)
    assert all("30,048" in r or "30048" in r for r in rows)
    assert all("p = " in r for r in rows if "| card" not in r)  # paired difference to the card's instruction
    assert "One task: e(c) is the same for every sample" in out  # what a single-task ablation cannot show
    frame = results.load(tmp_path)
    assert len(set(frame["config_hash"])) == len(variants) and set(frame["status"]) == {"ok"}


def test_ablation_table_adjusts_p_over_every_variant_against_the_card(monkeypatch):
    """Hand-made records, no training: `shuffled` is above the card on every seed (differences 0.5, 0.4, 0.7 on
    test MSE at the best-train epoch), paired t p = 0.0263. Alone against the card its Holm p is that p; beside
    `random` (differences 0.1, -0.2, 0.15, p = 0.89) the table's family is 2 and its Holm p 2 x 0.0263 = 0.053,
    not significant though the raw p is below 0.05."""
    card, higher, null = [1.0, 2.0, 3.0], [1.5, 2.4, 3.7], [1.1, 1.8, 3.15]

    def load(paths):
        return pd.DataFrame(
            dict(record=str(path), arch="deep-narrow", budget="smoke", function="matyas", method=ablation.METHOD,
                 seed=s, status="ok", trainable_params=30_048, best_train_mse=v, best_test_mse=v, test_at_best_train=v)
            for path in paths
            for s, v in enumerate({"card": card, "shuffled": higher, "random": null}[Path(path).stem])
        )  # fmt: skip

    monkeypatch.setattr(ablation.results, "load", load)
    monkeypatch.setattr(ablation, "evaluation_time", lambda path: (0.1, 1e-6))
    records = {name: Path(f"{name}.json") for name in ("card", "shuffled", "random")}
    alone = ablation.table({k: records[k] for k in ("card", "shuffled")}).set_index("variant")
    assert alone.loc["shuffled", "diff vs card [95% CI], p"].endswith("p = 0.026")
    assert alone.loc["shuffled", "Holm p"] == "0.026" and alone.loc["card", "Holm p"] == "-"
    table = ablation.table(records)
    shown = table.set_index("variant")
    assert shown.loc["shuffled", "diff vs card [95% CI], p"].endswith("p = 0.026")
    assert shown.loc["shuffled", "Holm p"] == "0.053" and shown.loc["random", "Holm p"] == "0.89"
    assert "Holm-adjusted over the table's 2 comparisons with card" in ablation.legend(table)


def test_ablation_variants_are_named_for_what_they_remove():
    """`no-language-prior` drops the language prior only (the instruction still enters the query); the paper's
    "state-query-only" router drops both, which is `no-instruction`."""
    assert "no-prior" not in ablation.VARIANTS
    assert ablation.VARIANTS["no-language-prior"] == dict(tau_lang=0.0)
    assert ablation.VARIANTS["no-instruction"] == dict(tau_lang=0.0, lambda_ctx=0.0)


def test_a_stack_of_functions_binds_each_members_own_instruction():
    from qlbench import engine

    members = [("matyas", 0), ("levy", 0), ("matyas", 1), ("dropwave", 0)]
    pre = engine.pretrain(engine.Backbones("deep-narrow", engine.Phase(1, 1e-3), F64), members, device="cpu")
    model, _ = engine.build_model(pre, METHOD.name, METHOD.make_config(), device="cpu", dtype=F64)
    bound = model.shared["queryable"].instruction  # (4, 384)
    for row, (function, _) in zip(bound, members):
        want = instructions.embed([zoo.card(function).instruction]).to(F64)[0]
        torch.testing.assert_close(row, want, rtol=0, atol=1e-6)
