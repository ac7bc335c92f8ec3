"""Backbone initialisation (`--backbone-init default|kaiming|orthogonal`): the GELU gain, the draws, signal
propagation at init (the default collapses, the variance-preserving inits do not), and the cache keys and config
hashes (a non-default init never collides with the default; the default's keys are what they were before)."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import integrate
from scipy.stats import norm

from qlbench import diagnostics, engine
from qlbench.backbones import GELU_GAIN, build_backbone
from qlbench.experiments import adapted, experiment, multitask, runner
from qlbench.records.store import Store
from qlbench.settings import Execution, Protocol

from helpers import one_line_error

MEMBERS = [("dropwave", 0), ("dropwave", 1), ("levy", 0)]


def test_gelu_gain_is_one_over_the_rms_of_gelu_of_a_standard_normal():
    second_moment = integrate.quad(lambda z: (z * norm.cdf(z)) ** 2 * norm.pdf(z), -40, 40, epsabs=1e-13)[0]
    assert GELU_GAIN == pytest.approx(1 / math.sqrt(second_moment), rel=1e-9)
    assert 1.53 < GELU_GAIN < 1.54  # larger than ReLU's sqrt(2): GELU passes less of a unit-variance input


def test_the_draws_of_each_init():
    keys = list(range(8))
    default = build_backbone("deep-narrow", keys, dtype=torch.float64)
    kaiming = build_backbone("deep-narrow", keys, dtype=torch.float64, init="kaiming")
    orthogonal = build_backbone("deep-narrow", keys, dtype=torch.float64, init="orthogonal")
    for model in (kaiming, orthogonal):  # input layer and head are the default's draws
        for name in ("inp.weight", "inp.bias", "head.weight", "head.bias"):
            assert torch.equal(model.get_parameter(name), default.get_parameter(name))
        assert all(torch.equal(layer.bias, torch.zeros_like(layer.bias)) for layer in model.hidden)
    w = torch.stack([layer.weight for layer in kaiming.hidden])  # (32, E, 32, 32): 262,144 draws
    assert w.mean().abs() < 3 * GELU_GAIN / math.sqrt(32) / math.sqrt(w.numel())
    assert w.std().item() == pytest.approx(GELU_GAIN / math.sqrt(32), rel=0.01)
    for layer in orthogonal.hidden:  # W W^T = gain^2 I for every member
        wwt = layer.weight @ layer.weight.transpose(1, 2)
        torch.testing.assert_close(wwt, GELU_GAIN**2 * torch.eye(32, dtype=torch.float64).expand(8, 32, 32))
    assert not torch.equal(kaiming.hidden[0].weight[0], kaiming.hidden[0].weight[1])  # members differ
    again = build_backbone("deep-narrow", keys, dtype=torch.float64, init="kaiming")
    assert torch.equal(again.hidden[5].weight, kaiming.hidden[5].weight)  # seeded


@pytest.mark.parametrize("function", ["dropwave", "levy", "ackley", "sin-cos", "michalewicz"])
def test_signal_survives_32_layers_with_a_variance_preserving_init_and_collapses_with_the_default(function):
    """The spread of the hidden features across the target inputs after layer 32 over after layer 1, at init:
    below 1e-6 with PyTorch's default (a constant network) and between 0.05 and 100 with kaiming / orthogonal
    (measured over the nine functions x 5 seeds: 0.15 to 55; GELU is not homogeneous, so a fixed gain lets the
    spread drift, mostly upwards for the zoo's input boxes; docs/why.md)."""
    smoke = Protocol(arch="deep-narrow", budget="smoke", seeds=3)
    profile = diagnostics.signal_profile(function, ["default", "kaiming", "orthogonal"], smoke, pretrained=False)
    ratio = profile.pivot_table(index=["init", "seed"], columns="layer", values="spread")
    ratio = ratio[32] / ratio[1]  # (init, seed)
    assert (ratio.loc["default"] < 1e-6).all()  # float32: about 1e-9, the rounding floor of features ~0.1
    for init in ("kaiming", "orthogonal"):
        assert ((ratio.loc[init] > 0.05) & (ratio.loc[init] < 100)).all(), ratio.loc[init]


def test_spread_is_the_mean_std_across_inputs():
    h = torch.tensor([[[0.0, 1.0], [2.0, 1.0], [4.0, 1.0]]])  # (E=1, N=3, F=2): feature 0 varies, 1 is constant
    expect = (math.sqrt(8 / 3) + 0.0) / 2
    assert diagnostics.spread([h, torch.ones(1, 3, 2)]).tolist() == [[pytest.approx(expect), 0.0]]


def test_cache_keys_and_config_hashes(tmp_path):
    """Literals computed by the code before backbone inits and label-noise constructions existed: the stores written
    then (default init, absolute noise) stay valid."""
    make = lambda init, noise="absolute": experiment.plan(
        functions=["dropwave"],
        methods=["lora", "queryable"],
        protocol=Protocol(arch="deep-narrow", budget="quick", backbone_init=init, noise=noise),
        execution=Execution(device="cpu", out_dir=tmp_path),
    )
    legacy = make("default")
    assert legacy.record_path("dropwave", "lora").name == "quick-a4bb5b0f5c2239af.json"
    assert legacy.record_path("dropwave", "queryable").name == "quick-e0866099891a77ef.json"
    path = lambda init, noise="absolute": engine.Backbones(
        "deep-narrow", legacy.budget.pretrain, torch.float32, init, noise
    ).paths([("dropwave", 0)], Store(tmp_path))[0]
    assert path("default").name == "deep-narrow-dropwave-seed0-14302198299531af.pt"
    suite = engine.Backbones("deep-narrow", legacy.budget.pretrain, source="suite")  # a suite's source: its own key
    assert (
        suite.paths([("dropwave", 0)], Store(tmp_path))[0]
        != engine.Backbones("deep-narrow", legacy.budget.pretrain).paths([("dropwave", 0)], Store(tmp_path))[0]
    )
    with pytest.raises(ValueError, match="unknown backbone source 'suites'; valid: function, suite"):
        engine.Backbones("deep-narrow", legacy.budget.pretrain, source="suites")
    names = {init: make(init).record_path("dropwave", "lora").name for init in ("default", "kaiming", "orthogonal")}
    assert len(set(names.values())) == 3
    assert len({path(i).name for i in ("default", "kaiming", "orthogonal")}) == 3
    assert make("kaiming").cell_config("dropwave", "lora")["backbone_init"] == "kaiming"
    assert "backbone_init" not in legacy.cell_config("dropwave", "lora")
    assert "noise" not in legacy.cell_config("dropwave", "lora")
    # the default noise (relative) is a new construction: its own key, record and backbone cache
    default = experiment.plan(
        functions=["dropwave"],
        methods=["lora"],
        protocol=Protocol(arch="deep-narrow", budget="quick"),
        execution=Execution(device="cpu", out_dir=tmp_path),
    )
    assert default.noise == "relative" and default.cell_config("dropwave", "lora")["noise"] == "relative"
    assert default.record_path("dropwave", "lora") != legacy.record_path("dropwave", "lora")
    assert path("default", "relative") != path("default")


def test_a_kaiming_cell_trains_caches_and_reloads(tmp_path):
    plan = experiment.plan(
        functions=["matyas"],
        methods=["queryable"],
        protocol=Protocol(arch="deep-narrow", seeds=2, budget="smoke", dtype="float64", backbone_init="kaiming"),
        execution=Execution(device="cpu", out_dir=tmp_path),
    )
    (path,) = runner.run(plan, progress=False, log=lambda m: None)
    assert len(list(Store(tmp_path).backbone_dir.glob("*.pt"))) == 2
    rec = experiment.results.read_record(path)
    assert rec["run_info"]["config"]["backbone_init"] == "kaiming"
    # reloading rebuilds the kaiming backbone from its own cache (a default one would not reproduce the MSE)
    model, data, _ = adapted.load_adapted(path)
    torch.testing.assert_close(
        engine.evaluate(model, data.x_test, data.y_test),
        torch.tensor([s["test_curve"][-1] for s in rec["train_info"]["per_seed"]], dtype=torch.float64),
        rtol=1e-9,
        atol=0,
    )
    assert len(list(Store(tmp_path).backbone_dir.glob("*.pt"))) == 2  # nothing retrained


def test_bad_inits_are_one_line_errors(capsys, tmp_path):
    with pytest.raises(ValueError, match="valid: default, kaiming, orthogonal"):
        build_backbone("deep-narrow", [0], init="xavier")
    line = one_line_error(capsys, ["run", "--function", "dropwave", "--backbone-init", "he", "--out", str(tmp_path)])
    assert "unknown backbone init 'he'" in line
    argv = ["run", "--function", "dropwave", "--arch", "transformer", "--backbone-init", "kaiming"]
    assert "deep-narrow only" in one_line_error(capsys, [*argv, "--out", str(tmp_path)])
    assert "valid: default, kaiming" in one_line_error(capsys, ["signal", "--function", "levy", "--backbone-init", "x"])


def test_transformer_features_feed_the_signal_profile():
    """The Transformer lists its token embedding and every encoder layer's output (default init only)."""
    smoke = Protocol(arch="transformer", budget="smoke", seeds=1)
    profile = diagnostics.signal_profile("levy", ["default"], smoke, pretrained=False)
    assert sorted(profile["layer"]) == list(range(9)) and (profile["spread"] > 0).all()
    with pytest.raises(ValueError, match="deep-narrow only"):
        diagnostics.signal_profile("levy", ["orthogonal"], smoke, pretrained=False)


def test_a_record_states_every_setting_at_default_values_too(tmp_path):
    """run_info.settings holds every setting that can change a number even where it is the default (eps, backbone
    init, noise, device, compile, dtype, threads, library versions), while the config and its hash keep their keys
    (the literal hashes above); a suite row's record states them too."""
    plan = experiment.plan(
        functions=["matyas"],
        methods=["lora"],
        protocol=Protocol(arch="deep-narrow", seeds=2, budget="smoke"),
        execution=Execution(device="cpu", out_dir=tmp_path, threads=1),
    )
    (path,) = runner.run(plan, progress=False, log=lambda m: None)
    run = experiment.results.read_record(path)["run_info"]
    assert "eps" not in run["config"] and "backbone_init" not in run["config"]  # hashed only when not default
    s = run["settings"]
    assert (s["eps"], s["backbone_init"], s["noise"]) == (1e-8, "default", "relative")
    assert (s["device"], s["compile"], s["dtype"], s["threads"]) == ("cpu", False, "float32", 1)
    assert s["versions"]["torch"] == torch.__version__  # the installed distribution, local tag included
    assert {"python", "qlbench", "numpy", "scipy", "pandas"} <= set(s["versions"])
    # the backbones' own provenance: the cache is keyed by settings, not code, so the record names the code that
    # trained them; a cache file from before that was recorded reads "unknown"
    git = experiment.record.git_info()
    assert s["backbone_commits"] == [git["commit"] + ("+dirty" if git["dirty"] else "")]
    for f in Store(tmp_path).backbone_dir.glob("*.pt"):
        saved = torch.load(f)
        assert saved.pop("git") == git
        torch.save(saved, f)
    again = experiment.plan(
        functions=["matyas"],
        methods=["mean"],
        protocol=Protocol(arch="deep-narrow", seeds=2, budget="smoke"),
        execution=Execution(device="cpu", out_dir=tmp_path, threads=1),
    )
    (path,) = runner.run(again, progress=False, log=lambda m: None)
    assert experiment.results.read_record(path)["run_info"]["settings"]["backbone_commits"] == ["unknown"]
    suite = multitask.plan(
        suite="zoo-4",
        schedule="joint",
        methods=["mean"],
        protocol=Protocol(arch="deep-narrow", budget="smoke", seeds=2),
        execution=Execution(out_dir=tmp_path, threads=1),
    )
    (row,) = runner.run(suite, progress=False, log=lambda m: None)
    s = experiment.results.read_record(row)["run_info"]["settings"]
    assert (s["eps"], s["backbone_init"], s["device"], s["dtype"]) == (1e-8, "default", "cpu", "float32")
    assert s["backbone_commits"] == [git["commit"] + ("+dirty" if git["dirty"] else "")]
