"""MoE-LoRA against a plain per-sample reference written from its equations (docs/methods.md), in float64: for
every member and sample, the gate's k largest logits, their softmax, and the sum of the chosen experts' s B_j A_j x.
Compared: outputs and the gradients of the input, the experts and the gate, on a live (trained-looking) layer of
two members; a planted bug (top-k weights not renormalised) fails the comparison. Plus: the defaults' trainable
count within 10% of LoRA r = 8 on both backbones, and k > X refused in one line."""

from __future__ import annotations

import pytest
import torch

from qlbench import adapters
from qlbench.adapters import moe_lora
from qlbench.adapters.base import Site
from qlbench.backbones import Target
from qlbench.stacked import ForwardContext, StackedLinear

from helpers import F64, outputs_and_gradients, trainable_ratio_to_lora

D_IN, D_OUT, X, R, K, ALPHA = 6, 5, 4, 2, 2, 3.0
MEMBERS, N = 2, 7
TOL = dict(rtol=1e-10, atol=1e-12)


def layer() -> moe_lora.MoeLoraLinear:
    """The registered method's layer around an E = 2 StackedLinear, every weight drawn at random (B nonzero)."""
    method = adapters.get("moe-lora")
    gens = [torch.Generator().manual_seed(e) for e in range(MEMBERS)]
    base = StackedLinear(D_IN, D_OUT, gens, dtype=F64).requires_grad_(False)
    config = method.make_config(r=R, n_experts=X, top_k=K, alpha=ALPHA)
    module = method.layer_cls(base, Site(Target("l0", "hidden", 0), 0, 1), config, gens)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        module.moe_B.copy_(torch.randn(module.moe_B.shape, generator=g, dtype=F64))
        module.moe_gate.copy_(torch.randn(module.moe_gate.shape, generator=g, dtype=F64) * 2)
    return module


def reference(module, x: torch.Tensor) -> torch.Tensor:
    """y[e, n] = W0 x + b0 + s sum_{j in top-k} softmax(top-k logits)_j B_j A_j x, one sample at a time."""
    s = ALPHA / R
    rows = []
    for e in range(MEMBERS):
        W0, b0 = module.base.weight[e], module.base.bias[e]
        A, B, G = module.moe_A[e], module.moe_B[e], module.moe_gate[e]
        out = []
        for n in range(x.shape[1]):
            v = x[e, n]
            logits = G @ v  # (X,)
            chosen = sorted(range(X), key=lambda j: -logits[j].item())[:K]
            z = torch.stack([logits[j] for j in chosen])
            w = torch.exp(z - z.max()) / torch.exp(z - z.max()).sum()
            y = W0 @ v + b0
            for wj, j in zip(w, chosen):
                y = y + s * wj * (B[:, j * R : (j + 1) * R] @ (A[j * R : (j + 1) * R] @ v))
            out.append(y)
        rows.append(torch.stack(out))
    return torch.stack(rows)  # (E, N, d_out)


def compare(module) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(MEMBERS, N, D_IN, generator=g, dtype=F64)
    upstream = torch.randn(MEMBERS, N, D_OUT, generator=g, dtype=F64)
    ours = lambda v: module(v, ForwardContext(torch.nn.ModuleDict()))  # noqa: E731
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    y, gx, grads = outputs_and_gradients(ours, params, x, upstream)
    y_ref, gx_ref, grads_ref = outputs_and_gradients(lambda v: reference(module, v), params, x, upstream)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(gx, gx_ref, **TOL)
    assert set(grads) == {"moe_A", "moe_B", "moe_gate"}
    for name, g_ref in grads_ref.items():
        assert g_ref.abs().sum() > 0, name  # every parameter gets gradient: the comparison is not vacuous
        torch.testing.assert_close(grads[name], g_ref, **TOL, msg=f"gradient of {name}")


def test_moe_lora_matches_the_per_sample_reference():
    compare(layer())


def test_every_sample_uses_k_experts_with_weights_summing_to_one():
    module = layer()
    x = torch.randn(MEMBERS, 50, D_IN, generator=torch.Generator().manual_seed(4), dtype=F64)
    w = module.gate(x)  # (E, N, X)
    assert ((w > 0).sum(-1) == K).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(MEMBERS, 50, dtype=F64))
    assert len({tuple(row.nonzero().flatten().tolist()) for row in w[0]}) > 1  # the choice depends on the input


def test_a_planted_bug_fails_the_reference(monkeypatch):
    def not_renormalised(logits, k):  # planted: the top-k weights taken from a softmax over all X logits
        top, index = logits.topk(k, dim=-1)
        return torch.zeros_like(logits).scatter(-1, index, torch.softmax(logits, dim=-1).gather(-1, index))

    monkeypatch.setattr(moe_lora, "top_k_weights", not_renormalised)
    with pytest.raises(AssertionError):
        compare(layer())


@pytest.mark.parametrize("arch", ["deep-narrow", "transformer"])
def test_default_trainable_count_is_within_ten_percent_of_lora_r8(arch):
    assert abs(trainable_ratio_to_lora("moe-lora", arch) - 1) <= 0.10


def test_more_experts_chosen_than_exist_is_one_clear_error():
    with pytest.raises(ValueError, match=r"top_k must be <= n_experts \(3\), got 4"):
        adapters.get("moe-lora").make_config(top_k=4)
