"""Small real models for the theorem checks: a DeepNarrowMLP or RegressionTransformer (qlbench.backbones) adapted
with Queryable LoRA through the registry, exactly as the engine builds it, then given non-trivial adapter weights
(at initialisation B = 0 and every update vanishes, which would make most statements trivially true).

Hypothesis draws the sizes, hyper-parameters, weight scales and a seed; the weights themselves come from a seeded
torch generator (a real model has too many entries to draw one by one).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import torch
from hypothesis import strategies as st

from qlbench import adapters
from qlbench.adapters import queryable
from qlbench.backbones import DeepNarrowConfig, DeepNarrowMLP, RegressionTransformer, TransformerConfig

from strategies import reals


@dataclass(frozen=True)
class ModelCase:
    arch: str  # "deep-narrow" or "transformer"
    seed: int
    n_layers: int
    n_blocks: int
    r: int
    n_atoms: int
    top_k: int
    d_k: int
    instruction_dim: int | None
    lambda_ctx: float
    tau_lang: float
    t_attn: float
    t_dep: float
    t_lang: float
    rms_eps: float
    scale_A: float
    scale_B: float
    scale_atoms: float
    eta_mean: float
    n_samples: int
    members: int = 2

    def config(self):
        return adapters.get("queryable").make_config(
            r=self.r,
            n_blocks=self.n_blocks,
            n_atoms=self.n_atoms,
            top_k=self.top_k,
            d_k=self.d_k,
            instruction_dim=self.instruction_dim,
            lambda_ctx=self.lambda_ctx,
            tau_lang=self.tau_lang,
            t_attn=self.t_attn,
            t_dep=self.t_dep,
            t_lang=self.t_lang,
            rms_eps=self.rms_eps,
        )

    def generators(self, tag: int = 0) -> list[torch.Generator]:
        return [torch.Generator().manual_seed(self.seed * 7919 + 31 * e + tag) for e in range(self.members)]

    def backbone(self) -> torch.nn.Module:
        gens = self.generators()
        if self.arch == "deep-narrow":
            return DeepNarrowMLP(gens, DeepNarrowConfig(width=6, depth=self.n_layers), dtype=torch.float64)
        return RegressionTransformer(
            gens, TransformerConfig(d_model=8, n_layers=self.n_layers, n_heads=2, d_ff=16), dtype=torch.float64
        )

    def build(self) -> torch.nn.Module:
        """The adapted model (registry build), with every adapter weight redrawn at the case's scales."""
        model = adapters.get("queryable").build(self.backbone(), self.config(), self.generators(1), None)
        g = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if not p.requires_grad:
                    continue
                z = torch.randn(p.shape, generator=g, dtype=p.dtype)
                leaf = name.rsplit(".", 1)[-1]
                if leaf == "queryable_A":
                    p.copy_(z * self.scale_A / math.sqrt(p.shape[-1]))
                elif leaf == "queryable_B":
                    p.copy_(z * self.scale_B / math.sqrt(p.shape[-1]))
                elif leaf == "queryable_eta":
                    p.copy_(z + self.eta_mean)
                elif leaf == "atoms":
                    p.copy_(z * self.scale_atoms)
                elif leaf in ("keys", "block_prior"):
                    p.copy_(z)
                else:  # router matrices Q_cur, Q_dep, Q_dep_q, Q_dep_k, Q_ctx, R_ctx: N(0, 1/fan_in)
                    p.copy_(z / math.sqrt(p.shape[-1]))
        return model

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (E, N, 2) in [-1, 1]^2 and the instruction embedding e (E, d_c) (None without instruction channels)."""
        g = torch.Generator().manual_seed(self.seed + 1)
        x = torch.rand(self.members, self.n_samples, 2, generator=g, dtype=torch.float64) * 2 - 1
        e = None
        if self.instruction_dim is not None:
            e = torch.randn(self.members, self.instruction_dim, generator=g, dtype=torch.float64)
        return x, e


@st.composite
def model_cases(
    draw,
    arch: str = "deep-narrow",
    *,
    instruction: bool | None = None,
    min_blocks: int = 1,
    max_layers: int | None = None,
) -> ModelCase:
    """instruction True: lambda_ctx, tau_lang > 0; False: state-only routing; None: either."""
    max_layers = max_layers or (6 if arch == "deep-narrow" else 3)
    n_layers = draw(st.integers(max(2, min_blocks), max_layers))
    n_blocks = draw(st.integers(min_blocks, n_layers))
    M = draw(st.integers(1, 5))
    use = draw(st.booleans()) if instruction is None else instruction
    return ModelCase(
        arch=arch,
        seed=draw(st.integers(0, 2**16)),
        n_layers=n_layers,
        n_blocks=n_blocks,
        r=draw(st.integers(1, 4)),
        n_atoms=M,
        top_k=draw(st.integers(1, M)),
        d_k=draw(st.integers(1, 6)),
        instruction_dim=draw(st.integers(1, 4)) if use else None,
        lambda_ctx=draw(reals(0.05, 2.0)) if use else 0.0,
        tau_lang=draw(reals(0.05, 3.0)) if use else 0.0,
        t_attn=draw(reals(0.2, 5.0)),
        t_dep=draw(reals(0.2, 5.0)),
        t_lang=draw(reals(0.2, 5.0)),
        rms_eps=draw(st.sampled_from([1e-6, 1e-3])),
        scale_A=draw(st.sampled_from([1.0, 3.0])),
        scale_B=draw(st.sampled_from([0.3, 1.0, 3.0])),
        scale_atoms=draw(st.sampled_from([0.02, 0.5, 2.0])),
        eta_mean=draw(reals(-3.0, 3.0)),
        n_samples=draw(st.integers(1, 4)),
    )


@contextmanager
def capture_rank_updates(ts: list[torch.Tensor]):
    """Record t_l = s_l + g_l S_b s_l, the rank-space vector each QueryableLinear hands to low_rank_update, in call
    order (the same order as tracing.trace's calls), with retain_grad so that r_l = dL/dt_l is read by autograd."""
    original = queryable.low_rank_update

    def recording(y, t, B, scale):
        t.retain_grad()
        ts.append(t)
        return original(y, t, B, scale)

    # the plain-op path, where t_l is a tensor autograd can hold (not inside the eager RoutedLinear node)
    with mock.patch.object(queryable, "low_rank_update", recording), mock.patch.object(queryable, "ROUTED_NODE", False):
        yield
