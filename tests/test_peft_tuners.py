"""peft's tuners as methods (`peft:<type>`, qlbench/adapters/peft_tuners.py, stacked by adapters/member.py).

Oracles: qlbench's own `lora` and `dora`, written independently for the stack, trained side by side with peft's
LoRA (and LoRA with use_dora) from the same initial weights, on both backbones; the loop over members as the
oracle of the vmapped stack. Planted bugs show each comparison can fail.
"""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch

from qlbench import adapters, cli, engine
from qlbench.adapters import member, peft_tuners
from qlbench.backbones import build_backbone
from qlbench.settings import Execution, Protocol

SMOKE = {arch: engine.budget("smoke", arch) for arch in ("deep-narrow", "transformer")}
MEMBERS = [("matyas", 0), ("levy", 1)]
RUNNABLE = [t for t in peft_tuners.types() if t not in peft_tuners.REFUSED]


@functools.cache
def pretrained(arch: str) -> engine.Pretrained:
    return engine.pretrain(engine.Backbones(arch, SMOKE[arch].pretrain), MEMBERS, device="cpu")


def adapted(arch: str, method: str, init: dict[str, torch.Tensor] | None = None, **overrides):
    """(result, initial trainable state) of `method` trained at the smoke budget in float64; `init` maps
    parameter names to values copied in before training."""
    start = {}

    def prepare(model):
        with torch.no_grad():
            params = dict(model.named_parameters())
            for name, value in (init or {}).items():
                params[name].copy_(value)
        start.update({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})

    config = adapters.get(method).make_config(**overrides)
    res = engine.adapt(
        pretrained(arch),
        engine.Adaptation(method, config, SMOKE[arch]),
        engine.Runtime("cpu", dtype=torch.float64),
        prepare=prepare,
        diagnostics=False,
    )
    return res, start


# qlbench parameter suffix -> peft's (the layer path is the same: `<path>.<ours>` and `<path>.linear.<theirs>`)
PEFT_NAMES = {
    "lora": {"lora_A": "lora_A.default.weight", "lora_B": "lora_B.default.weight"},
    "dora": {
        "dora_A": "lora_A.default.weight",
        "dora_B": "lora_B.default.weight",
        "dora_m": "lora_magnitude_vector.default.weight",
    },
}


def as_peft(ours: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in state.items():
        path, _, suffix = name.rpartition(".")
        out[f"{path}.linear.{PEFT_NAMES[ours][suffix]}"] = value
    return out


def equal_runs(a, b, rtol: float = 1e-7) -> bool:
    """Same train and test curves (every member, every evaluation) within rtol."""
    return all(
        torch.allclose(x, y, rtol=rtol, atol=0)
        for x, y in ((a.curves.train_mse, b.curves.train_mse), (a.curves.test_mse, b.curves.test_mse))
    )


# the Transformer's runs take minutes on two cores: `make test-slow`
BOTH = ["deep-narrow", pytest.param("transformer", marks=pytest.mark.slow)]


@pytest.mark.parametrize("arch", BOTH)
@pytest.mark.parametrize(("ours", "theirs"), [("lora", {}), ("dora", {"use_dora": True})])
def test_peft_lora_trains_as_qlbench_lora_from_the_same_start(arch, ours, theirs):
    mine, start = adapted(arch, ours)
    peft_run, _ = adapted(arch, "peft:lora", as_peft(ours, start), **theirs)
    assert mine.trainable_params == peft_run.trainable_params
    assert equal_runs(mine, peft_run), (mine.curves.train_mse, peft_run.curves.train_mse)
    # planted bug: peft's own default alpha (8, scale 1 where qlbench's is 2) is another method, and the oracle sees it
    other, _ = adapted(arch, "peft:lora", as_peft(ours, start), lora_alpha=8, **theirs)
    assert not equal_runs(mine, other)


def test_peft_lora_by_default_is_lora_seed_for_seed():
    """The A/A pair: `peft:lora` with no setting given (qlbench's scale 16 / 8 and lora's draws for A) trains as
    `lora` per member, nothing copied in; planted: peft's own alpha (8) or peft's own A (init from torch's global
    generator, as `init_lora_weights="gaussian"` stands in for here: another start) is another run."""
    mine, start = adapted("deep-narrow", "lora")
    twin, twin_start = adapted("deep-narrow", "peft:lora")
    assert as_peft("lora", start).keys() == twin_start.keys()
    for name, value in as_peft("lora", start).items():
        assert torch.equal(value, twin_start[name]), name
    assert equal_runs(mine, twin), (mine.curves.train_mse, twin.curves.train_mse)
    assert not equal_runs(mine, adapted("deep-narrow", "peft:lora", lora_alpha=8)[0])
    gaussian, g_start = adapted("deep-narrow", "peft:lora", init_lora_weights="gaussian")
    assert not all(torch.equal(v, g_start[n]) for n, v in as_peft("lora", start).items())


def vblora_as_peft(arch: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """qlbench's VB-LoRA state in peft's names: each layer's logits as they are; the one shared bank at the first
    adapted layer, where peft's stack holds the bank every layer shares."""
    first = build_backbone(arch, [0]).adapter_targets(None)[0].path
    out = {}
    for name, value in state.items():
        if name == "shared.vblora.bank":
            out[f"{first}.linear.vblora_vector_bank.default"] = value
        else:
            path, _, suffix = name.rpartition(".")
            out[f"{path}.linear.{suffix}.default"] = value
    return out


def lily_as_peft(arch: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """qlbench's Lily state in peft's names: per (role, shape) group, A (E, layers, r, d_in) -> each layer's lily_A,
    B (E, experts, r, d_out) -> the group's first layer's lily_B as (E, experts r, d_out); each router as it is."""
    targets = build_backbone(arch, [0]).adapter_targets(None)
    out = {}
    for name, value in state.items():
        if name.startswith("shared.lily."):
            key, part = name.split(".")[2:]
            group = sorted((t for t in targets if t.role == key.rsplit("_", 1)[0]), key=lambda t: t.layer)
            if part == "A":
                for t in group:
                    out[f"{t.path}.linear.lily_A.default.weight"] = value[:, t.layer]
            else:
                out[f"{group[0].path}.linear.lily_B.default.weight"] = value.flatten(1, 2)
        else:
            out[f"{name.rpartition('.')[0]}.linear.lily_router.default.weight"] = value
    return out


ALIGNED = {  # qlbench's method -> (peft's tuner, its config where it computes the same, the state in its names)
    "vb-lora": ("peft:vblora", dict(r=4, num_vectors=16, vector_length=8, topk=2), vblora_as_peft),
    "lily": ("peft:lily", dict(r=13, num_B=2, stride_A=1, scaling=1.0), lily_as_peft),
}
PLANTED = {"vb-lora": dict(topk=3), "lily": dict(scaling=2.0)}  # one setting off: another method


# On the Transformer peft's Lily, aimed at qlbench's target paths, shares one B among every 256x256 layer (q, k, v and
# o), where qlbench's Lily shares one per role: another method there, so no oracle on that backbone
@pytest.mark.parametrize(
    ("arch", "ours"),
    [
        ("deep-narrow", "lily"),
        ("deep-narrow", "vb-lora"),
        pytest.param("transformer", "vb-lora", marks=pytest.mark.slow),
    ],
)
def test_peft_vblora_and_lily_train_as_qlbench_s_from_the_same_start(arch, ours):
    """qlbench's VB-LoRA and Lily were written to compute what peft's tuners compute (their docstrings); trained
    side by side from the same start, the curves agree; with one setting off (planted), they do not."""
    theirs, config, names = ALIGNED[ours]
    mine, start = adapted(arch, ours)
    peft_run, _ = adapted(arch, theirs, names(arch, start), **config)
    assert mine.trainable_params == peft_run.trainable_params
    assert equal_runs(mine, peft_run), (mine.curves.train_mse, peft_run.curves.train_mse)
    other, _ = adapted(arch, theirs, names(arch, start), **(config | PLANTED[ours]))
    assert not equal_runs(mine, other)


def stack(arch: str, kind: str, members: int = 3, **overrides) -> member.MemberStack:
    method = adapters.get(peft_tuners.PREFIX + kind)
    gens = [torch.Generator().manual_seed(e) for e in range(members)]
    init = "kaiming" if arch == "deep-narrow" else "default"  # the default deep-narrow is a constant function
    backbone = build_backbone(arch, list(range(members)), init=init)
    return method.build(backbone, method.make_config(**overrides), gens, None)


def grads(model: member.MemberStack, forward, x: torch.Tensor) -> list[torch.Tensor]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    out = forward(x)
    return [out.detach(), *torch.autograd.grad((out**2).sum(), trainable, allow_unused=True)]


# the tuners that stay looped, and the words of the measured reason (member.MemberStack.probe)
LOOPED = {"c3a": "differ from the loop's"}  # peft's BlockCircularConvolution backward: test below


def moved(model: member.MemberStack, seed: int = 10) -> member.MemberStack:
    """The stack with every trainable tensor moved off its start (seeded): a zero-initialised update hides most
    errors of a stacked computation."""
    with torch.no_grad():
        for i, p in enumerate(p for p in model.parameters() if p.requires_grad):
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + i)).to(p))
    return model


@pytest.mark.parametrize("kind", RUNNABLE)
def test_a_stacked_tuner_gives_peft_s_own_outputs_and_gradients_off_its_start(kind):
    """Every runnable tuner but LOOPED stacks (in a member.Way, with its peft_rewrites) and, moved off its start,
    gives the loop's outputs and gradients: the loop runs peft's own code member by member (no rewrite). A way that
    draws random numbers is compared in evaluation mode (a loop and vmap draw different numbers)."""
    # built in float32 (peft's PSOFT initialises in nothing wider), compared in float64: float32 rounding, grown
    # through 32 layers, is no error of the stacked computation
    model = moved(stack("deep-narrow", kind).to(torch.float32)).to(torch.float64)
    if kind in LOOPED:
        assert model.path.startswith("looped: ") and LOOPED[kind] in model.path, model.path
        return
    assert model.path.startswith("stacked"), model.path
    model.train(model.way.randomness == "error")
    x = torch.randn(3, 6, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for a, b in zip(grads(model, model.stacked, x), grads(model, model.looped, x)):
        a = torch.zeros_like(b) if a is None and b is not None else a  # no gradient: zero
        b = torch.zeros_like(a) if b is None and a is not None else b
        if a is not None:  # relative to the tensor's largest entry (some tuners compute in float32 inside)
            assert (a - b).abs().max() <= 1e-5 * b.abs().max().clamp_min(1e-12), (kind, (a - b).abs().max())


def test_a_rewrite_that_computes_otherwise_leaves_its_tuner_looped(monkeypatch):
    """Planted bug: shira's dense rewrite 1% off peft's sparse update. The probe compares it with peft's own code
    (off the start) and keeps the loop, saying why; the true rewrite stacks."""
    from qlbench.adapters import peft_rewrites

    assert stack("deep-narrow", "shira").path.startswith("stacked")
    true = peft_rewrites.shira_delta_weight
    monkeypatch.setattr(peft_rewrites, "shira_delta_weight", lambda layer, adapter: 1.01 * true(layer, adapter))
    path = stack("deep-narrow", "shira").path
    assert path.startswith("looped: ") and "differ from the loop's" in path, path


def test_peft_s_c3a_backward_is_not_its_forward_s_derivative_so_c3a_stays_looped():
    """Why c3a loops: differentiated through its forward's math (as the stacked path would), C3A's circular
    convolution gets the input gradient that a central difference measures; peft's own backward gives another.
    qlbench trains peft's c3a as peft does, so it keeps the loop. If peft's backward is changed to the derivative,
    this test fails and c3a can stack."""
    from peft.tuners.c3a.utils import BlockCircularConvolution as Conv

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=g, dtype=torch.float64, requires_grad=True)  # (rows, n * b)
    w = torch.randn(2, 2, 4, generator=g, dtype=torch.float64)  # (m, n, b)
    probe = torch.randn(3, 8, generator=g, dtype=torch.float64)
    plain = lambda x: (Conv.forward(member._Context(), x, w) * probe).sum()
    numeric = torch.zeros(8, dtype=torch.float64)
    for i in range(8):  # the central difference of row 0's input
        step = torch.zeros(3, 8, dtype=torch.float64)
        step[0, i] = 1e-6
        numeric[i] = (plain(x.detach() + step) - plain(x.detach() - step)) / 2e-6
    derivative = torch.autograd.grad(plain(x), x)[0][0]
    peft_s = torch.autograd.grad((Conv.apply(x, w) * probe).sum(), x)[0][0]
    torch.testing.assert_close(derivative, numeric, rtol=1e-6, atol=1e-6)
    assert (peft_s - numeric).abs().max() > 0.1


# vera: the plain way; fourierft: tensors made in the forward carry the member dimension; frod: a rewrite and an
# index table passed once
@pytest.mark.parametrize("kind", ["vera", "fourierft", "frod"])
def test_the_stack_keeps_each_member_to_itself(kind):
    """Member 1 of the stack equals member 1 alone (the one-member module with its slices, peft's own code), and
    stays so when member 0's trainable tensors change; a planted swap of members 0 and 1 changes it, so the check
    can fail."""
    model = stack("deep-narrow", kind)
    assert model.path.startswith("stacked")
    x = torch.randn(3, 5, 2, generator=torch.Generator().manual_seed(2))
    trainable = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for i, p in enumerate(trainable):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(10 + i)) * 0.1)  # off the zero start
        state = model._state()
        alone = torch.func.functional_call(model.template, {k: v[1] for k, v in state.items()}, (x[1:2],))
        torch.testing.assert_close(model(x)[1:2], alone, rtol=1e-6, atol=0)
        for p in trainable:
            p[0] += 1.0
        torch.testing.assert_close(model(x)[1:2], alone, rtol=1e-6, atol=0)
        for p in trainable:
            p.copy_(p[[1, 0, 2]])  # planted: members 0 and 1 swapped
        assert not torch.allclose(model(x)[1:2], alone, rtol=1e-3)


@pytest.mark.parametrize("arch", BOTH)
@pytest.mark.parametrize("kind", RUNNABLE)
def test_every_runnable_tuner_takes_a_step_on_both_backbones(arch, kind):
    """Two members, one AdamW step: finite outputs, every member's trainable tensors move where they have a
    gradient, and the frozen backbone stays put."""
    model = stack(arch, kind, members=2)
    model = model.to(torch.float32)
    x = torch.randn(2, 8, 2, generator=torch.Generator().manual_seed(3))
    y = torch.randn(2, 8, generator=torch.Generator().manual_seed(4))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert trainable, kind
    method = adapters.get(peft_tuners.PREFIX + kind)
    opt = method.optimizer(model, None, lr=1e-2, weight_decay=0.0)
    loss = ((model(x) - y) ** 2).mean()
    assert torch.isfinite(loss)
    loss.backward()
    opt.step()
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], v) for n, v in frozen.items())
    moved = [n for n, v in trainable.items() if params[n].grad is not None and not torch.equal(params[n], v)]
    assert moved, f"{kind}: no trainable tensor moved"
    assert torch.isfinite(model(x)).all()


def test_refused_and_unknown_tuners_are_one_line_errors():
    with pytest.raises(ValueError, match=r"peft:adalora is refused: needs update_and_allocate"):
        adapters.get("peft:adalora")
    with pytest.raises(ValueError, match=r"unknown peft tuner 'nonsense'.*valid: .*lora"):
        adapters.get("peft:nonsense")


def test_config_fields_are_peft_s_checked_by_type_and_by_peft():
    method = adapters.get("peft:lora")
    assert method.make_config(r=4).r == 4
    with pytest.raises(ValueError, match=r"r must be int, got 'x'"):
        method.make_config(r="x")
    with pytest.raises(ValueError, match=r"peft_version is the installed peft's"):
        method.make_config(peft_version="0.0.1")
    with pytest.raises(ValueError, match=r"bias"):  # peft's own check of a value of the right type
        method.make_config(bias="sometimes")


def test_the_cli_names_a_bad_tuner_key_in_one_line(capsys):
    from helpers import one_line_error

    line = one_line_error(
        capsys, ["run", "--function", "matyas", "--methods", "peft:vera", "--hp", "rank=4", "--budget", "smoke"]
    )
    assert "unknown hyper-parameter(s) rank" in line and "valid:" in line and "r," in line
    line = one_line_error(capsys, ["run", "--function", "matyas", "--methods", "peft:adalora", "--budget", "smoke"])
    assert "peft:adalora is refused" in line


@pytest.mark.slow
def test_the_tuner_table_in_the_docs_is_what_the_installed_peft_gives(capsys):
    """`methods --peft --no-progress`: the table of docs/methods.md, and nothing on stderr (peft's own progress bars,
    frod's decomposition, once leaked there)."""
    from pathlib import Path

    from qlbench import cli

    assert cli.main(["methods", "--peft", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    docs = (Path(__file__).parents[1] / "docs/methods.md").read_text()
    assert out.strip() in docs and err == ""


def test_bench_times_a_tuner_stacked_and_looped_beside_lora():
    """`qlbench bench`'s "members" rows: a stacked tuner gets both rates and their ratio, a looping one only the loop,
    with the reason it loops; the method's other bench rows are left out (it is not one of qlbench's stacks)."""
    from qlbench import bench
    from qlbench.bench.members import member_rows

    s = bench.Settings({"deep-narrow": 1}, 1, (2,), 1, 1, False)
    rows = member_rows("deep-narrow", ["peft:ia3", "peft:c3a"], 2, s, "cpu")
    ia3, c3a = rows
    assert ia3["path"] == "stacked" and ia3["stacked"] > 0 and ia3["looped"] > 0 and ia3["stacked_vs_loop"] > 0
    assert c3a["path"].startswith("looped: vmap failed") and c3a["stacked"] is None and c3a["looped"] > 0
    labels = [label for label, _ in bench.tasks(["deep-narrow"], ["peft:ia3"], s, "cpu", {})]
    assert "deep-narrow methods written for one member E=2" in labels
    assert not [label for label in labels if "peft:" in label]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deep-narrow", "transformer"])
@pytest.mark.parametrize("kind", RUNNABLE)
def test_every_runnable_tuner_adapts_at_the_smoke_budget(arch, kind):
    """Through the engine, as `qlbench run` trains it: every seed's curves finite (or its divergence reported, never
    a crash), and the trainable parameters moved."""
    method = peft_tuners.PREFIX + kind
    start = {}
    prepare = lambda model: start.update(
        {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    )
    config = adapters.get(method).make_config()
    res = engine.adapt(
        pretrained(arch),
        engine.Adaptation(method, config, SMOKE[arch]),
        engine.Runtime("cpu"),
        prepare=prepare,
        diagnostics=False,
    )
    finished = [i for i, d in enumerate(res.curves.diverged_epoch) if d is None]
    assert all(torch.isfinite(res.curves.test_mse[i]).all() for i in finished)
    params = dict(res.model.named_parameters())
    assert any(not torch.equal(params[n], v) for n, v in start.items()), kind


def test_capture_auto_stays_off_for_a_tuner_on_cuda(tmp_path):
    """Planned for CUDA machines (a Ray cluster's: cuda=True, nothing allocated here): auto records qlbench's own
    methods' steps in CUDA graphs, but not a run that holds a peft tuner; on records it anyway."""
    from qlbench.experiments import experiment

    plan = lambda methods, capture: experiment.plan(
        functions=["matyas"],
        methods=methods,
        protocol=Protocol(arch="deep-narrow", budget="smoke"),
        execution=Execution(device="cuda", cuda=True, capture=capture, out_dir=tmp_path),
    )
    assert plan(["lora"], "auto").capture is True
    assert plan(["lora", "peft:ia3"], "auto").capture is False
    assert plan(["peft:ia3"], "on").capture is True


def test_a_tuner_trains_in_a_suite_and_its_record_says_how(tmp_path, capsys):
    """`qlbench suite --methods peft:lora`: a continual (sequential) suite row of peft's LoRA, every task's MSE
    recorded after every stage, finite, its trainable count LoRA's and the path it trained on in the record."""
    out = tmp_path / "results"
    argv = ["suite", "--suite", "zoo-4", "--schedule", "sequential", "--methods", "peft:lora,peft:c3a"]
    argv += ["--budget", "smoke", "--seeds", "2", "--out", str(out), "--no-progress", "--threads", "1"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    for kind, path in (("lora", "stacked"), ("c3a", "looped: vmap failed")):
        (record,) = (out / f"suites/deep-narrow/zoo-4/sequential/peft:{kind}").glob("*.json")
        rec = json.loads(record.read_text())
        assert rec["run_info"]["settings"]["member_path"].startswith(path)
        assert rec["train_info"]["trainable_params"] == {"lora": 16384, "c3a": 1024}[kind]
        for seed in rec["train_info"]["per_seed"]:
            stages = seed["stage_task_mse"]  # (stages, tasks)
            assert len(stages) == 4 and all(len(s) == 4 for s in stages)
            assert all(v is not None and math.isfinite(v) for s in stages for v in s)


@pytest.mark.parametrize("arch", BOTH)
def test_every_runnable_tuner_is_planned_shapes_only(arch):
    """A sweep plans before it trains: every method is built on a meta-device backbone for its sizes
    (planning.dry_build). tinylora and unilora hold tensors torch cannot move to the meta device; the plan crashed
    there, a traceback before any work. Every runnable tuner now gives its sizes, trainable count as when built."""
    from qlbench.experiments import planning

    prefix = peft_tuners.PREFIX
    sizes = planning.dry_build(arch, {prefix + k: adapters.get(prefix + k).make_config() for k in RUNNABLE})
    for kind in ("lora", "tinylora", "unilora"):
        held, trainable = sizes[prefix + kind]
        assert trainable == adapters.trainable_parameter_count(stack(arch, kind, members=1)) and held >= trainable


def test_a_peft_tuner_without_peft_installed_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    import sys

    from qlbench import adapters

    from helpers import one_line_error

    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError, as where it is not installed
    monkeypatch.delitem(adapters.LOADED, "peft:lora", raising=False)  # a fresh process: not loaded by an earlier test
    argv = ["run", "--function", "matyas", "--methods", "peft:lora", "--budget", "smoke", "--out", str(tmp_path)]
    assert "peft:lora needs peft, which is not installed: pip install 'qlbench[hf]'" in one_line_error(capsys, argv)
    assert not (tmp_path / "backbones").exists()
