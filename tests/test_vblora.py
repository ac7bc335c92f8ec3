"""VB-LoRA against peft 0.21's `vblora` tuner (a test-only dependency) in float64: a three-layer network whose layers
share one vector bank, the same bank and logits on both sides; compared: outputs and the gradients of the input,
the bank and every layer's logits. Planted bugs (top-k weights not renormalised, B's tiles laid out without peft's
transpose) must fail the same comparison. Plus: the trainable count of the defaults within 10% of LoRA r = 8 on
both backbones, and bad sizes refused in one line."""

from __future__ import annotations

import pytest
import torch

from qlbench import adapters, backbones
from qlbench.adapters import vblora

from helpers import F64, PeftNet, adapted_layers, outputs_and_gradients, trainable_ratio_to_lora

peft = pytest.importorskip("peft")

D, LAYERS, R, NV, VL, K = 16, 3, 2, 6, 4, 2
TOL = dict(rtol=1e-10, atol=1e-12)


def weights():
    g = torch.Generator().manual_seed(0)
    linears = [(torch.randn(D, D, generator=g, dtype=F64) / 4, torch.randn(D, generator=g, dtype=F64)) for _ in "abc"]
    bank = torch.randn(NV, VL, generator=g, dtype=F64) / 2  # larger than the init, so the update is far from zero
    logits = [
        (torch.randn(R, D // VL, NV, generator=g, dtype=F64), torch.randn(D // VL, R, NV, generator=g, dtype=F64))
        for _ in range(LAYERS)
    ]
    x = torch.randn(5, D, generator=g, dtype=F64)
    upstream = torch.randn(5, D, generator=g, dtype=F64)
    return linears, bank, logits, x, upstream


def peft_model(linears, bank, logits):
    config = peft.VBLoRAConfig(r=R, num_vectors=NV, vector_length=VL, topk=K, target_modules=["fc"])
    model = peft.get_peft_model(PeftNet(D, LAYERS), config)
    inner = model.base_model.model
    with torch.no_grad():
        for block, (W, b), (zA, zB) in zip(inner.layers, linears, logits):
            block.fc.base_layer.weight.copy_(W)
            block.fc.base_layer.bias.copy_(b)
            block.fc.vblora_logits_A["default"].copy_(zA)
            block.fc.vblora_logits_B["default"].copy_(zB)
        model.base_model.vblora_vector_bank["default"].copy_(bank)
    params = {"bank": model.base_model.vblora_vector_bank["default"]}
    for i, block in enumerate(inner.layers):
        params[f"A{i}"] = block.fc.vblora_logits_A["default"]
        params[f"B{i}"] = block.fc.vblora_logits_B["default"]
    assert all(p.dtype == F64 for p in params.values())
    return model, params


def qlbench_model(linears, bank, logits):
    shared, layers, forward = adapted_layers("vb-lora", D, linears, r=R, n_vectors=NV, vector_length=VL, top_k=K)
    with torch.no_grad():
        for layer, (zA, zB) in zip(layers, logits):
            layer.vblora_logits_A.copy_(zA.unsqueeze(0))
            layer.vblora_logits_B.copy_(zB.unsqueeze(0))
        shared[vblora.FAMILY].bank.copy_(bank.unsqueeze(0))
    params = {"bank": shared[vblora.FAMILY].bank}
    for i, layer in enumerate(layers):
        params[f"A{i}"], params[f"B{i}"] = layer.vblora_logits_A, layer.vblora_logits_B
    return forward, params


def compare(linears, bank, logits, x, upstream):
    """qlbench's outputs and gradients against peft's; AssertionError on the first difference."""
    ours, ours_params = qlbench_model(linears, bank, logits)
    theirs, theirs_params = peft_model(linears, bank, logits)
    y, gx, grads = outputs_and_gradients(ours, ours_params, x, upstream)
    y_ref, gx_ref, grads_ref = outputs_and_gradients(theirs, theirs_params, x, upstream)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(gx, gx_ref, **TOL)
    for name, g_ref in grads_ref.items():
        torch.testing.assert_close(grads[name].reshape(g_ref.shape), g_ref, **TOL, msg=f"gradient of {name}")


def test_vblora_matches_peft_outputs_and_gradients():
    linears, bank, logits, x, upstream = weights()
    with torch.no_grad():
        frozen = PeftNet(D, LAYERS)
        for block, (W, b) in zip(frozen.layers, linears):
            block.fc.weight.copy_(W)
            block.fc.bias.copy_(b)
        assert not torch.allclose(peft_model(linears, bank, logits)[0](x), frozen(x))  # the update is live
    compare(linears, bank, logits, x, upstream)


def _not_renormalised(logits, bank, k):
    """Planted: the top-k weights taken from a softmax over all logits (they no longer sum to 1)."""
    E, nv, vl = bank.shape
    top, index = logits.topk(k, dim=-1)
    weights = torch.softmax(logits, dim=-1).gather(-1, index)
    picked = torch.gather(bank, 1, index.reshape(E, -1, 1).expand(-1, -1, vl)).view(*index.shape, vl)
    return (weights.unsqueeze(-1) * picked).sum(-2)


def _untransposed_factors(logits_A, logits_B, bank, k):
    """Planted: B's tiles laid out (d_out / vl, r, vl) -> (d_out, r) without peft's transpose."""
    E, r = logits_A.shape[:2]
    A = vblora.admix(logits_A, bank, k).reshape(E, r, -1)
    return A, vblora.admix(logits_B, bank, k).reshape(E, -1, r)


@pytest.mark.parametrize(
    "target, planted",
    [("admix", _not_renormalised), ("vblora_factors", _untransposed_factors)],
    ids=["topk-not-renormalised", "B-without-transpose"],
)
def test_a_planted_bug_fails_the_peft_comparison(monkeypatch, target, planted):
    monkeypatch.setattr(vblora, target, planted)
    with pytest.raises(AssertionError):
        compare(*weights())


@pytest.mark.parametrize("arch", ["deep-narrow", "transformer"])
def test_default_trainable_count_is_within_ten_percent_of_lora_r8(arch):
    """(The count itself is checked against peft's formula in test_methods.)"""
    assert abs(trainable_ratio_to_lora("vb-lora", arch) - 1) <= 0.10


def test_sizes_that_do_not_tile_the_layers_are_one_clear_error():
    backbone = backbones.build_backbone("deep-narrow", [0])
    method = adapters.get("vb-lora")
    with pytest.raises(ValueError, match="vector_length=5 must divide every adapted layer's d_in and d_out"):
        method.build(backbone, method.make_config(vector_length=5), [torch.Generator()], torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"top_k must be <= n_vectors \(4\), got 5"):
        method.make_config(n_vectors=4, top_k=5)
