"""Queryable LoRA: the limits and structure docs/methods.md and the paper's Algorithm 2 promise, on the real module."""

from __future__ import annotations

import pytest
import torch

from qlbench import adapters
from qlbench.adapters.queryable import QueryableConfig, RoutingState
from qlbench.backbones import DeepNarrowMLP, RegressionTransformer, build_backbone
from qlbench.seeding import generator
from qlbench.stacked import ForwardContext

from helpers import F64, TINY_TRANSFORMER, gens


def backbone(arch: str, members: int = 2) -> torch.nn.Module:
    if arch == "deep-narrow":
        return DeepNarrowMLP(gens("bb", members=members), dtype=F64)
    return RegressionTransformer(gens("bb", members=members), TINY_TRANSFORMER, dtype=F64)


def adapted(arch: str, method: str = "queryable", members: int = 2, **kw) -> torch.nn.Module:
    registered = adapters.get(method)
    if method == "queryable" and arch == "transformer":
        kw.setdefault("n_blocks", 2)
    return registered.build(backbone(arch, members), registered.make_config(**kw), gens(method, members=members), None)


def randomize_B(model: torch.nn.Module, tag: str = "B") -> None:
    """Give every up-projection B non-zero values, so the routed part reaches the output."""
    g = generator("test", "B", tag)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_B"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.3)


def inputs(members: int = 2, n: int = 16) -> torch.Tensor:
    return torch.rand(members, n, 2, generator=torch.Generator().manual_seed(0), dtype=F64) * 4 - 2


@pytest.mark.parametrize("arch", ["deep-narrow", "transformer"])
def test_equals_frozen_model_at_step_0(arch):
    x = inputs()
    frozen = backbone(arch)(x)
    assert torch.equal(adapted(arch)(x), frozen)


@pytest.mark.parametrize("arch", ["deep-narrow", "transformer"])
def test_zero_gate_is_exactly_lora(arch):
    """g = sigmoid(eta) = 0 removes the routed term: the layer is LoRA with the same A and B."""
    q = adapted(arch)
    randomize_B(q)
    lora = adapted(arch, "lora")
    with torch.no_grad():
        qp = dict(q.named_parameters())
        for name, p in lora.named_parameters():
            if name.endswith(("lora_A", "lora_B")):
                p.copy_(qp[name.replace("lora_", "queryable_")])
        for name, p in qp.items():
            if name.endswith("queryable_eta"):
                p.fill_(-torch.inf)
    x = inputs()
    assert torch.allclose(q(x), lora(x), rtol=0, atol=1e-12)
    with torch.no_grad():  # and the gate really matters when open
        for name, p in q.named_parameters():
            if name.endswith("queryable_eta"):
                p.fill_(0.0)
    assert not torch.allclose(q(x), lora(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", ["deep-narrow", "transformer"])
def test_state_only_routing_ignores_the_instruction(arch):
    x, e1, e2 = inputs(), torch.randn(2, 6, dtype=F64), torch.randn(2, 6, dtype=F64)
    state_only = adapted(arch, instruction_dim=6)  # tau_lang = lambda_ctx = 0, channels present
    randomize_B(state_only)
    assert torch.equal(state_only(x, e1), state_only(x, e2))
    for channel in ({"lambda_ctx": 1.0}, {"tau_lang": 1.0}):  # either channel alone makes e(c) matter
        m = adapted(arch, instruction_dim=6, **channel)
        randomize_B(m)
        assert not torch.allclose(m(x, e1), m(x, e2), atol=1e-9), channel


def test_instruction_channels_need_an_embedding():
    m = adapted("deep-narrow", instruction_dim=6, tau_lang=1.0)
    with pytest.raises(ValueError, match="instruction"):
        m(inputs())
    with pytest.raises(ValueError, match="instruction_dim"):
        QueryableConfig(tau_lang=1.0)


def routes(model, x) -> RoutingState:
    ctx = ForwardContext(model.shared)
    model(x, ctx=ctx)
    return ctx.scratch["queryable"]


@pytest.mark.parametrize("k", [1, 2, 5])
def test_routing_weights_are_a_top_k_distribution_per_sample(k):
    m = adapted("deep-narrow", top_k=k)
    state = routes(m, inputs(n=32))
    assert sorted(state.routes) == [0, 1, 2, 3]  # one route per block
    for r in state.routes.values():
        a = r.alpha  # (E, N, M)
        assert a.shape == (2, 32, 8)
        assert (a >= 0).all()
        torch.testing.assert_close(a.sum(-1), torch.ones(2, 32, dtype=F64), rtol=0, atol=1e-12)
        assert ((a > 0).sum(-1) == k).all()
        # the chosen atoms are the k largest fused logits
        top = r.logits.topk(k, dim=-1).indices
        assert torch.equal(torch.zeros_like(a, dtype=torch.bool).scatter(-1, top, True), a > 0)
        if k > 1:  # routing is per sample: distinct samples get distinct weights
            assert torch.unique(a[0].round(decimals=9), dim=0).shape[0] > 1
        torch.testing.assert_close(r.S, torch.einsum("enm,emij->enij", a, m.shared["queryable"].atoms))


def test_blocks_and_depth_summaries_follow_algorithm_2():
    """32 layers, 4 blocks: block b's summaries are the means of the rank states of the 8 layers of blocks < b,
    and the first block has no depth summary."""
    m = adapted("deep-narrow")
    layers = [m.hidden[i] for i in range(32)]
    assert [i for i, layer in enumerate(layers) if layer.entry] == [0, 8, 16, 24]
    assert [layer.block for layer in layers] == [i // 8 for i in range(32)]
    x = inputs()
    state = routes(m, x)
    assert [len(state.states[b]) for b in range(4)] == [8, 8, 8, 8]
    assert state.routes[0].u is None and state.routes[0].beta is None
    for b in (1, 2, 3):
        assert state.routes[b].beta.shape == (2, 16, b)
        sbar = torch.stack([torch.stack(state.states[i]).mean(0) for i in range(b)], 2)  # (E, N, b, r)
        expect = (state.routes[b].beta.unsqueeze(-1) * sbar).sum(2)
        torch.testing.assert_close(state.routes[b].u, expect)
    # the entry state of block 1 is A_8 h_8: recompute it from the layer's own factor
    h = torch.nn.functional.gelu(m.inp(x))
    ctx = ForwardContext(m.shared)
    for i in range(8):
        h = torch.nn.functional.gelu(m.hidden[i](h, ctx))
    s_entry = h @ m.hidden[8].queryable_A.transpose(1, 2)
    torch.testing.assert_close(state.states[1][0], s_entry)


def test_transformer_routes_once_per_block_per_sequence():
    m = adapted("transformer", n_blocks=2)  # 4 layers -> 2 blocks of 2 layers
    state = routes(m, inputs(n=5))
    assert sorted(state.routes) == [0, 1]
    for r in state.routes.values():
        assert r.alpha.shape == (2, 5, 8) and r.S.shape == (2, 5, 8, 8)  # per sequence, not per token
    assert [len(state.states[b]) for b in (0, 1)] == [2, 2]  # one Q/K/V state per layer (O does not feed it)
    gates = [n for n, _ in m.named_parameters() if n.endswith("queryable_eta")]
    assert len(gates) == 4 * 4  # one gate per projection q, k, v, o in each layer


@pytest.mark.parametrize("arch", ["deep-narrow", "transformer"])
def test_trainable_parameters_within_ten_percent_of_lora(arch):
    q = adapters.get("queryable").build(build_backbone(arch, [0]), QueryableConfig(), [generator("q")], None)
    lora = adapters.get("lora").build(
        build_backbone(arch, [0]), adapters.get("lora").make_config(), [generator("l")], None
    )
    ratio = adapters.trainable_parameter_count(q) / adapters.trainable_parameter_count(lora)
    assert 1.0 < ratio <= 1.10


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(top_k=9), "top_k"),
        (dict(top_k=0), "top_k"),
        (dict(n_atoms=0), "n_atoms"),
        (dict(t_attn=0.0), "t_attn"),
        (dict(tau_lang=-1.0, instruction_dim=4), "tau_lang"),
        (dict(r=0), "r must"),
    ],
)
def test_config_rejects_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        QueryableConfig(**bad)


def test_more_blocks_than_layers_is_rejected():
    with pytest.raises(ValueError, match="n_blocks"):
        adapted("transformer", n_blocks=5)


def test_adapted_model_moves_and_casts_like_any_module():
    """model.to()/double() go through nn.Module._apply, which an adapter must not shadow."""
    m = adapted("deep-narrow", members=1)
    x = inputs(members=1)
    y = m(x)
    m32 = m.to(torch.float32)
    assert m32.hidden[0].queryable_A.dtype == torch.float32
    torch.testing.assert_close(m32.double()(x), y, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("targets", [("q", "v"), ("k", "v"), ("v",), ("q", "k", "v", "o")])
def test_transformer_block_state_averages_whichever_of_qkv_are_adapted(targets):
    """The routing state of a block is the token average of the adapted q/k/v rank states, averaged over those
    projections (computed here from the layer's LayerNorm output and the A factors)."""
    model = adapted("transformer", targets=targets)
    randomize_B(model)
    x = inputs(n=5)
    seen = {}
    model.layers[0].ln1.register_forward_hook(lambda mod, args, out: seen.setdefault("x", out))
    ctx = ForwardContext(model.shared)
    model(x, None, ctx=ctx)
    layer = model.layers[0]
    states = [
        (seen["x"] @ getattr(layer, t).queryable_A.transpose(1, 2).unsqueeze(1)).mean(2)  # (E, N, r)
        for t in ("q", "k", "v")
        if t in targets
    ]
    torch.testing.assert_close(ctx.scratch["queryable"].states[0][0], torch.stack(states).mean(0), rtol=1e-12, atol=0)
    unadapted = [t for t in ("q", "k", "v") if t not in targets]
    assert all(not hasattr(getattr(layer, t), "queryable_A") for t in unadapted)


def test_queryable_rejects_targets_without_an_entry_projection():
    with pytest.raises(ValueError, match=r"targets \('o',\) has none of them"):
        adapters.get("queryable").make_config(targets=("o",))


@pytest.mark.parametrize("node", ["RoutedLinear", "RoutedLinearDense"])
def test_routed_linear_gradient_matches_finite_differences_and_the_plain_formula(node):
    """The eager path's node (one autograd node with a written-out backward), for S in either of route()'s layouts
    (RoutedLinear: samples-last S_t (E, r, r, N), the CPU's; RoutedLinearDense: (E, N, r, r), CUDA's), against
    finite differences (torch.autograd.gradcheck, float64, every input including the frozen W0 and b0) and against
    W0 x + b0 + scale B (s + g S s) written with plain ops and differentiated by autograd."""
    from qlbench.adapters import queryable

    g = torch.Generator().manual_seed(3)
    E, N, d_in, d_out, r = 2, 5, 4, 3, 2
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=F64, requires_grad=True)
    x, s, S, W0, b0, B = (
        rnd(E, N, d_in),
        rnd(E, N, r),
        rnd(E, N, r, r),
        rnd(E, d_out, d_in),
        rnd(E, d_out),
        rnd(E, d_out, r),
    )
    gate = torch.rand(E, generator=g, dtype=F64).requires_grad_()
    args = (x, s, S, gate, W0, b0, B)
    stored = (lambda S: S.permute(0, 2, 3, 1).contiguous()) if node == "RoutedLinear" else (lambda S: S)
    apply = lambda x, s, S, *rest: getattr(queryable, node).apply(x, s, stored(S), *rest, 1.5)
    assert torch.autograd.gradcheck(apply, args)

    def plain(x, s, S, gate, W0, b0, B):
        t = s + gate.view(-1, 1, 1) * (S @ s.unsqueeze(-1)).squeeze(-1)
        return x @ W0.transpose(1, 2) + b0.unsqueeze(1) + 1.5 * t @ B.transpose(1, 2)

    ours, ref = apply(*args), plain(*args)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    w = torch.randn(ours.shape, generator=g, dtype=F64)
    for a, b in zip(torch.autograd.grad((ours * w).sum(), args), torch.autograd.grad((ref * w).sum(), args)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("channels", [{}, {"instruction_dim": 6, "tau_lang": 1.0, "lambda_ctx": 1.0}])
@pytest.mark.parametrize("arch", ["deep-narrow", "transformer"])
def test_both_layouts_of_s_give_the_same_model(arch, channels, monkeypatch):
    """route() stores S samples-last on the CPU and (E, N, r, r) elsewhere (routing.SAMPLES_LAST), and the eager
    layers read it with the node of its layout. The same float64 model run both ways on the CPU (the second with
    the CPU taken off SAMPLES_LAST) gives the same output, S and gradient of every trainable parameter, to
    rounding, state-only and with both instruction channels; and the second did run the other layout (every S
    contiguous; on deep-narrow, every layer's node RoutedLinearDense)."""
    from qlbench.adapters import routing

    x = inputs()
    e = torch.randn(2, 6, generator=torch.Generator().manual_seed(1), dtype=F64)

    def run():
        model = adapted(arch, **channels)
        randomize_B(model)
        with torch.no_grad():  # an open gate, so S reaches the output
            for name, p in model.named_parameters():
                if name.endswith("queryable_eta"):
                    p.fill_(0.5)
        ctx = ForwardContext(model.shared, e if channels else None)
        y = model(x, ctx=ctx)
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
        ((w * y).sum() + 0.5 * (y**2).sum()).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        return y, grads, [route.S for route in ctx.scratch["queryable"].routes.values()]

    y_cpu, g_cpu, S_cpu = run()
    monkeypatch.setattr(routing, "SAMPLES_LAST", ())
    y_dense, g_dense, S_dense = run()
    assert not any(S.is_contiguous() for S in S_cpu) and all(S.is_contiguous() for S in S_dense)
    if arch == "deep-narrow":
        assert y_dense.grad_fn.next_functions  # a graph to walk
        nodes = {type(n).__name__ for n in _graph_nodes(y_dense.grad_fn)}
        assert "RoutedLinearDenseBackward" in nodes and "RoutedLinearBackward" not in nodes
    torch.testing.assert_close(y_dense, y_cpu, rtol=1e-12, atol=1e-12)
    for a, b in zip(S_dense, S_cpu):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert g_dense.keys() == g_cpu.keys() and all(v is not None for v in g_cpu.values())
    for name, want in g_cpu.items():
        torch.testing.assert_close(g_dense[name], want, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def _graph_nodes(fn, seen=None) -> list:
    """Every autograd node reachable from `fn`."""
    seen = set() if seen is None else seen
    stack, out = [fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        out.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return out


def _step_per_block_means(arch: str, **config) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and every trainable gradient of one float32 step of a default-size stack of 2 (build_backbone), B and the
    gates opened so that every routed path reaches the loss."""
    registered = adapters.get("queryable")
    model = registered.build(
        build_backbone(arch, [0, 1]), registered.make_config(**config), gens("queryable", members=2), None
    )
    with torch.no_grad():
        g = generator("test", "means")
        for name, p in model.named_parameters():
            if name.endswith("_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            if name.endswith("queryable_eta"):
                p.fill_(0.5)
    loss = model(inputs().float()).square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("arch, n_blocks", [("deep-narrow", None), ("transformer", None), ("deep-narrow", 3)])
def test_block_means_taken_once_give_the_per_block_recomputation(arch, n_blocks, monkeypatch):
    """RoutingState.summaries takes each completed block's mean once per forward. Against the definition recomputed
    at every block's entry (sbar_i = the mean of block i's layers' rank states, Algorithm 2, as the code did before):
    at the default sizes (8 layers a block on deep-narrow, 2 on the Transformer) the loss and every gradient are the
    same bits; with 3 blocks of 11, 11 and 10 layers the same values to float32 rounding."""
    config = {} if n_blocks is None else {"n_blocks": n_blocks}
    loss, grads = _step_per_block_means(arch, **config)

    def recomputed(self, block):
        if block == 0:
            return None
        return torch.stack([torch.stack(self.states[i]).mean(0) for i in range(block)], dim=2)

    monkeypatch.setattr(RoutingState, "summaries", recomputed)
    want_loss, want = _step_per_block_means(arch, **config)
    assert grads.keys() == want.keys() and len(want) > 50
    if n_blocks is None:
        assert torch.equal(loss, want_loss)
        assert [n for n in want if not torch.equal(grads[n], want[n])] == []
    else:
        torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)  # the forward is the same arithmetic
        for name, w in want.items():
            torch.testing.assert_close(grads[name], w, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
