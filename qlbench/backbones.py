"""The two backbones of the paper, as stacks of E independent members (see qlbench/stacked.py).

- DeepNarrowMLP: the paper's optimisation stress test, a plain GELU MLP with 32 hidden layers of width 32.
- RegressionTransformer: an 8-layer pre-LayerNorm encoder (d = 256, 4 heads, FFN 1024) over two coordinate tokens.

Both take x (E, N, 2) and return predictions (E, N), and list the linears an adapter may wrap (`adapter_targets`).
Target linears are called as `layer(x, ctx)` so an adapter can read and write the per-forward ForwardContext.

Backbone initialisation (`build_backbone(..., init=...)`, `qlbench run --backbone-init`): "default" is PyTorch's
default (the paper does not specify one), under which the deep-narrow MLP is a constant function of its input
(docs/why.md). "kaiming" and "orthogonal" re-draw the deep-narrow's 32 hidden layers variance-preserving for GELU
(see `GELU_GAIN`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from qlbench.seeding import generator
from qlbench.stacked import ForwardContext, StackedLinear, normal_members, param


def _gelu_gain() -> float:
    """1 / sqrt(E[gelu(z)^2]) for z ~ N(0, 1), by 80-point Gauss-Hermite quadrature (about 1.5323)."""
    z, w = np.polynomial.hermite_e.hermegauss(80)  # nodes and weights for the weight exp(-z^2 / 2)
    gelu = torch.nn.functional.gelu(torch.from_numpy(z)).numpy()
    return float(1.0 / math.sqrt((w * gelu**2).sum() / math.sqrt(2 * math.pi)))


# Kaiming's variance-preserving gain, derived for GELU as He et al. derive sqrt(2) for ReLU: a layer
# y = W gelu(x) with W_ij ~ N(0, g^2 / fan_in) keeps Var(y_i) = g^2 E[gelu(x)^2] equal to Var(x_i) = 1 when
# g^2 = 1 / E[gelu(z)^2], z ~ N(0, 1). (ReLU's sqrt(2) is too small for GELU: near zero GELU is x / 2, so a sqrt(2)
# network shrinks small activations by up to 2x in variance per layer, and with it the signal collapses on four of
# five zoo functions in tests/test_backbone_init.py.) GELU is not homogeneous, so unit variance is an unstable fixed
# point of the zero-bias map: for the zoo's input boxes (first-layer pre-activations O(1) or larger) the spread of
# the hidden features across inputs after layer 32 is 0.15x to 55x that after layer 1 at init (nine functions x
# 5 seeds), against about 1e-9x with the default init.
GELU_GAIN = _gelu_gain()
DEFAULT_INIT = "default"  # PyTorch's default init; records and labels name an init only when it is not this one
INITS = (DEFAULT_INIT, "kaiming", "orthogonal")  # backbone initialisations (`qlbench run --backbone-init`)


def check_init(arch: str, init: str) -> str:
    """The init if `arch` supports it, else a ValueError naming the valid choices."""
    if init not in INITS:
        raise ValueError(f"unknown backbone init {init!r}; valid: {', '.join(INITS)}")
    if init != DEFAULT_INIT and arch != "deep-narrow":
        raise ValueError(
            f"backbone init {init!r} is implemented for deep-narrow only; valid for {arch}: {DEFAULT_INIT}"
        )
    return init


@dataclass(frozen=True)
class Target:
    """A linear layer an adapter may wrap.

    path:  dotted submodule path, e.g. "hidden.3" or "layers.0.q".
    role:  "hidden" (MLP layer), "q", "k", "v", "o" (attention projections) or "fc1", "fc2" (Transformer FFN).
    layer: index of the backbone layer it belongs to (the unit that routing blocks are made of).
    """

    path: str
    role: str
    layer: int


@dataclass(frozen=True)
class DeepNarrowConfig:
    d_in: int = 2
    width: int = 32
    depth: int = 32  # hidden layers, each width x width + GELU


class DeepNarrowMLP(nn.Module):
    """x (E, N, 2) -> input layer 2->32 + GELU -> 32 x [Linear(32, 32) + GELU] -> head 32->1 -> (E, N).

    No residuals and no normalisation: a deep plain MLP, the hard case the paper's stress test is about. The 32
    square hidden layers are the adapter targets; the input layer and the head stay frozen under every adapter.
    """

    n_layers: int

    def __init__(
        self,
        generators: list[torch.Generator],
        config: DeepNarrowConfig = DeepNarrowConfig(),
        *,
        device=None,
        dtype=None,
    ):
        super().__init__()
        c, kw = config, dict(device=device, dtype=dtype)
        self.config = c
        self.n_layers = c.depth
        self.inp = StackedLinear(c.d_in, c.width, generators, **kw)
        self.hidden = nn.ModuleList(StackedLinear(c.width, c.width, generators, **kw) for _ in range(c.depth))
        self.head = StackedLinear(c.width, 1, generators, **kw)
        self.shared = nn.ModuleDict()  # shared adapter modules live here (see adapters.inject)

    def reinit_hidden(self, init: str, generators: list[torch.Generator]) -> None:
        """Re-draw the 32 hidden layers variance-preserving for GELU (biases zero), member e from generators[e]:
        "kaiming": W ~ N(0, GELU_GAIN^2 / fan_in); "orthogonal": W = GELU_GAIN Q, Q Haar-orthogonal (the QR of a
        Gaussian matrix, signs fixed by R's diagonal). Input layer and head keep PyTorch's default."""
        width = self.config.width
        for layer in self.hidden:
            if init == "kaiming":
                w = normal_members((width, width), GELU_GAIN / math.sqrt(width), generators)  # (E, 32, 32) float64
            elif init == "orthogonal":
                qs = []
                for g in generators:
                    q, r = torch.linalg.qr(torch.randn(width, width, generator=g, dtype=torch.float64))
                    qs.append(q * torch.sign(torch.diagonal(r)))  # Haar measure (Mezzadri 2007)
                w = GELU_GAIN * torch.stack(qs)  # (E, 32, 32)
            else:
                raise ValueError(f"unknown hidden-layer init {init!r}; valid: kaiming, orthogonal")
            with torch.no_grad():
                layer.weight.copy_(w)
                layer.bias.zero_()

    def features(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The hidden features of the plain backbone, [gelu(inp(x)), then after each hidden layer]: depth + 1
        tensors (E, N, 32) (signal propagation, `qlbench signal`)."""
        ctx = ForwardContext(self.shared)
        h = F.gelu(self.inp(x))
        out = [h]
        for layer in self.hidden:
            h = F.gelu(layer(h, ctx))
            out.append(h)
        return out

    def adapter_targets(self, roles: tuple[str, ...] | None = None) -> list[Target]:
        roles = roles or ("hidden",)
        if set(roles) != {"hidden"}:
            raise ValueError(f"deep-narrow has only 'hidden' adapter targets, got {roles}")
        return [Target(f"hidden.{i}", "hidden", i) for i in range(self.n_layers)]

    def forward(
        self,
        x: torch.Tensor,
        instruction: torch.Tensor | None = None,
        ctx: ForwardContext | None = None,
        task: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (E, N, 2) -> (E, N); `task` (E, N) long: each sample's task in a multi-task suite (None: one task)."""
        ctx = ctx or ForwardContext(self.shared, instruction, task)
        h = F.gelu(self.inp(x))  # (E, N, 32)
        for layer in self.hidden:
            h = F.gelu(layer(h, ctx))  # (E, N, 32)
        return self.head(h).squeeze(-1)  # (E, N)


@dataclass(frozen=True)
class TransformerConfig:
    d_in: int = 2  # each input coordinate is one token
    d_model: int = 256
    n_layers: int = 8
    n_heads: int = 4
    d_ff: int = 1024


class StackedLayerNorm(nn.Module):
    """E independent LayerNorms over the last dimension (weight 1, bias 0 at init)."""

    def __init__(self, d: int, members: int, *, device=None, dtype=None, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(members, d, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(members, d, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (E, ..., d)
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) * self.weight.view(shape) + self.bias.view(shape)


# Devices whose attention is PyTorch's fused F.scaled_dot_product_attention at every length: the CPU, so its numbers
# keep their bits. Elsewhere (CUDA, and the meta device that counts CUDA's kernels) sequences of up to SHORT_SEQUENCE
# tokens take `short_attention`: on this backbone's sequences of two tokens the fused memory-efficient kernels, tiled
# for 64 queries, take half the kernel time of a captured Transformer LoRA step at 45 members on a data-centre GPU
# (7.7 of 15.2 ms; measured: docs/speed.md).
FUSED_ATTENTION_DEVICES = ("cpu",)
SHORT_SEQUENCE = 16


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d_h)) v per head, q, k, v (N, T, H, d_h) -> (N, T, H, d_h): F.scaled_dot_product_attention
    on FUSED_ATTENTION_DEVICES and for longer sequences, `short_attention` elsewhere."""
    kind = "cpu" if q.is_cpu else q.device.type  # is_cpu: an attribute read, where .device builds an object
    if kind in FUSED_ATTENTION_DEVICES or q.shape[1] > SHORT_SEQUENCE:
        heads = lambda t: t.transpose(1, 2)  # (N, H, T, d_h)
        return F.scaled_dot_product_attention(heads(q), heads(k), heads(v)).transpose(1, 2)
    return short_attention(q, k, v)


def short_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same attention as broadcast products and sums over the T x T query-key pairs (T small): a handful of
    element-wise kernels in the tokens' own layout, no (N H) batch of T x T matmuls and no copies into heads-first
    layout. q, k, v (N, T, H, d_h) -> (N, T, H, d_h)."""
    scores = (q.unsqueeze(2) * k.unsqueeze(1)).sum(-1) * q.shape[-1] ** -0.5  # (N, T, S, H): query t, key s
    weights = torch.softmax(scores, dim=2)  # over the keys
    return (weights.unsqueeze(-1) * v.unsqueeze(1)).sum(2)  # (N, T, H, d_h)


class EncoderLayer(nn.Module):
    """Pre-LN encoder layer: h + Attn(LN(h)), then h + FFN(LN(h)); q, k, v, o, fc1, fc2 are adapter targets."""

    def __init__(self, c: TransformerConfig, generators: list[torch.Generator], **kw):
        super().__init__()
        E, d = len(generators), c.d_model
        self.n_heads = c.n_heads
        self.ln1, self.ln2 = StackedLayerNorm(d, E, **kw), StackedLayerNorm(d, E, **kw)
        self.q, self.k, self.v, self.o = (StackedLinear(d, d, generators, **kw) for _ in range(4))
        self.fc1 = StackedLinear(d, c.d_ff, generators, **kw)
        self.fc2 = StackedLinear(c.d_ff, d, generators, **kw)

    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        E, B, T, d = h.shape
        H = self.n_heads
        # q, k and v read the same input; a router that needs their joint rank state sees them together.
        q, k, v = project_group((self.q, self.k, self.v), self.ln1(h), ctx)  # each (E, B, T, d)
        tokens = lambda t: t.reshape(E * B, T, H, d // H)  # (E*B, T, H, d/H)
        a = attention(tokens(q), tokens(k), tokens(v)).reshape(E, B, T, d)
        h = h + self.o(a, ctx)
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h), ctx)), ctx)


class RegressionTransformer(nn.Module):
    """x (E, N, 2) -> tokens x_j * v_j + p_j (E, N, 2, 256) -> 8 pre-LN encoder layers -> mean over tokens
    -> LayerNorm -> linear head -> (E, N).

    Token vectors v_j and positions p_j are drawn N(0, 1) (as nn.Embedding); linears use PyTorch's default init.
    """

    def __init__(
        self,
        generators: list[torch.Generator],
        config: TransformerConfig = TransformerConfig(),
        *,
        device=None,
        dtype=None,
    ):
        super().__init__()
        c, kw = config, dict(device=device, dtype=dtype)
        self.config = c
        self.n_layers = c.n_layers
        self.token = param(normal_members((c.d_in, c.d_model), 1.0, generators), **kw)  # v_j (E, 2, d)
        self.position = param(normal_members((c.d_in, c.d_model), 1.0, generators), **kw)  # p_j (E, 2, d)
        self.layers = nn.ModuleList(EncoderLayer(c, generators, **kw) for _ in range(c.n_layers))
        self.ln_f = StackedLayerNorm(c.d_model, len(generators), **kw)
        self.head = StackedLinear(c.d_model, 1, generators, **kw)
        self.shared = nn.ModuleDict()

    def features(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The hidden features of the plain backbone: the token embedding, then after each encoder layer, each
        (E, N, 2 d) (the two tokens' features side by side; signal propagation, `qlbench signal`)."""
        ctx = ForwardContext(self.shared)
        h = x.unsqueeze(-1) * self.token.unsqueeze(1) + self.position.unsqueeze(1)  # (E, N, 2, d)
        out = [h.flatten(2)]
        for layer in self.layers:
            h = layer(h, ctx)
            out.append(h.flatten(2))
        return out

    def adapter_targets(self, roles: tuple[str, ...] | None = None) -> list[Target]:
        roles = roles or ("q", "k", "v", "o")
        valid = ("q", "k", "v", "o", "fc1", "fc2")
        if bad := [r for r in roles if r not in valid]:
            raise ValueError(f"unknown transformer adapter target(s) {bad}; valid: {', '.join(valid)}")
        return [Target(f"layers.{i}.{r}", r, i) for i in range(self.n_layers) for r in valid if r in roles]

    def forward(
        self,
        x: torch.Tensor,
        instruction: torch.Tensor | None = None,
        ctx: ForwardContext | None = None,
        task: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (E, N, 2) -> (E, N); `task` (E, N) long: each sample's task in a multi-task suite (None: one task)."""
        ctx = ctx or ForwardContext(self.shared, instruction, task)
        h = x.unsqueeze(-1) * self.token.unsqueeze(1) + self.position.unsqueeze(1)  # (E, N, 2, d)
        for layer in self.layers:
            h = layer(h, ctx)
        return self.head(self.ln_f(h.mean(dim=2))).squeeze(-1)  # (E, N)


def project_group(layers, x: torch.Tensor, ctx: ForwardContext) -> list[torch.Tensor]:
    """Apply linears that read the same input (attention q, k, v).

    An adapter whose routing needs the group's joint rank state (queryable: the token-averaged Q/K/V states)
    provides a `group_forward(layers, x, ctx)`, called with the whole group (adapted or not) when any of its
    layers has one; otherwise the layers are applied one by one.
    """
    group_forward = next((layer.group_forward for layer in layers if hasattr(layer, "group_forward")), None)
    if group_forward is not None:
        return group_forward(layers, x, ctx)
    return [layer(x, ctx) for layer in layers]


def build_backbone(arch: str, seeds: list, *, device=None, dtype=torch.float32, init: str = DEFAULT_INIT) -> nn.Module:
    """A freshly initialised stack, member e seeded from `seeds[e]` (any hashable member key).

    init "default": PyTorch's default everywhere (the paper does not specify one). "kaiming" / "orthogonal"
    (deep-narrow only): the same default draws, then the hidden layers re-drawn from a generator of their own
    (`DeepNarrowMLP.reinit_hidden`), so the input layer and head equal the default init's."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; valid: {', '.join(ARCHS)}")
    check_init(arch, init)
    generators = [generator("init", arch, "backbone", s) for s in seeds]
    model = ARCHS[arch](generators, device=device, dtype=dtype)
    if init != DEFAULT_INIT:
        model.reinit_hidden(init, [generator("init", arch, "backbone", init, s) for s in seeds])
    return model


ARCHS = {"deep-narrow": DeepNarrowMLP, "transformer": RegressionTransformer}
