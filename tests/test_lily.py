"""Lily against peft 0.21's `lily` tuner (a test-only dependency) in float64: three layers of one (role, shape)
group, stride 2 (layers 0 and 1 share an A, layer 2 has its own), three experts shared by all, a router per layer;
the same weights on both sides, B nonzero. Compared: outputs and the gradients of the input, both A blocks, the
experts and every router, on a batch of samples and on a batch of token sequences (the mixture is averaged over
all of them, as peft does). Planted bugs (the softmax of the averaged logits instead of the averaged softmax; A
not shared across the stride) fail the comparison. Plus: the defaults within 10% of LoRA r = 8 on both
backbones, and n_experts = 1 refused in one line."""

from __future__ import annotations

import pytest
import torch

from qlbench import adapters
from qlbench.adapters import lily

from helpers import F64, PeftNet, adapted_layers, outputs_and_gradients, trainable_ratio_to_lora

peft = pytest.importorskip("peft")

D, LAYERS, R, EXPERTS, STRIDE, SCALE = 8, 3, 4, 3, 2, 1.5
TOL = dict(rtol=1e-10, atol=1e-12)


def weights():
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=F64)  # noqa: E731
    linears = [(rnd(D, D) / 3, rnd(D)) for _ in range(LAYERS)]
    A = rnd(2, R, D) / 3  # blocks: layers 0-1, layer 2
    B = rnd(EXPERTS, R, D) / 3
    routers = rnd(LAYERS, EXPERTS, R) * 2
    return linears, A, B, routers


def peft_model(linears, A, B, routers):
    config = peft.LilyConfig(r=R, num_B=EXPERTS, stride_A=STRIDE, scaling=SCALE, target_modules=["fc"])
    model = peft.get_peft_model(PeftNet(D, LAYERS), config)
    inner = model.base_model.model
    with torch.no_grad():
        for i, (block, (W, b)) in enumerate(zip(inner.layers, linears)):
            block.fc.base_layer.weight.copy_(W)
            block.fc.base_layer.bias.copy_(b)
            block.fc.lily_router["default"].weight.copy_(routers[i])
            block.fc.lily_A["default"].weight.copy_(A[i // STRIDE])  # writes the block's shared A
        inner.layers[0].fc.lily_B["default"].weight.copy_(B.reshape(EXPERTS * R, D))  # the shared experts
    fc = [block.fc for block in inner.layers]
    params = {
        "A0": fc[0].lily_A["default"].weight,
        "A1": fc[2].lily_A["default"].weight,
        "B": fc[0].lily_B["default"].weight,
        **{f"router{i}": f.lily_router["default"].weight for i, f in enumerate(fc)},
    }
    assert fc[1].lily_A["default"] is fc[0].lily_A["default"] and fc[2].lily_B["default"] is fc[0].lily_B["default"]
    return model, params


def qlbench_model(linears, A, B, routers, ignore_stride=False):
    config = dict(r=R, n_experts=EXPERTS, stride=STRIDE, scale=SCALE)
    shared, layers, forward = adapted_layers("lily", D, linears, **config)
    (group,) = shared[lily.NAME].values()
    with torch.no_grad():
        for i, layer in enumerate(layers):
            layer.lily_router.copy_(routers[i].unsqueeze(0))
            if ignore_stride:  # planted: every layer reads the A block of its own index
                layer.block = min(i, group.A.shape[1] - 1)
        group.A.copy_(A.unsqueeze(0))
        group.B.copy_(B.unsqueeze(0))
    return forward, {"A": group.A, "B": group.B, **{f"router{i}": la.lily_router for i, la in enumerate(layers)}}


def compare(shape, ignore_stride=False) -> None:
    linears, A, B, routers = weights()
    g = torch.Generator().manual_seed(5)
    x, upstream = torch.randn(*shape, D, generator=g, dtype=F64), torch.randn(*shape, D, generator=g, dtype=F64)
    ours, ours_params = qlbench_model(linears, A, B, routers, ignore_stride)
    theirs, theirs_params = peft_model(linears, A, B, routers)
    y, gx, grads = outputs_and_gradients(ours, ours_params, x, upstream)
    y_ref, gx_ref, ref = outputs_and_gradients(theirs, theirs_params, x, upstream)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(gx, gx_ref, **TOL)
    torch.testing.assert_close(grads["A"][0], torch.stack([ref["A0"], ref["A1"]]), **TOL, msg="gradient of A")
    torch.testing.assert_close(grads["B"][0].reshape(EXPERTS * R, D), ref["B"], **TOL, msg="gradient of B")
    for i in range(LAYERS):
        torch.testing.assert_close(grads[f"router{i}"][0], ref[f"router{i}"], **TOL, msg=f"gradient of router{i}")


@pytest.mark.parametrize("shape", [(6,), (3, 4)], ids=["samples", "token-sequences"])
def test_lily_matches_peft_outputs_and_gradients(shape):
    compare(shape)


def test_the_mixture_couples_the_samples_of_a_batch():
    """As in peft: a sample's output depends on the batch it is in (the router's softmax is averaged over it)."""
    forward, _ = qlbench_model(*weights())
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(6), dtype=F64)
    assert not torch.allclose(forward(x[:1]), forward(x)[:1])


def _softmax_of_mean_logits(h, router):  # planted: the mean taken before the softmax instead of after
    return torch.softmax(torch.bmm(h, router.transpose(1, 2)).mean(dim=1), dim=-1)


@pytest.mark.parametrize("bug", ["softmax-of-mean", "A-ignores-stride"])
def test_a_planted_bug_fails_the_peft_comparison(monkeypatch, bug):
    if bug == "softmax-of-mean":
        monkeypatch.setattr(lily, "expert_mixture", _softmax_of_mean_logits)
    with pytest.raises(AssertionError):
        compare((6,), ignore_stride=bug == "A-ignores-stride")


@pytest.mark.parametrize("arch", ["deep-narrow", "transformer"])
def test_default_trainable_count_is_within_ten_percent_of_lora_r8(arch):
    assert abs(trainable_ratio_to_lora("lily", arch) - 1) <= 0.10


def test_one_expert_is_one_clear_error():
    with pytest.raises(ValueError, match=r"n_experts must be >= 2 \(one expert is a LoRA\), got 1"):
        adapters.get("lily").make_config(n_experts=1)
