"""Poly / MHR against peft 0.21's `poly` tuner (a test-only dependency) in float64: two layers 16 -> 12 -> 8 with a
tanh between, 3 tasks (and 1: LoRA's path), 3 skills, 1, 2 and 4 splits, the same skills (B nonzero) and allocation
logits on both sides, peft in eval mode (its sigmoid allocation, which qlbench uses in training too); a batch mixing
the tasks, as samples (qlbench's MLP path) and as token sequences (its Transformer path). Compared: outputs and the
gradients of the input, every layer's A, B and logits. Planted bugs (a softmax allocation; two tasks' logits
swapped) fail the comparison. Plus: identity at init on both backbones, the trainable count by hand, a task's
gradient on its own logits only, a mixed batch equal to one forward per task, a stage's weight decay on its own
tasks' logits only, and bad splits refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from qlbench import adapters, backbones
from qlbench.adapters import poly
from qlbench.adapters.base import Site, isolate_tasks
from qlbench.backbones import DeepNarrowMLP, RegressionTransformer, Target
from qlbench.experiments import planning
from qlbench.stacked import ForwardContext, StackedLinear

from helpers import F64, TINY_DEEP_NARROW, TINY_TRANSFORMER, gens, outputs_and_gradients

peft = pytest.importorskip("peft")

DIMS, R, SKILLS, T, N = (16, 12, 8), 2, 3, 3, 7
TOL = dict(rtol=1e-10, atol=1e-12)


class Net(nn.Module):
    """fc0 (16 -> 12), tanh, fc1 (12 -> 8): two target layers of different shapes."""

    def __init__(self):
        super().__init__()
        self.fc0, self.fc1 = (nn.Linear(a, b, dtype=F64) for a, b in zip(DIMS, DIMS[1:]))

    def forward(self, x):
        return self.fc1(torch.tanh(self.fc0(x)))


def weights(splits: int, tokens: int, tasks: int = T):
    """Per layer: (W, b, A (K r, d_in), B (d_out, K r), logits (T, Q K)) in qlbench's layout; x, task, upstream."""
    g = torch.Generator().manual_seed(splits)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=F64)  # noqa: E731
    layers = [
        (rnd(b, a) / 3, rnd(b), rnd(SKILLS * R, a) / 3, rnd(b, SKILLS * R) / 3, rnd(tasks, splits * SKILLS))
        for a, b in zip(DIMS, DIMS[1:])
    ]
    x, upstream = rnd(N, tokens, DIMS[0]), rnd(N, tokens, DIMS[-1])
    task = torch.tensor([0, 2, 1, 1, 0, 2, 2]) % tasks  # every task, mixed
    return layers, x, task, upstream


def peft_A(A, splits):
    """(K r, d_in) -> peft's (Q, K, d_in / Q, r)."""
    return A.view(SKILLS, R, splits, -1).permute(2, 0, 3, 1)


def peft_B(B, splits):
    """(d_out, K r) -> peft's (Q, K, r, d_out / Q)."""
    return B.view(splits, -1, SKILLS, R).permute(0, 2, 3, 1)


def peft_model(layers, splits, task):
    config = peft.PolyConfig(
        r=R, n_tasks=len(layers[0][4]), n_skills=SKILLS, n_splits=splits, target_modules=["fc0", "fc1"]
    )
    model = peft.get_peft_model(Net(), config).eval()  # eval: the sigmoid allocation, no relaxed-Bernoulli sample
    inner, params = model.base_model.model, {}
    with torch.no_grad():
        for i, (W, b, A, B, z) in enumerate(layers):
            fc = getattr(inner, f"fc{i}")
            fc.base_layer.weight.copy_(W)
            fc.base_layer.bias.copy_(b)
            fc.poly_lora_A["default"].copy_(peft_A(A, splits))
            fc.poly_lora_B["default"].copy_(peft_B(B, splits))
            fc.poly_router["default"].module_logits.copy_(z)
            params |= {
                f"A{i}": fc.poly_lora_A["default"],
                f"B{i}": fc.poly_lora_B["default"],
                f"z{i}": fc.poly_router["default"].module_logits,
            }
    assert all(p.dtype == F64 for p in params.values())
    return (lambda x: model.base_model(x, task_ids=task)), params


def qlbench_model(layers, splits, task):
    """The registered layers (E = 1), as inject builds them; forward x (N, tokens, d) -> (N, tokens, d_out): tokens 1
    goes through the (E, N, d) path of the MLP, more through the (E, N, tokens, d) path of the Transformer."""
    method = adapters.get("poly")
    config = method.make_config(r=R, n_skills=SKILLS, n_splits=splits, tasks=len(layers[0][4]))
    built, params = [], {}
    for i, (W, b, A, B, z) in enumerate(layers):
        base = StackedLinear(W.shape[1], W.shape[0], gens("base", members=1), dtype=F64).requires_grad_(False)
        layer = method.layer_cls(base, Site(Target(f"fc{i}", "hidden", i), i, 2), config, gens("init", members=1))
        with torch.no_grad():
            for p, v in (
                (base.weight, W),
                (base.bias, b),
                (layer.poly_A, A),
                (layer.poly_B, B),
                (layer.poly_logits, z),
            ):
                p.copy_(v.unsqueeze(0))
        built.append(layer)
        params |= {f"A{i}": layer.poly_A, f"B{i}": layer.poly_B, f"z{i}": layer.poly_logits}

    def forward(x):
        h, ctx = x.unsqueeze(0), ForwardContext(nn.ModuleDict(), task=task.unsqueeze(0))
        if x.shape[1] == 1:
            h = h.squeeze(2)  # (1, N, d)
        h = built[1](torch.tanh(built[0](h, ctx)), ctx)
        return h[0].reshape(x.shape[0], x.shape[1], -1)

    return forward, params


def to_peft(name: str, grad: torch.Tensor, splits: int) -> torch.Tensor:
    """One of qlbench's gradients (1, ...) in peft's layout."""
    g = grad[0]
    return peft_A(g, splits) if name[0] == "A" else peft_B(g, splits) if name[0] == "B" else g


def compare(splits: int, tokens: int, tasks: int = T, *, swap: bool = False) -> dict[str, float]:
    """qlbench's outputs and gradients against peft's (AssertionError on the first difference); the largest
    absolute differences. `swap`: qlbench's first layer gets tasks 0 and 1's logits swapped (a planted bug)."""
    layers, x, task, upstream = weights(splits, tokens, tasks)
    ours_layers = list(layers)
    if swap:
        W, b, A, B, z = layers[0]
        ours_layers[0] = (W, b, A, B, z[[1, 0, 2]])
    ours, ours_params = qlbench_model(ours_layers, splits, task)
    theirs, theirs_params = peft_model(layers, splits, task)
    y, gx, grads = outputs_and_gradients(ours, ours_params, x, upstream)
    y_ref, gx_ref, grads_ref = outputs_and_gradients(theirs, theirs_params, x, upstream)
    diffs = {"output": (y - y_ref).abs().max().item(), "input gradient": (gx - gx_ref).abs().max().item()}
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(gx, gx_ref, **TOL)
    for name, g_ref in grads_ref.items():
        g = to_peft(name, grads[name], splits)
        diffs[name] = (g - g_ref).abs().max().item()
        torch.testing.assert_close(g, g_ref, **TOL, msg=f"gradient of {name}")
    return diffs


@pytest.mark.parametrize("tokens", [1, 3], ids=["samples", "sequences"])
@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("tasks", [T, 1], ids=["tasks-3", "one-task"])  # per-sample weights; LoRA's merged path
def test_poly_matches_peft_outputs_and_gradients(tasks, splits, tokens):
    layers, x, task, _ = weights(splits, tokens, tasks)
    theirs, _ = peft_model(layers, splits, task)
    frozen = Net()
    with torch.no_grad():
        for i, (W, b, *_) in enumerate(layers):
            getattr(frozen, f"fc{i}").weight.copy_(W)
            getattr(frozen, f"fc{i}").bias.copy_(b)
        assert (theirs(x) - frozen(x)).abs().max() > 0.1  # the update is live: the comparison is not trivial
        if tasks > 1:
            other = task.clone()
            other[0] = 1  # the allocation matters: sample 0 through task 1's weights moves it
            assert (peft_model(layers, splits, other)[0](x)[0] - theirs(x)[0]).abs().max() > 1e-3
    diffs = compare(splits, tokens, tasks)
    print(tasks, splits, tokens, max(diffs.values()), diffs)


def _softmax_allocation(self):
    """Planted: a softmax allocation in place of peft's normalised sigmoid."""
    return torch.softmax(self.poly_logits.unflatten(-1, (self.n_splits, self.n_skills)), -1)


@pytest.mark.parametrize("splits", [1, 2])
def test_a_planted_bug_fails_the_peft_comparison(monkeypatch, splits):
    with pytest.raises(AssertionError):
        compare(splits, 3, swap=True)  # two tasks' logits swapped in one layer
    monkeypatch.setattr(poly.PolyLinear, "allocation", _softmax_allocation)
    for tasks in (T, 1):
        with pytest.raises(AssertionError):
            compare(splits, 3, tasks)


# ---------------------------------------------------------------------------------------------------------------
# On the backbones

ARCHS = {
    "deep-narrow": lambda: DeepNarrowMLP(gens("bb", members=2), TINY_DEEP_NARROW, dtype=F64),
    "transformer": lambda: RegressionTransformer(gens("bb", members=2), TINY_TRANSFORMER, dtype=F64),
}


def build(arch: str, **overrides) -> nn.Module:
    m = adapters.get("poly")
    return m.build(ARCHS[arch](), m.make_config(**overrides), gens("init", members=2), torch.zeros(2, 1, dtype=F64))


def inputs(n: int = 12):
    g = torch.Generator().manual_seed(5)
    x = torch.rand(2, n, 2, generator=g, dtype=F64) * 4 - 2  # (E, N, 2)
    return x, torch.randint(0, T, (2, n), generator=g)  # task (E, N)


def perturb(model: nn.Module, scale: float = 0.3) -> None:
    """Every trainable tensor moved by seeded noise (B leaves zero, the logits leave their near-uniform init)."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("arch", ARCHS)
def test_equals_the_frozen_backbone_at_init_and_trains_in_a_suite_like_forward(arch, splits):
    model, frozen = build(arch, tasks=T, n_splits=splits), ARCHS[arch]()
    layers = [m for m in model.modules() if isinstance(m, poly.PolyLinear)]
    assert layers and all(torch.equal(m.poly_B, torch.zeros_like(m.poly_B)) for m in layers)
    assert all(m.poly_logits.abs().max() <= poly.LOGIT_BOUND for m in layers)
    x, task = inputs()
    assert torch.equal(model(x, task=task), frozen(x))
    perturb(model)
    y = model(x, task=task)  # (E, N): the suite's forward, each sample its task's allocation
    assert y.shape == task.shape and torch.isfinite(y).all() and not torch.allclose(y, frozen(x))
    y.pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "arch, L, d",
    [("deep-narrow", 32, 32), ("transformer", 32, 256)],  # 32 hidden 32 x 32 layers; q, k, v, o of 8 layers
)
def test_trainable_parameters_by_hand(arch, L, d):
    """L (K r (d_in + d_out) + T Q K): the skills, and one row of Q K logits per task and layer."""
    method = adapters.get("poly")
    for settings, (K, r, Q, tasks) in (({}, (4, 8, 1, 1)), ({"tasks": 4, "n_splits": 2, "n_skills": 3}, (3, 8, 2, 4))):
        count = planning.dry_build(arch, {"poly": method.make_config(**settings)})["poly"][1]
        assert count == L * (K * r * 2 * d + tasks * Q * K), (arch, settings)
    assert (
        planning.dry_build(arch, {"poly": method.make_config()})["poly"][1]
        == {
            "deep-narrow": 65_664,
            "transformer": 524_416,
        }[arch]
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_a_tasks_gradient_reaches_only_its_own_logits(arch):
    model = build(arch, tasks=T, n_splits=2)
    perturb(model)
    x, _ = inputs()
    model(x, task=torch.full(x.shape[:2], 1)).pow(2).sum().backward()
    for m in model.modules():
        if isinstance(m, poly.PolyLinear):
            g = m.poly_logits.grad  # (E, T, Q K)
            assert torch.equal(g[:, [0, 2]], torch.zeros_like(g[:, [0, 2]])) and (g[:, 1].abs() > 0).all()
            assert m.poly_A.grad.abs().max() > 0 and m.poly_B.grad.abs().max() > 0  # the skills are shared


@pytest.mark.parametrize("arch", ARCHS)
def test_a_mixed_batch_equals_one_forward_per_task(arch):
    """The loss of a batch mixing tasks, and its gradients, equal the task-by-task forwards: no sample sees another
    task's allocation."""
    model = build(arch, tasks=T, n_splits=2)
    perturb(model)
    x, task = inputs()
    y = torch.sin(x.sum(-1))
    params = [p for p in model.parameters() if p.requires_grad]
    mixed = (model(x, task=task) - y).pow(2).sum()
    split = sum(
        ((model(x, task=torch.full(x.shape[:2], t)) - y).pow(2) * (task == t)).sum() for t in range(T)
    )  # every sample through task t, only task t's samples counted
    torch.testing.assert_close(split, mixed, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(mixed, params), torch.autograd.grad(split, params)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_stage_decays_only_its_own_tasks_logits():
    """Training task 1 with isolate_tasks (a sequential stage) leaves tasks 0 and 2's logits bit for bit; the plain
    optimiser's weight decay moves them (so the check can fail)."""
    for isolate in (True, False):
        model = build("deep-narrow", tasks=T)
        perturb(model)
        logits = [m.poly_logits for m in model.modules() if isinstance(m, poly.PolyLinear)]
        before = [z.detach().clone() for z in logits]
        opt = adapters.get("poly").optimizer(model, None, lr=1e-2, weight_decay=0.01)
        if isolate:
            opt = isolate_tasks(opt, model, [1])
        x, _ = inputs()
        for _ in range(5):
            model(x, task=torch.full(x.shape[:2], 1)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        untouched = all(torch.equal(a[:, [0, 2]], b[:, [0, 2]]) for a, b in zip(before, logits))
        assert untouched == isolate
        assert not any(torch.equal(a[:, 1], b[:, 1]) for a, b in zip(before, logits))


def test_without_a_task_every_sample_is_task_0():
    model = build("transformer", tasks=T)
    perturb(model)
    x, _ = inputs()
    assert torch.equal(model(x), model(x, task=torch.zeros(x.shape[:2], dtype=torch.long)))


def test_splits_that_do_not_divide_the_layers_are_one_clear_error():
    method = adapters.get("poly")
    backbone = backbones.build_backbone("deep-narrow", [0])
    with pytest.raises(ValueError, match="n_splits=3 must divide every adapted layer's d_in and d_out"):
        method.build(backbone, method.make_config(n_splits=3), [torch.Generator()], torch.zeros(1, 4))
    with pytest.raises(ValueError, match="n_skills must be an integer >= 1, got 0"):
        method.make_config(n_skills=0)
