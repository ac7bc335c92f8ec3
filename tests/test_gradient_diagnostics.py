"""Gradient diagnostics (qlbench/gradients.py): per-layer adapter gradient norms per member against a plain
per-member autograd oracle, the concentration index, training numbers unchanged by recording them, and the
record fields they live in (old records still load)."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from qlbench import adapters, engine, gradients
from qlbench.backbones import DeepNarrowMLP, RegressionTransformer
from qlbench.experiments import experiment, runner
from qlbench.records import results
from qlbench.seeding import generator
from qlbench.settings import Execution, Protocol

from helpers import F64, TINY_DEEP_NARROW, TINY_TRANSFORMER, gens

MEMBERS = [("dropwave", 0), ("dropwave", 1), ("levy", 0)]
ORACLE_METHODS = ["lora", "queryable", "instruct-queryable", "replora", "hyra", "doran", "full-adamw"]


def build(method_name: str, arch: str = "deep-narrow"):
    """A tiny float64 stack of 3 members with `method` built on it, trained 3 steps so that every factor (LoRA's
    B included) is non-zero, and one batch (E, 16, 2), (E, 16)."""
    g = gens(method_name, arch, members=3)
    if arch == "deep-narrow":
        backbone = DeepNarrowMLP(g, TINY_DEEP_NARROW, dtype=F64)
    else:
        backbone = RegressionTransformer(g, TINY_TRANSFORMER, dtype=F64)
    method = adapters.get(method_name)
    config = method.make_config(**({"n_blocks": 2} if "queryable" in method_name else {}))
    data = engine.StackedData.build(MEMBERS, "target", device="cpu", dtype=F64)
    model = method.build(backbone, config, g, data.y_train)
    method.bind(model, MEMBERS, config)
    opt = method.optimizer(model, config, 1e-2, 0.0)
    step = engine.make_step(model, opt)
    for i in range(3):
        step(data.x_train[:, 16 * i : 16 * (i + 1)], data.y_train[:, 16 * i : 16 * (i + 1)])
    return model, opt, data.x_train[:, 100:116], data.y_train[:, 100:116]


def layer_params(model, method_name: str, layer: int) -> list[tuple[torch.Tensor, int | None]]:
    """Written out per method, not derived from names: (parameter, slot) of one layer's adapter; slot = the layer's
    index in a stacked per-layer tensor, or None for a parameter of the layer's own module."""
    if method_name == "lora":
        m = model.hidden[layer]
        return [(m.lora_A, None), (m.lora_B, None)]
    if method_name in ("queryable", "instruct-queryable"):
        m = model.hidden[layer]
        return [(m.queryable_A, None), (m.queryable_B, None), (m.queryable_eta, None)]
    if method_name == "replora":
        pair = model.shared["replora"]["hidden_32x32"]
        return [(pair.latent_A, layer), (pair.latent_B, layer)]
    if method_name == "hyra":
        return [(model.shared["hyra"]["hidden_32x32"].layer_emb, layer)]
    if method_name == "doran":
        pair, m = model.shared["doran"]["hidden_32x32"], model.hidden[layer]
        return [(pair.latent_A, layer), (pair.latent_B, layer), (m.doran_m, None), (m.doran_rho, None)]
    if method_name == "full-adamw":
        m = model.hidden[layer]
        return [(m.weight, None), (m.bias, None)]
    raise AssertionError(method_name)


def shared_params(model, method_name: str) -> list[torch.Tensor]:
    if method_name in ("lora",):
        return []
    if method_name in ("queryable", "instruct-queryable"):
        mem = model.shared["queryable"]
        names = ["atoms", "keys", "block_prior", "Q_cur", "Q_dep", "Q_dep_q", "Q_dep_k"]
        return [getattr(mem, n) for n in names + (["Q_ctx", "R_ctx"] if mem.Q_ctx is not None else [])]
    if method_name in ("replora", "doran"):
        pair = model.shared[method_name]["hidden_32x32"]
        return [pair.A.W1, pair.A.W2, pair.B.W1, pair.B.W2]
    if method_name == "hyra":
        h = model.shared["hyra"]["hidden_32x32"]
        return [h.head_emb, h.W_in, h.W_out_A, h.W_out_B]
    if method_name == "full-adamw":
        return [model.inp.weight, model.inp.bias, model.head.weight, model.head.bias]
    raise AssertionError(method_name)


def oracle(model, method_name: str, xb, yb) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per member e: torch.autograd.grad of member e's OWN batch-mean loss (not the stack's sum) with respect to
    the parameters listed above; the norm of slice e (and slot l) of those gradients. (E, L), (E,) or None."""
    E, L = xb.shape[0], model.n_layers
    out = model(xb)  # (E, b)
    norms, shared = torch.zeros(E, L, dtype=F64), torch.zeros(E, dtype=F64)
    for e in range(E):
        loss = (out[e] - yb[e]).pow(2).mean()
        for layer in range(L):
            params = layer_params(model, method_name, layer)
            grads = torch.autograd.grad(loss, [p for p, _ in params], retain_graph=True, allow_unused=True)
            total = 0.0
            for (_, slot), g in zip(params, grads):
                if g is not None:
                    total += (g[e] if slot is None else g[e, slot]).pow(2).sum().item()
            norms[e, layer] = math.sqrt(total)
        sp = shared_params(model, method_name)
        if sp:
            grads = torch.autograd.grad(loss, sp, retain_graph=True, allow_unused=True)
            shared[e] = math.sqrt(sum(g[e].pow(2).sum().item() for g in grads if g is not None))
    return norms, (shared if shared_params(model, method_name) else None)


@pytest.mark.parametrize("method", ORACLE_METHODS)
def test_recorded_norms_equal_a_per_member_autograd_oracle(method):
    model, opt, xb, yb = build(method)
    expect_layers, expect_shared = oracle(model, method, xb, yb)
    groups = gradients.param_groups(model)
    seen = []
    engine.make_step(model, opt)(xb, yb, lambda: seen.append(gradients.grad_norms(groups)))
    ((got_layers, got_shared),) = seen
    assert got_layers.shape == (3, model.n_layers)
    assert (expect_layers > 0).all()  # every layer of every member has a signal to compare
    torch.testing.assert_close(got_layers, expect_layers, rtol=1e-10, atol=0)
    if expect_shared is None:
        assert got_shared is None
    else:
        assert (expect_shared > 0).all()
        torch.testing.assert_close(got_shared, expect_shared, rtol=1e-10, atol=0)


def test_transformer_layer_groups_take_every_projection_of_the_layer():
    """A Transformer layer's norm covers its q, k, v, o adapters together (layers.<l>.*)."""
    model, opt, xb, yb = build("lora", "transformer")
    out = model(xb)  # before the step, which moves the parameters
    expect = torch.zeros(3, model.n_layers, dtype=F64)
    for e in range(3):
        loss = (out[e] - yb[e]).pow(2).mean()
        for layer in range(model.n_layers):
            mods = [getattr(model.layers[layer], r) for r in "qkvo"]
            params = [p for m in mods for p in (m.lora_A, m.lora_B)]
            grads = torch.autograd.grad(loss, params, retain_graph=True)
            expect[e, layer] = math.sqrt(sum(g[e].pow(2).sum().item() for g in grads))
    groups = gradients.param_groups(model)
    seen = []
    engine.make_step(model, opt)(xb, yb, lambda: seen.append(gradients.grad_norms(groups)))
    assert (expect > 0).all()
    torch.testing.assert_close(seen[0][0], expect, rtol=1e-10, atol=0)


def test_layer_module_paths():
    assert gradients.layer_module("hidden.3", 3) == "hidden.3"
    assert gradients.layer_module("layers.0.q", 0) == "layers.0"
    assert gradients.layer_module("layers.11.fc1", 11) == "layers.11"
    with pytest.raises(ValueError, match="no component 2"):
        gradients.layer_module("hidden.3", 2)


def test_concentration_index():
    """results.gradients_summary's index on four epochs of L = 4 layer norms, against hand values."""
    norms = [[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 6.0]]
    cell = dict(zip(results.CELL_COLUMNS, ("f", "deep-narrow", "lora", "quick", "default")))
    grads = pd.DataFrame(
        [cell | {"seed": 0, "status": "ok", "epoch": t, "layer": layer, "norm": v}
         for t, row in enumerate(norms) for layer, v in enumerate(row)]
    )  # fmt: skip
    got = results.gradients_summary(grads).sort_values("epoch")["concentration"].tolist()
    assert got[:2] == [1.0, 4.0]  # even: 1; all on one of L = 4 layers: L
    assert math.isnan(got[2])  # no gradient anywhere: undefined
    assert got[3] == pytest.approx(6 / 3)


def test_recording_gradients_does_not_change_training():
    """The same stack trained with and without gradient diagnostics gives bit-identical curves (float32, the
    default dtype, where any extra op in the step's arithmetic would show)."""
    pre = engine.pretrain(engine.Backbones("deep-narrow", engine.Phase(2, 3e-3)), MEMBERS[:2], device="cpu")
    budget = engine.Budget("t", 2, engine.Phase(2, 3e-3), engine.Phase(4, 5e-4), eval_every=2)
    runs = {}
    for method in ("queryable", "lora"):
        config = adapters.get(method).make_config()
        for diag in (False, True):
            runs[method, diag] = engine.adapt(
                pre, engine.Adaptation(method, config, budget), engine.Runtime("cpu"), diagnostics=diag
            ).curves
        on, off = runs[method, True], runs[method, False]
        assert torch.equal(on.train_mse, off.train_mse) and torch.equal(on.test_mse, off.test_mse)
        assert off.grad_layers is None and off.grad_epochs == []
        assert on.grad_epochs == [2, 4] and on.grad_layers.shape == (2, 2, 32)
    assert runs["queryable", True].grad_shared.shape == (2, 2) and runs["lora", True].grad_shared is None


def test_a_diverged_members_gradients_are_nan_from_its_divergence():
    model, _, _, _ = build("lora")
    data = engine.StackedData.build(MEMBERS, "target", device="cpu", dtype=F64)
    with torch.no_grad():
        model.hidden[0].lora_A[1].fill_(torch.nan)
    opt = adapters.get("lora").optimizer(model, None, 1e-3, 0.0)
    order = [generator("order", *m) for m in MEMBERS]
    groups = gradients.param_groups(model)
    stage = engine.Stage(data, engine.Phase(2, 1e-3), lambda: opt, order, 1)
    (c,) = engine.fit(model, [stage], diagnose=lambda: gradients.grad_norms(groups))
    assert c.diverged_epoch == [None, 0, None]
    assert torch.isnan(c.grad_layers[1]).all() and torch.isfinite(c.grad_layers[[0, 2]]).all()


def test_records_hold_the_norms_and_old_records_still_load(tmp_path):
    plan = experiment.plan(
        functions=["matyas"],
        methods=["lora", "queryable", "mean"],
        protocol=Protocol(arch="deep-narrow", seeds=2, budget="smoke"),
        execution=Execution(device="cpu", out_dir=tmp_path),
    )
    paths = runner.run(plan, progress=False, log=lambda m: None)
    rec = results.read_record(paths[1])
    train = rec["train_info"]
    assert train["grad_epochs"] == train["eval_epochs"][1:] == [2, 4]
    seed = train["per_seed"][0]
    assert np.array(seed["grad_layer_norms"]).shape == (2, 32) and len(seed["grad_shared_norm"]) == 2
    assert "grad_shared_norm" not in results.read_record(paths[0])["train_info"]["per_seed"][0]  # LoRA: none
    grads = results.load_gradients(tmp_path)
    assert set(grads["method"]) == {"lora", "queryable"}  # the mean row trains nothing: no gradients
    summary = results.gradients_summary(grads)
    row = summary[(summary["method"] == "queryable") & (summary["seed"] == 0) & (summary["epoch"] == 4)].iloc[0]
    norms = np.array(seed["grad_layer_norms"][1], dtype=float)
    assert row["concentration"] == pytest.approx(norms.max() / norms.mean())
    assert row["shared_norm"] == pytest.approx(seed["grad_shared_norm"][1])
    # a record written before gradient diagnostics existed: no grad fields at all
    for key in ("grad_epochs",):
        del train[key]
    for s in train["per_seed"]:
        s.pop("grad_layer_norms"), s.pop("grad_shared_norm")
    paths[1].write_text(json.dumps(rec))
    assert set(results.load_gradients(tmp_path)["method"]) == {"lora"}
    assert len(results.load(tmp_path)) == 6 and set(results.load(tmp_path)["backbone_init"]) == {"default"}


def test_norms_come_from_the_last_step_of_each_evaluated_epoch():
    """diagnose() runs once per evaluated epoch, after the backward of that epoch's last batch and before its
    optimizer step: with 400 samples in batches of 64 (7 steps per epoch), after 7 t - 1 steps at epoch t."""
    model, _, _, _ = build("lora")
    data = engine.StackedData.build(MEMBERS, "target", device="cpu", dtype=F64)
    opt = adapters.get("lora").optimizer(model, None, 1e-3, 0.0)
    steps = []
    original = opt.step
    opt.step = lambda *a, **k: (steps.append(1), original(*a, **k))[1]
    groups = gradients.param_groups(model)
    seen = []
    diagnose = lambda: (seen.append(len(steps)), gradients.grad_norms(groups))[1]
    order = [generator("order", *m) for m in MEMBERS]
    (c,) = engine.fit(model, [engine.Stage(data, engine.Phase(5, 1e-3), lambda: opt, order, 2)], diagnose=diagnose)
    assert c.grad_epochs == [2, 4, 5] and seen == [7 * 2 - 1, 7 * 4 - 1, 7 * 5 - 1]
