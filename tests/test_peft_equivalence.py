"""qlbench's LoRA and DoRA layers against huggingface peft's (a test-only dependency), in float64.

One frozen nn.Linear(16, 12) with bias, r = 4, alpha = 8 (s = 2), the same A, a nonzero B and (for DoRA) the same
magnitude m on both sides; compared: outputs, input gradients and the gradients of A, B and m under a random
upstream gradient. peft's DoRA (tuners/lora/dora.py) computes
    base(x) + (m / ||W0 + s B A||_row - 1) W0 x + m / ||W0 + s B A||_row * s B A x
with the norm detached, i.e. m / stopgrad(||V||_row) * (V x) + b0 with an unscaled bias: the same quantity as
qlbench's dora.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

peft = pytest.importorskip("peft")

from qlbench import adapters  # noqa: E402
from qlbench.adapters.base import Site  # noqa: E402
from qlbench.backbones import Target  # noqa: E402
from qlbench.stacked import ForwardContext, StackedLinear  # noqa: E402

from helpers import F64, outputs_and_gradients  # noqa: E402

D_IN, D_OUT, R, ALPHA = 16, 12, 4, 8.0
TOL = dict(rtol=1e-10, atol=1e-12)


class OneLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.lin = linear

    def forward(self, x):
        return self.lin(x)


def weights():
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(D_IN, D_OUT, dtype=F64)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(D_OUT, D_IN, generator=g, dtype=F64) / 4)
        linear.bias.copy_(torch.randn(D_OUT, generator=g, dtype=F64))
    A = torch.randn(R, D_IN, generator=g, dtype=F64) / 4
    B = torch.randn(D_OUT, R, generator=g, dtype=F64) / 4  # nonzero, so the update and its gradients are live
    m = torch.rand(D_OUT, generator=g, dtype=F64) + 0.5  # g = m / ||V|| far from 1
    x = torch.randn(5, D_IN, generator=g, dtype=F64)
    upstream = torch.randn(5, D_OUT, generator=g, dtype=F64)
    return linear, A, B, m, x, upstream


def peft_layer(linear: nn.Linear, A, B, m, use_dora: bool):
    config = peft.LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=["lin"], use_dora=use_dora)
    model = peft.get_peft_model(OneLinear(nn.Linear(D_IN, D_OUT, dtype=F64)), config)
    layer = model.base_model.model.lin
    with torch.no_grad():
        layer.base_layer.weight.copy_(linear.weight)
        layer.base_layer.bias.copy_(linear.bias)
        layer.lora_A["default"].weight.copy_(A)
        layer.lora_B["default"].weight.copy_(B)
        if use_dora:
            layer.lora_magnitude_vector["default"].weight.copy_(m)
    params = {"A": layer.lora_A["default"].weight, "B": layer.lora_B["default"].weight}
    if use_dora:
        params["m"] = layer.lora_magnitude_vector["default"].weight
    assert all(p.dtype == F64 for p in params.values())
    return layer, params


def qlbench_layer(method: str, linear: nn.Linear) -> nn.Module:
    """The registered method's layer, as inject builds it, around an E = 1 StackedLinear holding `linear`."""
    registered = adapters.get(method)
    base = StackedLinear(D_IN, D_OUT, [torch.Generator().manual_seed(1)], dtype=F64)
    base.requires_grad_(False)
    with torch.no_grad():
        base.weight.copy_(linear.weight.unsqueeze(0))
        base.bias.copy_(linear.bias.unsqueeze(0))
    return registered.layer_cls(
        base,
        Site(Target("lin", "hidden", 0), 0, 1),
        registered.make_config(r=R, alpha=ALPHA),
        [torch.Generator().manual_seed(2)],
    )


def qlbench_forward(method: str, linear: nn.Linear, A, B, m):
    """x (N, d_in) -> (N, d_out) through qlbench's layer with the given A, B (and m), and its trainable params."""
    layer, p = qlbench_layer(method, linear), adapters.get(method).name
    with torch.no_grad():
        getattr(layer, f"{p}_A").copy_(A.unsqueeze(0))
        getattr(layer, f"{p}_B").copy_(B.unsqueeze(0))
        if hasattr(layer, f"{p}_m"):
            getattr(layer, f"{p}_m").copy_(m.unsqueeze(0))
    params = {n.removeprefix(f"{p}_"): q for n, q in layer.named_parameters() if q.requires_grad}
    return (lambda x: layer(x.unsqueeze(0), ForwardContext(nn.ModuleDict()))[0]), params


@pytest.mark.parametrize(
    "method, use_dora", [("lora", False), ("dora", True)], ids=["lora-vs-peft-lora", "dora-vs-peft-use_dora"]
)
def test_qlbench_layer_matches_peft_outputs_and_gradients(method, use_dora):
    linear, A, B, m, x, upstream = weights()
    ours, ours_params = qlbench_forward(method, linear, A, B, m)
    theirs, theirs_params = peft_layer(linear, A, B, m, use_dora)
    assert set(ours_params) == set(theirs_params) == ({"A", "B", "m"} if use_dora else {"A", "B"})
    y, gx, grads = outputs_and_gradients(ours, ours_params, x, upstream)
    y_ref, gx_ref, grads_ref = outputs_and_gradients(theirs, theirs_params, x, upstream)
    assert not torch.allclose(y_ref, linear(x))  # the adapter is live: the comparison is not trivial
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(gx, gx_ref, **TOL)
    for name, g_ref in grads_ref.items():
        torch.testing.assert_close(grads[name][0], g_ref, **TOL, msg=f"gradient of {name}")


def test_dora_magnitude_init_matches_peft():
    """Both start B at zero, so peft's magnitude init ||W0 + s B A||_row and qlbench's ||W0||_row agree."""
    linear = weights()[0]
    wrapped = OneLinear(nn.Linear(D_IN, D_OUT, dtype=F64))
    with torch.no_grad():
        wrapped.lin.weight.copy_(linear.weight)
    config = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["lin"], use_dora=True)
    theirs = peft.get_peft_model(wrapped, config).base_model.model.lin.lora_magnitude_vector["default"].weight
    ours = qlbench_layer("dora", linear)
    torch.testing.assert_close(ours.dora_m[0], theirs, **TOL)
