"""text-lora (Text-to-LoRA, arXiv 2506.06105): a hypernetwork shared by all layers generates each layer's LoRA
factors from the task's instruction embedding. The oracle is LoRA itself: every layer's A_l, B_l computed by hand,
member by member and layer by layer, from the hypernetwork's parameters (its own layer norm, no batched ops), copied
into a plain LoRA, gives the same outputs; with two tasks bound, each sample matches the LoRA of its own task."""

from __future__ import annotations

import copy

import pytest
import torch

from qlbench import adapters, instructions, zoo
from qlbench.adapters import instruct, text_lora
from qlbench.backbones import DeepNarrowConfig, DeepNarrowMLP, RegressionTransformer, TransformerConfig
from qlbench.experiments import planning
from qlbench.seeding import generator
from qlbench.settings import Execution, Protocol
from qlbench.stacked import ForwardContext

F64 = torch.float64
MEMBERS = [("dropwave", 0), ("levy", 1)]
SMALL_TRANSFORMER = TransformerConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32)
ARCHS = {
    "deep-narrow": lambda g: DeepNarrowMLP(g, DeepNarrowConfig(depth=4), dtype=F64),
    "transformer": lambda g: RegressionTransformer(g, SMALL_TRANSFORMER, dtype=F64),
}


def gens(tag: str) -> list[torch.Generator]:
    return [generator("test-text-lora", tag, *m) for m in MEMBERS]


def build(name: str, arch: str, **config):
    """`name` on a fresh float64 stack of two members (the same backbone for every name)."""
    method = adapters.get(name)
    model = method.build(ARCHS[arch](gens("backbone")), method.make_config(**config), gens("init"), None)
    return model


def randomise(model, seed: int = 7, std: float = 0.1) -> None:
    """Every trainable parameter drawn at random (the B head too, so the update is not zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * std)


def instruction(T: int | None, d_c: int = instructions.DIM, seed: int = 3) -> torch.Tensor:
    """Random e: (E, d_c) for T None, else (E, T, d_c)."""
    g = torch.Generator().manual_seed(seed)
    shape = (len(MEMBERS), d_c) if T is None else (len(MEMBERS), T, d_c)
    return torch.randn(shape, generator=g, dtype=F64)


def x_of(n: int = 24) -> torch.Tensor:
    return torch.rand(len(MEMBERS), n, 2, generator=torch.Generator().manual_seed(11), dtype=F64) * 2 - 1


def norm(v: torch.Tensor) -> torch.Tensor:
    """Layer norm without affine parameters, written out (eps 1e-5, biased variance)."""
    mu = v.mean()
    return (v - mu) / torch.sqrt(((v - mu) ** 2).mean() + 1e-5)


def by_hand(net, member: int, e: torch.Tensor, layer: int, role: int, shape: str, r: int = 8):
    """One layer's (A_l (r, d_in), B_l (d_out, r)) for one member and one instruction vector e (d_c,), from the
    hypernetwork's parameters: z = [LN(P e + p); LN(E_layer[l]); LN(E_role[role])], h = silu(W1 z + b1),
    A = W_A h + b_A, B = W_B h + b_B (row-major views)."""
    m = member
    z = torch.cat(
        [norm(net.task_proj[m] @ e + net.task_bias[m]), norm(net.layer_emb[m, layer]), norm(net.role_emb[m, role])]
    )
    pre = net.W1[m] @ z + net.b1[m]
    h = pre / (1 + torch.exp(-pre))  # silu
    head = net.heads[shape]
    A = (head.A_weight[m] @ h + head.A_bias[m]).reshape(r, head.d_in)
    B = (head.B_weight[m] @ h + head.B_bias[m]).reshape(head.d_out, r)
    return A, B


def lora_from(model, arch: str, table: torch.Tensor, task: int, layer_shift: int = 0):
    """A plain LoRA on the same backbone whose every layer holds the hand-computed factors of `task`'s row of
    `table` (E, T, d_c). layer_shift plants a bug: each layer takes the next layer's embedding."""
    lora = build("lora", arch)
    net = model.shared[text_lora.FAMILY]
    targets = model.adapter_targets()
    roles = list(dict.fromkeys(t.role for t in targets))
    with torch.no_grad():
        for t in targets:
            target = lora.get_submodule(t.path)
            shape = f"{target.base.d_out}x{target.base.d_in}"
            layer = (t.layer + layer_shift) % model.n_layers
            for m in range(len(MEMBERS)):
                A, B = by_hand(net, m, table[m, task], layer, roles.index(t.role), shape)
                target.lora_A[m].copy_(A)
                target.lora_B[m].copy_(B)
    return lora


@pytest.mark.parametrize("arch", ARCHS)
def test_one_instruction_per_member_is_lora_with_the_generated_factors(arch):
    model = build("text-lora", arch)
    randomise(model)
    e = instruction(None)
    model.shared["text_lora"].bind_instruction(e)
    x = x_of()
    lora = lora_from(model, arch, e.unsqueeze(1), task=0)
    assert lora.get_submodule(model.adapter_targets()[0].path).lora_B.abs().min() > 0  # a real update
    torch.testing.assert_close(model(x), lora(x), rtol=1e-10, atol=1e-10)


def mixed_tasks(T: int = 2, n: int = 24) -> torch.Tensor:
    task = torch.randint(0, T, (len(MEMBERS), n), generator=torch.Generator().manual_seed(5))
    assert set(task.unique().tolist()) == set(range(T))
    return task


def two_task_outputs(arch: str, swap: bool = False, layer_shift: int = 0):
    """text-lora with two tasks bound (E, 2, d_c) on a batch mixing them, and the oracle: each sample through the
    LoRA built from its own task's factors (`swap`, `layer_shift`: planted bugs in the oracle)."""
    model = build("text-lora", arch, tasks=2)
    randomise(model)
    table = instruction(2)
    model.shared["text_lora"].bind_instruction(table)
    x, task = x_of(), mixed_tasks()
    loras = [lora_from(model, arch, table, t, layer_shift) for t in range(2)]
    if swap:
        loras.reverse()
    per_task = [lora(x) for lora in loras]  # (E, N) each
    expected = torch.where(task == 0, per_task[0], per_task[1])
    assert not torch.allclose(per_task[0], per_task[1], rtol=1e-6, atol=0)  # the tasks differ: the check is one
    return model(x, task=task), expected


@pytest.fixture(params=["masked", "through-hidden"])
def path(request, monkeypatch):
    """Both ways a layer computes a many-task batch: generated factors masked per task (few tasks), and from the
    trunk's output without forming a factor (many tasks: forced here by lowering the threshold)."""
    if request.param == "through-hidden":
        monkeypatch.setattr(text_lora, "MASKED_TASKS", 1)
    return request.param


@pytest.mark.parametrize("arch", ARCHS)
def test_each_sample_matches_the_lora_of_its_own_task(arch, path):
    got, expected = two_task_outputs(arch)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("bug", [dict(swap=True), dict(layer_shift=1)], ids=["swapped-task-rows", "next-layer-emb"])
def test_a_planted_bug_fails_the_comparison(bug, path):
    got, expected = two_task_outputs("deep-narrow", **bug)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("arch", ARCHS)
def test_it_starts_as_the_frozen_backbone(arch):
    frozen = ARCHS[arch](gens("backbone"))
    model = build("text-lora", arch, tasks=2)
    model.shared["text_lora"].bind_instruction(instruction(2))
    x = x_of()
    assert torch.equal(model(x, task=mixed_tasks()), frozen(x))
    assert torch.equal(model(x), frozen(x))


def test_a_forward_without_an_instruction_is_refused():
    model = build("text-lora", "deep-narrow")
    with pytest.raises(ValueError, match="text-lora generates every layer's LoRA factors from the task's instruction"):
        model(x_of())


def test_a_forward_instruction_overrides_the_bound_one_and_task_none_is_task_0():
    model = build("text-lora", "deep-narrow", tasks=2)
    randomise(model)
    table, x = instruction(2), x_of()
    model.shared["text_lora"].bind_instruction(instruction(2, seed=9))
    given = model(x, instruction=table, task=mixed_tasks())
    model.shared["text_lora"].bind_instruction(table)
    torch.testing.assert_close(given, model(x, task=mixed_tasks()), rtol=0, atol=0)
    # no task indices: every sample is task 0, as a table of task 0 alone
    alone = model(x, instruction=table[:, 0])
    torch.testing.assert_close(model(x), alone, rtol=1e-10, atol=1e-12)
    # a suite's table bound as suite_tasks.bind does it: one (T, d_c) expanded over the members
    model.shared["text_lora"].bind_instruction(table[0].expand(len(MEMBERS), -1, -1))
    assert model.shared["text_lora"].instruction.is_contiguous()
    one = model(x, instruction=table[0, 0].expand(len(MEMBERS), -1))  # T = 1: the merged LoRA path
    torch.testing.assert_close(model(x), one, rtol=1e-10, atol=1e-12)


def test_the_hypernetwork_runs_once_per_key_per_forward_over_every_member_and_task(monkeypatch):
    model = build("text-lora", "transformer", tasks=3)
    net = model.shared["text_lora"]
    net.bind_instruction(instruction(3))
    calls = []
    original = type(net).forward

    def counted(self, key, table):
        A, B = original(self, key, table)
        calls.append((key, tuple(A.shape), tuple(B.shape)))
        return A, B

    monkeypatch.setattr(type(net), "forward", counted)
    model(x_of(), task=mixed_tasks(3))
    E, L, d = len(MEMBERS), 2, 16
    assert sorted(calls) == [(f"{k}_16x16", (E, L, 3 * 8, d), (E, L, d, 3 * 8)) for k in "koqv"]
    assert list(net.heads) == ["16x16"]  # q, k, v, o share one head pair: one shape


def test_bind_instruction_checks_the_shape():
    net = build("text-lora", "deep-narrow").shared["text_lora"]
    for bad in (torch.zeros(2, 383), torch.zeros(3, 384), torch.zeros(2, 1, 1, 384), torch.zeros(384)):
        with pytest.raises(ValueError, match="text-lora binds e"):
            net.bind_instruction(bad)


def test_gradients_reach_the_hypernetwork_only():
    model = build("text-lora", "transformer", tasks=2)
    randomise(model)
    model.shared["text_lora"].bind_instruction(instruction(2))
    (model(x_of(), task=mixed_tasks()) ** 2).sum().backward()
    named = dict(model.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable and all(n.startswith("shared.text_lora.") for n in trainable)
    assert all(named[n].grad is not None and named[n].grad.abs().max() > 0 for n in trainable)
    assert all(p.grad is None for n, p in named.items() if n not in trainable)


def test_trainable_parameters_by_hand():
    """d_t (d_c + 1) + (n + R) d_e + d_h (d_t + 2 d_e + 1) + sum over shapes (d_h + 1) r (d_in + d_out), at d_t = 32,
    d_e = 16, d_h = 32, r = 8, d_c = 384: the deep-narrow (n = 32 layers, one role, one 32 x 32 shape) and the
    Transformer (n = 8, q k v o, one 256 x 256 shape); within 10% of instruct-queryable's on both."""
    trunk = 32 * 385 + 32 * 64 + 32
    want = {
        "deep-narrow": trunk + (32 + 1) * 16 + 33 * 8 * (32 + 32),
        "transformer": trunk + (8 + 4) * 16 + 33 * 8 * (256 + 256),
    }
    assert want == {"deep-narrow": 31_824, "transformer": 149_760}
    configs = {m: adapters.get(m).make_config() for m in ("text-lora", "instruct-queryable")}
    for arch, n in want.items():
        sizes = planning.dry_build(arch, configs)
        assert sizes["text-lora"][1] == n, arch
        assert abs(n / sizes["instruct-queryable"][1] - 1) <= 0.10, arch
    # the task count does not change any shape
    tasks = planning.dry_build("deep-narrow", {"text-lora": adapters.get("text-lora").make_config(tasks=4)})
    assert tasks["text-lora"][1] == want["deep-narrow"]


def test_bind_gives_each_member_its_card_instruction():
    method = adapters.get("text-lora")
    for source in ("card", "random"):
        config = method.make_config(instruction_source=source, instruction_dim=64)
        model = build("text-lora", "deep-narrow", instruction_source=source, instruction_dim=64)
        method.bind(model, MEMBERS, config)
        got = model.shared["text_lora"].instruction
        torch.testing.assert_close(got, instruct.METHOD.instructions(MEMBERS, config), rtol=0, atol=0)
        assert got.shape == (2, 64)
    cards = instructions.embed([zoo.card(f).instruction for f, _ in MEMBERS]).to(F64)
    config = method.make_config()
    model = build("text-lora", "deep-narrow")
    method.bind(model, MEMBERS, config)
    torch.testing.assert_close(model.shared["text_lora"].instruction, cards, rtol=0, atol=0)
    model(x_of())  # a single-task forward runs


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("instruction_dim", 0, "instruction_dim must be an integer from 1 to 384"),
        ("instruction_dim", 385, "instruction_dim must be an integer from 1 to 384"),
        ("instruction_dim", True, "instruction_dim must be an integer from 1 to 384"),
        ("instruction_source", "text", "instruction_source must be one of card, generic"),
        ("instruction_source", "params", "instruction_source must be one of card, generic"),  # a suite's only
        ("hidden", 0, "hidden must be an integer >= 1"),
        ("tasks", 0, "tasks must be an integer >= 1"),
    ],
)
def test_bad_config_is_refused(field, value, match):
    with pytest.raises(ValueError, match=match):
        adapters.get("text-lora").make_config(**{field: value})


def test_registered_as_a_task_method_outside_the_single_task_default():
    assert adapters.kind_of("text-lora") == "task" and "text-lora" in adapters.of_kind("task")
    assert "text-lora" not in adapters.DEFAULT_METHODS
    assert adapters.of_family("text_lora") == ("text-lora",)


def test_a_context_is_fresh_per_forward():
    """Factors are cached per forward (ctx.scratch), not across forwards: a new instruction takes effect."""
    model = build("text-lora", "deep-narrow")
    randomise(model)
    x = x_of()
    first = model(x, instruction=instruction(None, seed=1))
    ctx = ForwardContext(model.shared, instruction(None, seed=2))
    second = model(x, ctx=ctx)
    assert set(ctx.scratch["text_lora"]) == {"hidden_32x32"}
    assert not torch.allclose(first, second)
    assert torch.equal(copy.deepcopy(model)(x, instruction=instruction(None, seed=1)), first)


def test_both_paths_give_the_same_gradients(monkeypatch):
    """The masked and the through-hidden forms of a two-task batch: the same hypernetwork gradients (float64)."""
    grads = []
    for threshold in (text_lora.MASKED_TASKS, 1):
        monkeypatch.setattr(text_lora, "MASKED_TASKS", threshold)
        model = build("text-lora", "deep-narrow", tasks=2)
        randomise(model)
        model.shared["text_lora"].bind_instruction(instruction(2))
        model.zero_grad()
        model(x_of(), task=mixed_tasks()).square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and all(g.abs().max() > 0 for g in grads[0].values())
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-9, atol=1e-12, msg=name)


def test_text_lora_params_trains_and_reports(tmp_path, capsys):
    """A smoke held-out run of text-lora and text-lora-params on param-sin-cos-4: text-lora-params's hypernetwork
    reads each task's parameter code (the table multitask binds is parametric.codes of the tasks' parameters), it
    has a shuffled evaluation and no paraphrase, and the report tests text-lora against it on each split."""
    import pandas as pd

    from qlbench import cli, parametric
    from qlbench.experiments import multitask, runner, suite_tasks
    from qlbench.records import results

    p = multitask.plan(
        suite=f"{parametric.PREFIX}4",
        schedule="held-out",
        methods=["text-lora", "text-lora-params"],
        protocol=Protocol(arch="deep-narrow", budget="smoke", seeds=2),
        execution=Execution(out_dir=tmp_path / "r", threads=1),
    )
    config = p.configs["text-lora-params"]
    codes = parametric.codes([parametric.params(t) for t in p.suite.tasks], instructions.DIM)
    assert config.instruction_source == "params" and torch.equal(suite_tasks.instruction_table(p.suite, config), codes)
    runner.run(p, progress=False, log=lambda m: None)
    rec = results.read_record(p.record_path("text-lora-params"))
    assert rec["train_info"]["status"] == "ok" and rec["train_info"]["trainable_params"] == 31_824
    assert all("paraphrase_task_mse" not in s and "shuffled_task_mse" in s for s in rec["train_info"]["per_seed"])
    assert cli.main(["report", str(tmp_path / "r"), "--out", str(tmp_path / "out"), "--format", "md,csv",
                     "--no-figures"]) == 0  # fmt: skip
    capsys.readouterr()
    folder = tmp_path / "out" / "heldout" / "deep-narrow" / "smoke" / "held-out"
    rows = {r["method"]: r for r in pd.read_csv(folder / "table.csv").to_dict("records")}
    for split in ("interpolation", "extrapolation"):
        assert rows["text-lora"][f"vs params ({split})"].split()[-1] in ("win", "tie", "loss")
        assert rows["text-lora-params"][f"vs params ({split})"] == "-"
