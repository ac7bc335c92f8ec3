"""The stacked engine: a stack equals separate runs, members are isolated, runs are deterministic, and pretraining
is cached and shared."""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys

import pytest
import torch

from qlbench import adapters, engine, zoo
from qlbench.experiments import adapted, experiment, runner
from qlbench.records import results
from qlbench.records.store import Store
from qlbench.seeding import generator
from qlbench.settings import Execution, Protocol

from helpers import SYNCING, ReplayByRerun, settings

F64 = torch.float64
PRE = engine.Phase(epochs=2, lr=3e-3)
BUDGET = engine.Budget("test", 3, PRE, engine.Phase(epochs=3, lr=5e-4), eval_every=1)


def run(members, method_name, *, dtype=F64, break_member=None):
    pre = engine.pretrain(engine.Backbones("deep-narrow", PRE, dtype), members, device="cpu")
    method = adapters.get(method_name)
    if break_member is None:
        return engine.adapt(
            pre, engine.Adaptation(method_name, method.make_config(), BUDGET), engine.Runtime("cpu", dtype=dtype)
        )
    model, data = engine.build_model(pre, method_name, method.make_config(), device="cpu", dtype=dtype)
    with torch.no_grad():
        next(p for p in model.parameters() if p.requires_grad)[break_member].fill_(torch.nan)
    opt = method.optimizer(model, method.make_config(), BUDGET.adapt.lr, BUDGET.adapt.weight_decay)
    order = [generator("order", "adapt", "deep-narrow", f, s) for f, s in members]
    return engine.fit(model, [engine.Stage(data, BUDGET.adapt, lambda: opt, order, BUDGET.eval_every)])[0]


MEMBERS = [("dropwave", 0), ("dropwave", 1), ("levy", 0)]  # two seeds and a second function in one stack


@pytest.mark.parametrize("method", ["lora", "queryable"])
def test_stacked_run_equals_separate_runs(method):
    stacked = run(MEMBERS, method)
    for e, m in enumerate(MEMBERS):
        alone = run([m], method)
        for key in ("train_mse", "test_mse"):
            torch.testing.assert_close(
                getattr(stacked.curves, key)[e], getattr(alone.curves, key)[0], rtol=1e-10, atol=0
            )
    assert stacked.curves.train_mse.shape == (3, BUDGET.adapt.epochs + 1)


def test_pretraining_stacked_equals_separate():
    stacked = engine.pretrain(engine.Backbones("deep-narrow", PRE, F64), MEMBERS, device="cpu")
    for e, m in enumerate(MEMBERS):
        alone = engine.pretrain(engine.Backbones("deep-narrow", PRE, F64), [m], device="cpu")
        for k, v in alone.state.items():
            # batched and single matmuls round differently; after 76 AdamW steps (which normalise each
            # coordinate's step) that leaves ~1e-12 differences in float64, nowhere near a real mix-up (~1e-3)
            torch.testing.assert_close(stacked.state[k][e], v[0], rtol=1e-8, atol=1e-10)
        assert stacked.source_test_mse[e] == pytest.approx(alone.source_test_mse[0], rel=1e-9)


@pytest.mark.parametrize("method", ["lora", "full-soap"])
def test_a_diverging_member_is_marked_and_the_others_go_on(method):
    clean = run(MEMBERS, method, break_member=None).curves
    broken = run(MEMBERS, method, break_member=1)
    assert broken.diverged_epoch == [None, 0, None]
    assert torch.isnan(broken.train_mse[1]).all()
    for e in (0, 2):
        torch.testing.assert_close(broken.train_mse[e], clean.train_mse[e], rtol=1e-12, atol=0)
        torch.testing.assert_close(broken.test_mse[e], clean.test_mse[e], rtol=1e-12, atol=0)
    assert broken.member_summary(1)["best_train_mse"] is None


def test_same_seed_same_numbers_float32():
    a = run(MEMBERS[:2], "queryable", dtype=torch.float32).curves
    b = run(MEMBERS[:2], "queryable", dtype=torch.float32).curves
    assert torch.equal(a.train_mse, b.train_mse) and torch.equal(a.test_mse, b.test_mse)


def test_training_changes_the_adapter_and_seeds_differ():
    r = run(MEMBERS[:2], "lora").curves
    assert not torch.equal(r.train_mse[:, 0], r.train_mse[:, -1])  # it trained
    assert r.train_mse[0, 0] != r.train_mse[1, 0]  # seeds are different models on different data


def test_member_summary_selects_without_peeking():
    c = engine.Curves([0, 10, 20], torch.tensor([[3.0, 1.0, 2.0]]), torch.tensor([[5.0, 4.0, 0.5]]), [None])
    s = c.member_summary(0)
    assert (s["best_train_mse"], s["best_train_epoch"]) == (1.0, 10)
    assert (s["best_test_mse"], s["best_test_epoch"]) == (0.5, 20)  # the paper's test-selected number
    assert s["test_at_best_train"] == 4.0  # the honest one


def test_pretraining_cache_is_reused_across_stackings(tmp_path):
    store = Store(tmp_path)
    first = engine.pretrain(engine.Backbones("deep-narrow", PRE, F64), MEMBERS[:2], device="cpu", store=store)
    assert len(list(store.backbone_dir.glob("*.pt"))) == 2
    assert not engine.Backbones("deep-narrow", PRE, F64).needed(MEMBERS[1:2], store)
    calls = []
    spec = engine.Backbones("deep-narrow", PRE, F64)
    again = engine.pretrain(spec, MEMBERS[1:2], device="cpu", store=store, progress=calls.append)
    assert calls == []  # nothing trained
    for k, v in again.state.items():
        assert torch.equal(v[0], first.state[k][1])
    assert engine.Backbones("deep-narrow", PRE, F64).needed(MEMBERS, store)  # levy is not cached yet


def test_paper_budget_is_the_papers_protocol():
    for arch in ("deep-narrow", "transformer"):
        b = engine.budget("paper", arch)
        assert (b.pretrain.epochs, b.pretrain.lr, b.adapt.epochs, b.adapt.lr) == (300, 3e-3, 5000, 5e-4)
        assert (b.pretrain.batch_size, b.adapt.batch_size, b.seeds) == (64, 64, 5)
    with pytest.raises(ValueError, match="valid: paper, quick, smoke"):
        engine.budget("fast", "deep-narrow")


def test_experiment_writes_records_resumes_and_reloads(tmp_path):
    plan = experiment.plan(
        functions=["matyas"],
        methods=["queryable", "mean"],
        protocol=Protocol(arch="deep-narrow", seeds=2, budget="smoke", dtype="float64"),
        execution=Execution(device="cpu", out_dir=tmp_path),
    )
    paths = runner.run(plan, progress=False, log=lambda m: None)
    rec = results.read_record(paths[0])
    assert rec["train_info"]["status"] == "ok" and rec["run_info"]["seeds"] == [0, 1]
    assert set(rec) == {"schema", "run_info", "train_info", "meta_info"}
    assert {"created_at", "qlbench_version", "git", "config", "config_hash", "budget", "device"} <= set(rec["run_info"])
    seed0 = rec["train_info"]["per_seed"][0]
    assert len(seed0["test_curve"]) == len(rec["train_info"]["eval_epochs"])
    assert not list(tmp_path.rglob("*.tmp"))  # atomic writes leave no temp files
    json.loads(paths[0].read_text())  # strict JSON (no NaN)
    stamp = paths[0].stat().st_mtime_ns
    logs = []
    runner.run(plan, progress=False, log=logs.append)
    assert paths[0].stat().st_mtime_ns == stamp and "skipped" in logs[0]
    frame = results.load(tmp_path)
    assert sorted(frame["method"].unique()) == ["mean", "queryable"] and len(frame) == 4
    model, data, _ = adapted.load_adapted(paths[0])  # the saved adapter reproduces the recorded test MSE
    torch.testing.assert_close(
        engine.evaluate(model, data.x_test, data.y_test),
        torch.tensor([s["test_curve"][-1] for s in rec["train_info"]["per_seed"]], dtype=F64),
        rtol=1e-9,
        atol=0,
    )


def _small_stack(method_name: str, dtype: torch.dtype):
    """A 4-layer deep-narrow stack of MEMBERS with `method_name` built on it, its data and its own optimiser."""
    from qlbench.backbones import DeepNarrowConfig, DeepNarrowMLP

    method = adapters.get(method_name)
    queryable = getattr(method, "family", None) == "queryable"
    config = method.make_config(n_blocks=2) if queryable else method.make_config()
    gens = [generator("test-compile", *m) for m in MEMBERS]
    backbone = DeepNarrowMLP(gens, DeepNarrowConfig(depth=4), dtype=dtype)
    data = engine.StackedData.build(MEMBERS, "target", device="cpu", dtype=dtype)
    model = method.build(backbone, config, gens, data.y_train)
    method.bind(model, MEMBERS, config)
    return model, data, method.optimizer(model, config, 1e-3, 0.01)


def _fit_small_stack(method_name: str, epochs: int, compile: bool):
    """The curves of `_small_stack(method_name, float64)` trained `epochs` epochs at lr 1e-3, compiled or eager."""
    model, data, opt = _small_stack(method_name, F64)
    order = [generator("order", *m) for m in MEMBERS]
    stage = engine.Stage(data, engine.Phase(epochs, 1e-3), lambda: opt, order, 1)
    return engine.fit(model, [stage], compile=compile)[0]


# Every trained method runs compiled by default on the paper budget (engine.COMPILE_BUDGETS): each is checked
# against its eager run. LoRA's runs in the default suite; the others (15 to 90 s of compilation each with Inductor's
# cache cold, as on a fresh CI machine) under -m slow, which CI runs after the default suite (`make test-slow`).
@pytest.mark.parametrize(
    "method_name",
    [pytest.param(m, marks=pytest.mark.slow) if m != "lora" else m for m in adapters.names() if adapters.get(m).trains],
)
def test_compiled_training_step_matches_eager(method_name):
    """The torch.compile path (the CUDA graphs path on a GPU) trains the same model as eager, on CPU here: the same
    curves to 1e-9 (float64) after 3 epochs of a 4-layer deep-narrow stack of two functions."""
    curves = []
    for compile in (False, True):
        torch._dynamo.utils.counters.clear()
        curves.append(_fit_small_stack(method_name, 3, compile))
        # compiled means compiled: a graph was captured, not a silent fall-back to eager
        assert (torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0) is compile
    # float64, so reordered sums in compiled kernels stay at rounding level; SOAP amplifies them (its refresh QR runs
    # in float32, as pytorch_optimizer's does, and the eigenbasis of the 1 x 32 output layer's rank-one factor is not
    # unique): about 5e-4 after 3 epochs, while eager runs repeat to the bit
    rtol = 2e-3 if method_name == "full-soap" else 1e-9
    torch.testing.assert_close(curves[1].train_mse, curves[0].train_mse, rtol=rtol, atol=0)
    torch.testing.assert_close(curves[1].test_mse, curves[0].test_mse, rtol=rtol, atol=0)
    assert not torch.equal(curves[0].train_mse[:, 0], curves[0].train_mse[:, -1])  # it trained


def test_the_compiled_update_trains_as_the_eager_one_in_float32(monkeypatch):
    """With --compile on CPU the AdamW update is compiled too (float32 only, engine/step.py `updates_compile`): the
    same curves as eager to 5e-6 relative after 3 epochs (measured 4.9e-7: fused kernels round differently); a
    learning rate off by 0.1% moves them by 6.7e-5, so the tolerance would catch a wrong update."""
    from qlbench.backbones import DeepNarrowConfig, DeepNarrowMLP
    from qlbench.engine import step as step_module

    built = []
    compiled_update = step_module.compiled_update
    monkeypatch.setattr(step_module, "compiled_update", lambda opt: built.append(opt) or compiled_update(opt))
    members, method = [("dropwave", 0), ("levy", 1)], adapters.get("lora")
    config = method.make_config()

    def curves(compile: bool, lr: float = 1e-3) -> torch.Tensor:
        gens = [generator("test-compile", *m) for m in members]
        backbone = DeepNarrowMLP(gens, DeepNarrowConfig(depth=4), dtype=torch.float32)
        data = engine.StackedData.build(members, "target", device="cpu", dtype=torch.float32)
        model = method.build(backbone, config, gens, data.y_train)
        opt = method.optimizer(model, config, lr, 0.01)
        stage = engine.Stage(data, engine.Phase(3, lr), lambda: opt, [generator("order", *m) for m in members], 1)
        return engine.fit(model, [stage], compile=compile)[0].train_mse

    eager, compiled = curves(False), curves(True)
    assert len(built) == 1  # the compiled run compiled its update; the eager one did not
    torch.testing.assert_close(compiled, eager, rtol=5e-6, atol=0)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(curves(False, lr=1.001e-3), eager, rtol=5e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["float32", "float64"])
def test_every_methods_optimiser_says_whether_its_update_compiles(dtype):
    """`updates_compile` on each trained method's own optimiser: yes for float32 AdamW (foreach, as every method but
    full-soap builds it off CUDA), no for full-soap's StackedSoap and for anything in float64. Asking StackedSoap for
    the param_groups it does not have once failed every compiled full-soap cell (the paper budget's, on the CPU)."""
    from qlbench.engine import step as step_module

    for name in (m for m in adapters.names() if adapters.get(m).trains):
        _, _, opt = _small_stack(name, dtype)
        assert step_module.updates_compile(opt) is (dtype == torch.float32 and name != "full-soap"), name


@pytest.mark.parametrize(("method_name", "rtol"), [("full-adamw", 1e-12), ("full-soap", 1e-2)])
def test_a_compiled_full_fine_tuning_stage_trains_as_the_eager_one(monkeypatch, method_name, rtol):
    """Full fine-tuning through `fit(compile=True)`, the path of every paper-budget cell (`--compile auto`), with
    torch.compile's eager backend standing in for Inductor (the Inductor runs are test_compiled_training_step_matches_
    eager, under -m slow, which CI runs): the step is built, the forward goes through torch.compile, and the curves
    are the eager run's. Under torch.compile the stacked layers take their plain ops, which round differently: AdamW
    keeps that at rounding level (3e-16 measured), SOAP amplifies it (1.8e-3 after two epochs, measured; the
    Inductor test allows 2e-3 after three, for the same reason)."""
    from qlbench.engine import loop

    compiled = []
    monkeypatch.setattr(loop, "compiled", lambda m: compiled.append(m) or torch.compile(m, backend="eager"))
    curves = [_fit_small_stack(method_name, 2, compile) for compile in (False, True)]
    assert len(compiled) == 1
    torch.testing.assert_close(curves[1].train_mse, curves[0].train_mse, rtol=rtol, atol=0)
    assert (curves[0].train_mse[:, -1] < curves[0].train_mse[:, 0]).all()  # it trained


@pytest.mark.parametrize(
    ("device", "budget", "expected"),
    [
        ("cpu", "paper", True),
        ("cpu", "quick", False),
        ("cpu", "smoke", False),
        ("cuda", "paper", True),
        ("cuda", "quick", False),
    ],
)
def test_compile_default_per_device_and_budget(device, budget, expected):
    """`--compile auto`: the paper budget on either device (on CUDA the captured step already removes the launch
    cost a compiled quick run used to save); never smoke."""
    assert engine.compile_by_default(torch.device(device), budget) is expected
    assert engine.compile_by_default(torch.device(device), "smoke") is False


def test_plan_resolves_compile_auto_from_the_budget(tmp_path):
    """`plan` turns `--compile auto` into the per-(device, budget) default; on and off override it."""
    kw = dict(functions=["matyas"], arch="deep-narrow", methods=["lora"], device="cpu", out_dir=tmp_path)
    assert experiment.plan(**settings(**kw, budget="paper")).compile is True
    assert experiment.plan(**settings(**kw, budget="quick")).compile is False
    assert experiment.plan(**settings(**kw, budget="paper", compile="off")).compile is False
    assert experiment.plan(**settings(**kw, budget="smoke", compile="on")).compile is True


def test_the_optimisers_eps_is_recorded_and_hashed_only_when_not_the_default(tmp_path):
    make = lambda **kw: experiment.plan(
        **settings(functions=["matyas"], methods=["lora"], **kw, arch="deep-narrow", budget="smoke", out_dir=tmp_path)
    )
    default, same, tiny = make(), make(eps=1e-8), make(eps=1e-30)
    assert "eps" not in default.cell_config("matyas", "lora")  # records written before eps existed keep their hash
    assert default.record_path("matyas", "lora") == same.record_path("matyas", "lora")
    assert tiny.cell_config("matyas", "lora")["eps"] == 1e-30
    assert tiny.record_path("matyas", "lora") != default.record_path("matyas", "lora")


@pytest.mark.parametrize("method", ["lora", "full-soap"])
def test_the_optimisers_eps_reaches_the_update(method, tmp_path):
    """An eps far above every |gradient| turns Adam's (and SOAP's) step g / (sqrt(v) + eps) into almost nothing: the
    adapted model must then stay where it started, while the default eps moves it."""
    curves = {}
    for eps in (adapters.EPS, 1e3):
        p = experiment.plan(
            functions=["matyas"],
            methods=[method],
            protocol=Protocol(arch="deep-narrow", budget="smoke", dtype="float64", eps=eps),
            execution=Execution(out_dir=tmp_path / str(eps)),
        )
        (path,) = runner.run(p, progress=False)
        curves[eps] = json.loads(path.read_text())["train_info"]["per_seed"][0]["train_curve"]
    moved = lambda c: abs(c[-1] - c[0]) / c[0]
    assert moved(curves[1e3]) < moved(curves[adapters.EPS]) / 10, curves  # measured: x100 (lora), x19 (full-soap)


@pytest.mark.parametrize("noise", ["relative", "absolute"])
def test_a_cell_trains_and_reloads_with_its_own_label_noise(noise, tmp_path):
    """The plan's label noise reaches the data: the record's last test MSE is reproduced by rebuilding the cell
    from its record (which must read the noise back from the config) and evaluating on labels drawn with that noise,
    and not on the other construction's labels."""
    p = experiment.plan(
        functions=["dropwave"],
        methods=["lora"],
        protocol=Protocol(arch="deep-narrow", seeds=2, budget="smoke", dtype="float64", noise=noise),
        execution=Execution(out_dir=tmp_path),
    )
    (path,) = runner.run(p, progress=False, log=lambda m: None)
    rec = json.loads(path.read_text())
    assert rec["run_info"]["config"].get("noise", "absolute") == noise
    model, data, _ = adapted.load_adapted(path)
    last = torch.tensor([s["test_curve"][-1] for s in rec["train_info"]["per_seed"]], dtype=torch.float64)
    torch.testing.assert_close(engine.evaluate(model, data.x_test, data.y_test), last, rtol=1e-9, atol=0)
    other = "absolute" if noise == "relative" else "relative"
    y_other = torch.stack([zoo.task("dropwave", other).target_data(s, torch.float64).y_test for s in (0, 1)])
    assert not torch.allclose(engine.evaluate(model, data.x_test, y_other), last, rtol=1e-3)


def test_source_mse_after_adaptation_is_measured_on_the_final_model(tmp_path):
    """`source_test_mse_after` evaluates the adapted model on the source test set: for `frozen` (nothing trained)
    it equals the pretrained backbone's source test MSE, which pretraining recorded on its own path; a LoRA
    adaptation to the shifted target moves it; and it is the saved adapter's MSE on the source data."""
    plan = experiment.plan(
        functions=["matyas"],
        methods=["frozen", "lora"],
        protocol=Protocol(arch="deep-narrow", seeds=2, budget="smoke", dtype="float64"),
        execution=Execution(device="cpu", out_dir=tmp_path),
    )
    paths = {Store(tmp_path).cell_of(p)[2]: p for p in runner.run(plan, progress=False, log=lambda m: None)}
    frozen, lora = (results.read_record(paths[m])["train_info"]["per_seed"] for m in ("frozen", "lora"))
    for f, a in zip(frozen, lora):
        assert f["source_test_mse_after"] == pytest.approx(f["source_test_mse"], rel=1e-12)
        assert a["source_test_mse"] == f["source_test_mse"] and a["source_test_mse_after"] != a["source_test_mse"]
    model, _, _ = adapted.load_adapted(paths["lora"])
    source = engine.StackedData.build([("matyas", 0), ("matyas", 1)], "source", device="cpu", dtype=F64)
    torch.testing.assert_close(
        engine.evaluate(model, source.x_test, source.y_test),
        torch.tensor([s["source_test_mse_after"] for s in lora], dtype=F64),
        rtol=1e-9,
        atol=0,
    )
    assert results.load(tmp_path)["source_test_mse_after"].notna().all()


def test_a_reference_row_with_non_finite_scores_is_reported_diverged():
    """`frozen` trains nothing; a member whose backbone gives non-finite predictions is a divergence at epoch 0
    (reported, never an `ok` seed with null metrics), the other member unaffected."""
    smoke = engine.budget("smoke", "deep-narrow")
    pre = engine.pretrain(engine.Backbones("deep-narrow", smoke.pretrain), [("matyas", 0), ("matyas", 1)], device="cpu")
    name = next(k for k in pre.state if k.endswith("weight"))
    pre.state[name][0] = float("nan")
    res = engine.adapt(
        pre, engine.Adaptation("frozen", adapters.get("frozen").make_config(), smoke), engine.Runtime("cpu")
    )
    assert res.curves.diverged_epoch == [0, None]


def test_the_captured_step_finds_every_optimisers_parameters_and_records_adamw_only_where_capturable():
    """The CUDA-graph step reads its parameters from any optimiser the methods build: torch.optim's param_groups
    (AdamW) and full-soap's StackedSoap, which has none (on CUDA its missing param_groups once failed every full-soap
    cell). Only an optimiser with its state on the device (`capturable`) has its update recorded."""
    from qlbench.engine import step as step_module
    from qlbench.soap import StackedSoap

    a, b = torch.nn.Parameter(torch.zeros(2, 3, 4)), torch.nn.Parameter(torch.zeros(2, 5, 5))
    soap = StackedSoap([a, b], lr=1e-3)
    assert [id(p) for p in step_module.parameters(soap)] == [id(a), id(b)]
    assert not step_module.capturable(soap)
    adam = torch.optim.AdamW([b, a], lr=1e-3)
    assert [id(p) for p in step_module.parameters(adam)] == [id(b), id(a)]
    assert not step_module.capturable(adam)  # CPU AdamW keeps its step count on the host
    assert step_module.capturable(torch.optim.AdamW([a], lr=1e-3, capturable=True))
    assert step_module.capturable(StackedSoap([a, b], lr=1e-3, capturable=True))  # as adapters.full builds it on CUDA


@pytest.fixture(scope="module")
def eager_smoke():
    """The smoke backbones of dropwave and levy, and each method's eager curves on them (filled as the tests ask):
    the two captured-bookkeeping tests share them, the eager step being the same both ways (full-soap's aside)."""
    smoke = engine.budget("smoke", "deep-narrow")
    pre = engine.pretrain(engine.Backbones("deep-narrow", smoke.pretrain), [("dropwave", 0), ("levy", 1)], device="cpu")
    return smoke, pre, {}


@pytest.mark.xdist_group("captured-bookkeeping")  # one worker: its two cases share `eager_smoke`
@pytest.mark.parametrize("whole", [False, True], ids=["update-after-replay", "update-recorded"])
def test_the_captured_steps_bookkeeping_trains_every_method_as_the_eager_step(monkeypatch, whole, eager_smoke):
    """Every trained method's smoke adaptation through `CapturedStep`, with CUDA graphs replaced by a CPU stand-in
    (`ReplayByRerun`), gives the eager step's curves and gradient diagnostics bit for bit: the 4 epochs of 6 full
    batches and one of 16 samples are recorded once per shape (2 recordings) after their warm-up steps, and the
    evaluations of the train and the test set once each (`CapturedEvaluation`: at epoch 2, after epoch 0's). Both ways
    the update runs: eager after the replay (any optimiser that is not capturable) and recorded with the step (AdamW
    and full-soap's StackedSoap on CUDA, the latter's host parts around each replay; here `capturable` is forced).
    full-soap's missing param_groups once failed every full-soap cell on CUDA; this catches such a fault without a
    GPU."""
    from qlbench.adapters import full
    from qlbench.engine import step as step_module

    recorders = []
    monkeypatch.setattr(
        step_module, "RECORDER", lambda device: recorders.append(ReplayByRerun(device)) or recorders[-1]
    )
    if whole:
        forced = lambda optimizer: hasattr(optimizer, "param_groups") or getattr(optimizer, "capturable", False)
        monkeypatch.setattr(step_module, "capturable", forced)
        soap = full.StackedSoap
        monkeypatch.setattr(full, "StackedSoap", lambda *a, **k: soap(*a, **(k | {"capturable": True})))
    smoke, pre, eager_curves = eager_smoke
    methods = [m for m in adapters.names() if adapters.get(m).trains]
    for method in methods:
        config = adapters.get(method).make_config()
        train = functools.partial(adapt_on_cpu, pre, engine.Adaptation(method, config, smoke))
        key = (method, whole and method == "full-soap")  # the eager step is the same both ways, but full-soap's
        if key not in eager_curves:  # optimiser: capturable when its update is recorded
            eager_curves[key] = train(capture=False).curves
        runs = {False: eager_curves[key], True: train(capture=True).curves}
        # the step: one recording per batch shape; each evaluation set (train, test): one for the stage
        assert sorted(r.recorded for r in recorders) == [1, 1, 2], method
        recorders.clear()
        for field in ("train_mse", "test_mse", "grad_layers", "grad_shared"):
            eager, captured = getattr(runs[False], field), getattr(runs[True], field)
            assert (eager is None) == (captured is None), (method, field)
            if eager is not None:
                assert torch.equal(eager.nan_to_num(-1.0), captured.nan_to_num(-1.0)), (method, field)


def adapt_on_cpu(pre, adaptation, capture: bool):
    return engine.adapt(pre, adaptation, engine.Runtime("cpu", capture=capture))


@pytest.mark.xdist_group("captured-bookkeeping")  # shares `eager_smoke`'s backbones
def test_full_soaps_refresh_is_recorded_once_and_replayed_when_due(monkeypatch, eager_smoke):
    """full-soap's eigenbases' refresh where it is device work alone (`refresh_recordable`: deep-narrow off the
    CPU; here the CPU takes CUDA's Householder QR, and its update is `capturable` as on CUDA): through
    `CapturedStep` with the CPU stand-in for CUDA graphs, 7 smoke epochs of 7 steps refresh after steps 10, 20, 30
    and 40: the first after a replayed step, eagerly (REFRESH_WARMUP); the second after an ordinary step (the last
    partial batch's third warm-up), eagerly as every ordinary step; the third recorded and replayed, and the fourth
    replayed. The curves and gradient diagnostics equal the eager step's bit for bit, so the replayed refresh left
    the optimiser as the eager one does; the step's recorder made three recordings (two batch shapes, the refresh).
    A recording runs nothing on CUDA, which the stand-in mirrors by undoing what it ran: a refresh recorded and not
    replayed fails the comparison."""
    from qlbench import soap
    from qlbench.adapters import full
    from qlbench.engine import step as step_module

    monkeypatch.setattr(soap, "LAPACK_QR_DEVICES", frozenset())
    stacked = full.StackedSoap
    monkeypatch.setattr(full, "StackedSoap", lambda *a, **k: stacked(*a, **(k | {"capturable": True})))
    calls = []
    refresh = stacked.refresh
    monkeypatch.setattr(stacked, "refresh", lambda self, *a, **k: calls.append(self.steps) or refresh(self, *a, **k))
    recorders = []
    monkeypatch.setattr(
        step_module, "RECORDER", lambda device: recorders.append(ReplayByRerun(device)) or recorders[-1]
    )
    smoke, pre, _ = eager_smoke
    longer = dataclasses.replace(smoke, adapt=dataclasses.replace(smoke.adapt, epochs=7))
    config = adapters.get("full-soap").make_config()
    train = functools.partial(adapt_on_cpu, pre, engine.Adaptation("full-soap", config, longer))
    eager = train(capture=False).curves
    eager_refreshes, calls[:] = list(calls), []
    captured = train(capture=True).curves
    for field in ("train_mse", "test_mse", "grad_layers", "grad_shared"):
        a, b = getattr(eager, field), getattr(captured, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert torch.equal(a.nan_to_num(-1.0), b.nan_to_num(-1.0)), field
    assert eager_refreshes == [11, 21, 31, 41]  # the step count (one more than the updates) at each refresh
    assert calls == [11, 21, 31, 31, 41], calls  # the third's body run by its recording (then undone) and replay
    assert sorted(r.recorded for r in recorders) == [1, 1, 3]


def test_a_compiled_forward_is_not_compiled_again_inside_a_recording(monkeypatch):
    """The captured step warms each batch shape up on the very layout it records (contiguous batches), so a compiled
    forward is compiled during the warm-up and only replayed inside the recording: compiling there (Triton's
    autotuning synchronises) failed every compiled captured run on an H200 ("operation not permitted when stream is
    capturing"), because the loop's batches are strided views and the recording's buffers contiguous. Here the CPU
    stand-in counts torch.compile's compilations inside each recording: none. Without the step's `.contiguous()`
    both recordings compile the forward again."""
    from torch._dynamo.utils import counters

    from qlbench.engine import step as step_module

    inside = []

    class Counting(ReplayByRerun):
        def record(self, body, params, optimizer):
            before = sum(counters["stats"].values())
            out = super().record(body, params, optimizer)
            inside.append(sum(counters["stats"].values()) - before)
            return out

    monkeypatch.setattr(step_module, "RECORDER", Counting)
    model, stage = tiny_lora_stage("test-compile")
    engine.fit(model, [stage], compile=True, capture=True)
    # two batch shapes (64 and the last 16), recorded after their warm-ups; then the two evaluation sets (the eager
    # model's forward: nothing to compile)
    assert inside == [0, 0, 0, 0]


def tiny_lora_stage(tag: str) -> tuple[torch.nn.Module, engine.Stage]:
    """LoRA on a depth-2 deep-narrow stack of two members (dropwave, levy), and one 4-epoch stage of it (CPU,
    float32); `tag` names its initialisation's generators."""
    from qlbench.backbones import DeepNarrowConfig, DeepNarrowMLP

    members, method = [("dropwave", 0), ("levy", 1)], adapters.get("lora")
    config = method.make_config()
    gens = [generator(tag, *m) for m in members]
    backbone = DeepNarrowMLP(gens, DeepNarrowConfig(depth=2), dtype=torch.float32)
    data = engine.StackedData.build(members, "target", device="cpu", dtype=torch.float32)
    model = method.build(backbone, config, gens, data.y_train)
    opt = lambda: method.optimizer(model, config, 1e-3, 0.01)
    return model, engine.Stage(data, engine.Phase(4, 1e-3), opt, [generator("order", *m) for m in members], 4)


def test_no_garbage_collection_runs_inside_a_recording(monkeypatch):
    """Every recording of a captured run (two batch shapes, two evaluation sets) runs with Python's cyclic garbage
    collector off, so that a collection cannot destroy an earlier CUDA graph while a stream captures; it is back on
    after each, and after a recording that fails (CPU stand-in for CUDA graphs)."""
    import gc

    from qlbench.engine import step as step_module

    inside, fail = [], []

    class Watching(ReplayByRerun):
        def record(self, body, params, optimizer):
            inside.append(gc.isenabled())
            if fail:
                raise RuntimeError("operation not permitted when stream is capturing")
            return super().record(body, params, optimizer)

    monkeypatch.setattr(step_module, "RECORDER", Watching)
    model, stage = tiny_lora_stage("test-gc")
    assert gc.isenabled()
    engine.fit(model, [stage], capture=True)
    assert inside == [False] * 4 and gc.isenabled()
    fail.append(True)
    with pytest.raises(RuntimeError, match="could not be captured"):
        engine.fit(model, [stage], capture=True)
    assert gc.isenabled()


def test_the_syncing_script_of_the_cuda_tests_trains_eagerly_on_the_cpu():
    """helpers.SYNCING is run captured on CUDA only (tests/test_cuda.py); here it runs as written, eagerly on the
    CPU, so that a stale call in it (it once called a helper that had moved) shows on every machine, not only as a
    CUDA failure with another cause."""
    proc = subprocess.run([sys.executable, "-c", SYNCING, "cpu", "off"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_recording_that_fails_ends_in_one_line_naming_capture_off(monkeypatch):
    """A CUDA error inside a recording (several lines, as CUDA's are) reaches the caller as one RuntimeError line
    that names the cause's first line and `--capture off`; the CPU stand-in's recording raises as CUDA's does."""
    from qlbench.engine import step as step_module

    class Failing(ReplayByRerun):
        def record(self, body, params, optimizer):
            raise RuntimeError(
                "CUDA error: operation not permitted when stream is capturing\n"
                "CUDA kernel errors might be asynchronously reported at some other API call"
            )

    monkeypatch.setattr(step_module, "RECORDER", Failing)
    smoke = engine.budget("smoke", "deep-narrow")
    pre = engine.pretrain(engine.Backbones("deep-narrow", smoke.pretrain), [("dropwave", 0)], device="cpu")
    config = adapters.get("lora").make_config()
    with pytest.raises(RuntimeError) as err:
        engine.adapt(pre, engine.Adaptation("lora", config, smoke), engine.Runtime("cpu", capture=True))
    message = str(err.value)
    assert "\n" not in message
    assert "could not be captured in a CUDA graph" in message and "--capture off" in message
    assert "operation not permitted when stream is capturing" in message
