"""stacked.LayoutBmm, the batched matmul that the stacked layers run off the CPU: the same values and gradients as
autograd's own baddbmm, each gradient in its matrix's memory layout, and fewer kernels per step."""

from __future__ import annotations

import pytest
import torch

from qlbench import adapters, stacked
from qlbench.bench.dispatch import KernelCount, step_kernels
from qlbench.bench.models import batches, stacked_model

F64 = torch.float64
TRAINED = [m for m in adapters.DEFAULT_METHODS if adapters.get(m).trains]


def leaves(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=F64, requires_grad=True)
    E, n, k, m = 2, 5, 3, 4
    # x (E, n, k); W (E, m, k), entering as the transposed view W^T (E, k, m) as a stacked linear's weight does;
    # A (E, n, k) a contiguous left factor; inputs of full shape and broadcast over n (a bias)
    return dict(x=rnd(E, n, k), W=rnd(E, m, k), A=rnd(E, n, k), full=rnd(E, n, m), bias=rnd(E, 1, m))


@pytest.mark.parametrize("alpha", [1.0, 1.7])
@pytest.mark.parametrize("input_kind", [None, "full", "bias"])
def test_layout_bmm_equals_autograds_baddbmm(input_kind, alpha):
    """Forward and every gradient of input + alpha * b1 @ W^T (input None, of full shape, or a broadcast bias)
    equal autograd's baddbmm / bmm on float64, for b1 an activation or a parameter; gradcheck passes; and the
    gradient of a weight entering transposed arrives in the weight's own layout (contiguous), where autograd's is
    not."""
    for b1_name in ("x", "A"):
        ours, ref = leaves(), leaves()
        for t, how in ((ours, "layout"), (ref, "autograd")):
            inp = None if input_kind is None else t[input_kind]
            b1, b2 = t[b1_name], t["W"].transpose(1, 2)
            if how == "layout":
                y = stacked.LayoutBmm.apply(inp, b1, b2, alpha)
            elif inp is None:
                y = alpha * torch.bmm(b1, b2)
            else:
                y = torch.baddbmm(inp, b1, b2, alpha=alpha)
            w = torch.randn(y.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
            ((w * y).sum() + 0.5 * (y**2).sum()).backward()
            t["y"] = y.detach()
        torch.testing.assert_close(ours["y"], ref["y"], rtol=1e-13, atol=1e-13)
        for name in ("x", "W", "A", "full", "bias"):
            a, b = ours[name].grad, ref[name].grad
            assert (a is None) == (b is None), name
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13, msg=lambda m, n=name: f"d{n}: {m}")
        assert ours["W"].grad.is_contiguous()

    t = leaves()
    inp = None if input_kind is None else t[input_kind]
    args = (inp, t["x"], t["W"].transpose(1, 2))
    assert torch.autograd.gradcheck(lambda i, a, b: stacked.LayoutBmm.apply(i, a, b, alpha), args)


def test_layout_bmm_launches_no_copy_and_no_scaling():
    """On the meta device (CUDA's code path), one step of y = bias + 2 * x @ W^T: autograd's baddbmm backward
    multiplies each gradient by alpha and copies W's gradient into W's layout; LayoutBmm does neither."""
    E, n, k, m = 3, 8, 4, 6

    def counts(apply):
        W = torch.empty(E, m, k, device="meta", requires_grad=True)
        x = torch.empty(E, n, k, device="meta", requires_grad=True)
        bias = torch.empty(E, 1, m, device="meta", requires_grad=True)
        with KernelCount() as seen:
            apply(bias, x, W.transpose(1, 2)).sum().backward()
        return seen.counts

    ours = counts(lambda b, x, wt: stacked.LayoutBmm.apply(b, x, wt, 2.0))
    theirs = counts(lambda b, x, wt: torch.baddbmm(b, x, wt, alpha=2.0))
    assert theirs["copy_"] == 1 and theirs["mul"] == 2  # what LayoutBmm saves, present in autograd's
    assert "copy_" not in ours and "mul" not in ours
    assert sum(theirs.values()) - sum(ours.values()) == 3


@pytest.mark.parametrize("arch", ["deep-narrow", "transformer"])
def test_every_trained_method_gets_the_same_gradients_through_layout_bmm(arch, monkeypatch):
    """Every trained default method's stack (float64, 2 members): the loss and the gradient of every trainable
    parameter with the stacked layers' matmuls as LayoutBmm (the CPU taken off stacked.AUTOGRAD_MATMUL_DEVICES, as
    CUDA is; DoRA's merged weight with them) equal those of autograd's own matmuls, the CPU's path, to rounding;
    and forcing it did route them through it."""
    xb, yb = (t.double() for t in batches(2, "cpu", n=1)[0])
    if arch == "transformer":
        xb, yb = xb[:, :8], yb[:, :8]

    def grads(method):
        model, _ = stacked_model(arch, method, 2, "cpu")
        model.double()
        loss = ((model(xb) - yb) ** 2).mean()
        nodes = {type(n).__name__ for n in _nodes(loss.grad_fn)}
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, nodes

    for method in TRAINED:
        loss, want, nodes = grads(method)
        assert "LayoutBmmBackward" not in nodes
        with monkeypatch.context() as patch:
            patch.setattr(stacked, "AUTOGRAD_MATMUL_DEVICES", ())
            got_loss, got, nodes = grads(method)
        assert "LayoutBmmBackward" in nodes, method
        torch.testing.assert_close(got_loss, loss, rtol=1e-12, atol=0)
        assert got.keys() == want.keys() and all(g is not None for g in want.values()), method
        for name, g in want.items():
            torch.testing.assert_close(
                got[name], g, rtol=1e-9, atol=1e-12, msg=lambda m, n=name, k=method: f"{k} {n}: {m}"
            )


def test_a_lora_step_off_the_cpu_launches_fewer_kernels():
    """deep-narrow LoRA's step on the meta device: its 32 merged weights W0 + s B A no longer multiply their two
    factor gradients by s apart (64 kernels fewer), nothing else changes; counted with autograd's matmuls
    (the meta device on AUTOGRAD_MATMUL_DEVICES) and as it runs off the CPU."""
    on = step_kernels("deep-narrow", "lora", 2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stacked, "AUTOGRAD_MATMUL_DEVICES", ("cpu", "meta"))
        off = step_kernels("deep-narrow", "lora", 2)
    assert sum(off.values()) - sum(on.values()) == 64
    assert off["mul"] - on["mul"] == 64


def _nodes(fn) -> set:
    seen, stack = set(), [fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(n for n, _ in node.next_functions)
    return seen


@pytest.mark.parametrize("T", [1, 2, 5])
def test_short_attention_is_scaled_dot_product_attention(T):
    """`backbones.short_attention` (the Transformer's attention off the CPU for short sequences) against
    F.scaled_dot_product_attention, the oracle, in float64: the output and the gradients of q, k and v, per head,
    in the tokens' (N, T, H, d_h) layout."""
    from qlbench.backbones import short_attention

    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(6, T, 4, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    heads = lambda t: t.transpose(1, 2)  # (N, H, T, d_h), as SDPA takes them
    want = heads(torch.nn.functional.scaled_dot_product_attention(heads(q), heads(k), heads(v)))
    got = short_attention(q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    w = torch.randn(want.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), w), torch.autograd.grad(want, (q, k, v), w), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_the_transformer_off_the_cpu_attends_as_on_it(monkeypatch):
    """A Transformer stack (float64, 2 members) with its attention as off the CPU (the CPU taken off
    backbones.FUSED_ATTENTION_DEVICES: `short_attention` for its sequences of two tokens) gives the CPU path's loss
    and gradients to rounding, and forcing it did take that path."""
    from qlbench import backbones

    xb, yb = (t.double()[:, :8] for t in batches(2, "cpu", n=1)[0])
    calls = []
    short = backbones.short_attention
    monkeypatch.setattr(backbones, "short_attention", lambda *a: (calls.append(1), short(*a))[1])

    def grads():
        model, _ = stacked_model("transformer", "lora", 2, "cpu")
        model.double()
        loss = ((model(xb) - yb) ** 2).mean()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    loss, want = grads()
    assert not calls  # the CPU: F.scaled_dot_product_attention, as before
    monkeypatch.setattr(backbones, "FUSED_ATTENTION_DEVICES", ())
    got_loss, got = grads()
    assert len(calls) == 8  # one per encoder layer
    torch.testing.assert_close(got_loss, loss, rtol=1e-12, atol=0)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def test_a_peft_tuner_stacks_by_vmap_off_the_cpu(monkeypatch):
    """A method written for one member is stacked by vmap over its members' plain modules (adapters/member.py),
    whose frozen layers are stacked layers of one member. Off the CPU their matmuls are LayoutBmm, an
    autograd.Function with no vmap rule; under vmap they must fall back to autograd's own, or every such method
    loops on CUDA (as it did: "vmap failed (RuntimeError: In order to use an autograd.Function ...)"). With the CPU
    taken off stacked.AUTOGRAD_MATMUL_DEVICES, as CUDA is, peft's LoRA probes "stacked", and its loss and gradients
    equal the loop's."""
    monkeypatch.setattr(stacked, "AUTOGRAD_MATMUL_DEVICES", ())
    xb, yb = batches(3, "cpu", n=1)[0]
    model, _ = stacked_model("deep-narrow", "peft:lora", 3, "cpu")
    assert model.path == "stacked"
    trainable = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad(((model.stacked(xb) - yb) ** 2).mean(), trainable)
    want = torch.autograd.grad(((model.looped(xb) - yb) ** 2).mean(), trainable)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
