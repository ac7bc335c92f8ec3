"""share-lora (ShareLoRA, arXiv 2406.10785): LoRA with one factor shared by a role's layers. The oracle is LoRA
itself (checked against peft elsewhere): a LoRA whose layers all hold the shared factor's values gives the same
outputs, and its per-layer gradients of that factor sum to the shared factor's gradient."""

from __future__ import annotations

import pytest
import torch

from qlbench import adapters, engine
from qlbench.backbones import DeepNarrowConfig, DeepNarrowMLP
from qlbench.experiments import planning
from qlbench.seeding import generator

F64 = torch.float64
MEMBERS = [("dropwave", 0), ("levy", 1)]


@pytest.mark.parametrize(
    ("share", "deep_narrow", "transformer"),
    [("A", 8 * 32 + 32 * 32 * 8, 4 * 8 * 256 + 32 * 256 * 8), ("B", 8 * 32 + 32 * 32 * 8, 4 * 8 * 256 + 32 * 256 * 8),
     ("AB", 2 * 8 * 32, 4 * 2 * 8 * 256)],
)  # fmt: skip
def test_trainable_parameters_by_hand(share, deep_narrow, transformer):
    """R roles, L layers, rank 8: share A gives R r d_in + L r d_out (the deep-narrow: one role of 32 layers 32 x 32;
    the Transformer: q, k, v, o of 8 layers, 256 x 256)."""
    config = adapters.get("share-lora").make_config(share=share)
    for arch, want in (("deep-narrow", deep_narrow), ("transformer", transformer)):
        assert planning.dry_build(arch, {"share-lora": config})["share-lora"][1] == want, (arch, share)


def pair(share: str):
    """share-lora and LoRA on copies of one float64 deep-narrow stack, share-lora's factors drawn at random (B too,
    so the update is not zero) and copied into every LoRA layer; and the members' target data."""
    gens = lambda: [generator("test-share", *m) for m in MEMBERS]
    data = engine.StackedData.build(MEMBERS, "target", device="cpu", dtype=F64)
    models = {}
    for name, config in (("share-lora", {"share": share}), ("lora", {})):
        method = adapters.get(name)
        backbone = DeepNarrowMLP(gens(), DeepNarrowConfig(depth=4), dtype=F64)
        models[name] = method.build(backbone, method.make_config(**config), gens(), data.y_train)
    shared, lora = models["share-lora"], models["lora"]
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in shared.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.3)
        layers = [m for m in shared.modules() if hasattr(m, "factors") and hasattr(m, "role")]
        tied = [m for m in lora.modules() if hasattr(m, "lora_A")]
        assert len(layers) == len(tied) == 4
        for s, t in zip(layers, tied):
            A, B = s.factors(shared.shared)
            t.lora_A.copy_(A)
            t.lora_B.copy_(B)
    return shared, lora, layers, tied, data


@pytest.mark.parametrize("share", ["A", "B", "AB"])
def test_share_lora_is_lora_with_its_factors_tied(share):
    shared, lora, layers, tied, data = pair(share)
    x, y = data.x_train[:, :64], data.y_train[:, :64]
    losses = [(m(x, None) - y).pow(2).mean(1).sum() for m in (shared, lora)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-12, atol=0)
    for loss in losses:
        loss.backward()
    for factor in ("A", "B"):
        grads = [getattr(t, f"lora_{factor}").grad for t in tied]
        if factor in share:  # the shared factor's gradient is the sum of what each layer's copy would get
            (p,) = [p for n, p in shared.shared["sharelora"].factors.items() if n.startswith(factor)]
            torch.testing.assert_close(p.grad, sum(grads), rtol=1e-10, atol=1e-14)
        else:
            for s, g in zip(layers, grads):
                torch.testing.assert_close(getattr(s, f"sharelora_{factor}").grad, g, rtol=1e-10, atol=1e-14)


def test_the_tie_check_can_fail():
    """One LoRA layer holding another A (a planted untied layer) moves the outputs: the equality above is a check."""
    shared, lora, _, tied, data = pair("A")
    with torch.no_grad():
        tied[2].lora_A.mul_(1.01)
    x = data.x_train[:, :64]
    assert not torch.allclose(shared(x, None), lora(x, None), rtol=1e-6, atol=0)


def test_bad_share_is_refused():
    with pytest.raises(ValueError, match="share must be one of A, B, AB"):
        adapters.get("share-lora").make_config(share="C")
