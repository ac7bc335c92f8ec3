"""Building blocks of the stacked ensemble: E independent models trained in one batched step.

Every parameter carries a leading member dimension E, every activation is (E, N, ...), and member e only ever
touches slice e: a stack of E models is exactly E separate models (tested), computed with batched matmuls.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

_SHAPES_ONLY = contextvars.ContextVar("shapes_only", default=False)


@contextlib.contextmanager
def shapes_only():
    """Within it the member initialisers draw nothing: they return meta tensors of the right shape, so a model can
    be built to count its weights without allocating them (`planning.dry_build`, whatever the sizes asked)."""
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def _meta(shape: tuple[int, ...], generators: list[torch.Generator]) -> torch.Tensor | None:
    return torch.empty((len(generators), *shape), dtype=torch.float64, device="meta") if _SHAPES_ONLY.get() else None


def uniform_members(shape: tuple[int, ...], bound: float, generators: list[torch.Generator]) -> torch.Tensor:
    """(E, *shape) drawn U(-bound, bound), member e from generators[e] only (float64, CPU)."""
    if (meta := _meta(shape, generators)) is not None:
        return meta
    return torch.stack([(torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * bound for g in generators])


def normal_members(shape: tuple[int, ...], std: float, generators: list[torch.Generator]) -> torch.Tensor:
    """(E, *shape) drawn N(0, std^2), member e from generators[e] only (float64, CPU)."""
    if (meta := _meta(shape, generators)) is not None:
        return meta
    return torch.stack([torch.randn(shape, generator=g, dtype=torch.float64) * std for g in generators])


def zero_members(shape: tuple[int, ...], members: int) -> torch.Tensor:
    """(E, *shape) zeros (float64, CPU; meta within `shapes_only`)."""
    if _SHAPES_ONLY.get():
        return torch.empty((members, *shape), dtype=torch.float64, device="meta")
    return torch.zeros((members, *shape), dtype=torch.float64)


def param(values: torch.Tensor, like: torch.Tensor | None = None, *, device=None, dtype=None) -> nn.Parameter:
    """A trainable parameter from float64 CPU `values`, moved to `like`'s (or the given) device and dtype."""
    device = like.device if like is not None else device
    dtype = like.dtype if like is not None else (dtype or torch.get_default_dtype())
    return nn.Parameter(values.to(device=device, dtype=dtype))


class StackedLinear(nn.Module):
    """E independent `nn.Linear(d_in, d_out)` layers: x (E, ..., d_in) -> (E, ..., d_out).

    Initialised like PyTorch's default (weight and bias U(-1/sqrt(d_in), 1/sqrt(d_in))), member e from
    generators[e], so a stack equals E separately initialised layers.
    """

    def __init__(self, d_in: int, d_out: int, generators: list[torch.Generator], *, device=None, dtype=None):
        super().__init__()
        bound = 1.0 / math.sqrt(d_in)
        self.d_in, self.d_out = d_in, d_out
        self.weight = param(uniform_members((d_out, d_in), bound, generators), device=device, dtype=dtype)
        self.bias = param(uniform_members((d_out,), bound, generators), device=device, dtype=dtype)

    @property
    def members(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        return stacked_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"members={self.members}, d_in={self.d_in}, d_out={self.d_out}"


def stacked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (E, ..., d_in) @ weight (E, d_out, d_in)^T + bias (E, d_out) -> (E, ..., d_out), one batched matmul."""
    x2 = x if x.dim() == 3 else x.reshape(x.shape[0], -1, x.shape[-1])  # (E, N, d_in); no reshape ops when 3-D
    if bias is None:
        wt = weight.transpose(1, 2)  # (E, d_in, d_out) view
        y = LayoutBmm.apply(None, x2, wt, 1.0) if layout_grads(x) else torch.bmm(x2, wt)
    else:
        y = bmm_add(bias.unsqueeze(1), x2, weight.transpose(1, 2))  # (E, N, d_out)
    return y if x.dim() == 3 else y.reshape(*x.shape[:-1], weight.shape[1])


def bmm_add(input: torch.Tensor, b1: torch.Tensor, b2: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """input + alpha * b1 @ b2 for batched b1 (E, n, k), b2 (E, k, m) and input broadcastable to (E, n, m).

    Eager: one `torch.baddbmm`. Under torch.compile: a bmm and an add, which Inductor fuses into the element-wise
    kernel that follows (the GELU) instead of paying baddbmm's copy of `input` into its output before the matmul
    (measured: docs/speed.md). Both give the same values up to float rounding order.
    """
    if torch.compiler.is_compiling():
        y = torch.bmm(b1, b2)
        return input + (y if alpha == 1 else alpha * y)
    if layout_grads(b1):
        return LayoutBmm.apply(input, b1, b2, alpha)
    return torch.baddbmm(input, b1, b2, alpha=alpha)


# Devices whose stacked layers keep autograd's own matmul backward: on the CPU it runs as it always has, so the CPU's
# numbers keep their bits (a matmul in another layout may add in another order). Elsewhere (CUDA, and the meta
# device that counts CUDA's kernels) the eager matmuls run as LayoutBmm (`layout_grads`).
AUTOGRAD_MATMUL_DEVICES = ("cpu",)


def layout_grads(t: torch.Tensor) -> bool:
    """Whether the eager batched matmuls of `stacked_linear` and `bmm_add`, on `t`'s device, run as LayoutBmm: off
    AUTOGRAD_MATMUL_DEVICES and outside torch.compile (whose own kernels lay gradients out as they fit)."""
    kind = "cpu" if t.is_cpu else t.device.type  # is_cpu: an attribute read, where .device builds an object
    if kind in AUTOGRAD_MATMUL_DEVICES or torch.compiler.is_compiling():
        return False
    return not torch._C._are_functorch_transforms_active()  # under vmap (adapters/member.py) LayoutBmm has no rule


class LayoutBmm(torch.autograd.Function):
    """input + alpha * b1 @ b2 (input None: alpha * b1 @ b2) for b1 (E, n, k), b2 (E, k, m), input broadcastable to
    (E, n, m), with a backward that launches fewer kernels than autograd's:

    - each matrix's gradient is written in that matrix's own memory layout. A weight enters as a transposed view
      (x @ W^T); autograd's gradient of the view is contiguous, so its transpose is not, and the parameter's
      gradient accumulator copies it into W's layout: one copy per weight per step;
    - alpha rides in the matmul (cuBLAS's alpha, with beta 0) instead of a separate multiplication per gradient.

    The values are the same sums (tests/test_stacked.py compares them with autograd's, and counts the kernels)."""

    @staticmethod
    def forward(ctx, input, b1, b2, alpha: float):
        ctx.save_for_backward(b1, b2)
        ctx.alpha = alpha
        return scaled_bmm(b1, b2, alpha) if input is None else torch.baddbmm(input, b1, b2, alpha=alpha)

    @staticmethod
    def backward(ctx, grad):  # grad (E, n, m)
        b1, b2 = ctx.saved_tensors
        need = ctx.needs_input_grad
        grad_input = grad if need[0] else None  # autograd sums it over a broadcast input's expanded dimensions
        grad_b1 = _scaled_bmm_like(grad, b2.transpose(1, 2), ctx.alpha, like=b1) if need[1] else None
        grad_b2 = _scaled_bmm_like(b1.transpose(1, 2), grad, ctx.alpha, like=b2) if need[2] else None
        return grad_input, grad_b1, grad_b2, None


def scaled_bmm(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha * a @ b for batched a (E, n, k), b (E, k, m), in one kernel: the scale rides in the matmul (cuBLAS's
    alpha; the input of a baddbmm with beta 0 is ignored, so an empty one serves)."""
    return torch.bmm(a, b) if alpha == 1 else torch.baddbmm(a.new_empty(()), a, b, beta=0, alpha=alpha)


def _scaled_bmm_like(a: torch.Tensor, b: torch.Tensor, alpha: float, like: torch.Tensor) -> torch.Tensor:
    """alpha * a @ b (E, n, m) in the memory layout of `like`: as the transpose of a contiguous (E, m, n) when `like`
    is a transposed view, contiguous otherwise; one kernel."""
    transposed = not like.is_contiguous() and like.transpose(1, 2).is_contiguous()
    if transposed:
        a, b = b.transpose(1, 2), a.transpose(1, 2)  # (a @ b)^T = b^T @ a^T
    out = scaled_bmm(a, b, alpha)
    return out.transpose(1, 2) if transposed else out


# Width, in elements, that every member's slice is padded to by `memberwise`: a multiple of the longest step of
# PyTorch's vectorised CPU loops (two 512-bit vectors of float32, 32 elements), with room for wider vector units.
LANES = 64


def memberwise(fn: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    """fn (an element-wise transcendental such as sigmoid or softplus) of t (E, ...), with the same bits for member e
    at any stack width E.

    PyTorch's CPU element-wise kernels run vector code over a tensor's first elements and finish the tail with
    scalar code, and for exp-based functions the two differ in the last bits. In a small per-member tensor (one gate
    per member: (E,)) which of member e's elements fall in the tail depends on E, so a member's numbers would depend
    on its stack (measured: Queryable LoRA's sigmoid gate in a 19-member stack; docs/speed.md). Padding each member's
    slice to a multiple of LANES puts every element on the vector path at any E. Large per-member tensors whose
    size is a multiple of LANES (activations (E, N, 32)) need no padding: they stay on the vector path already.

    Off the CPU, fn is applied as it is. CUDA's element-wise kernels compute every element with the same scalar code
    (vector loads, then one functor per element, in the main loop and the tail alike), so there is no tail to pad
    away, and the padding's kernels (a pad and a slice forward, a slice-backward and a pad backward) would be about
    four of Queryable LoRA's 44 CUDA kernels per deep-narrow layer (docs/speed.md)."""
    if t.device.type != "cpu":
        return fn(t)
    flat = t.reshape(t.shape[0], -1)  # (E, k)
    k = flat.shape[1]
    return fn(F.pad(flat, (0, -k % LANES)))[:, :k].reshape(t.shape)


def rank_project(x: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """x (E, ..., d_in) -> A x (E, ..., r) for A (E, r, d_in)."""
    return stacked_linear(x, A)


@dataclass
class ForwardContext:
    """State that crosses layers during one forward pass; created fresh for every forward (no hidden globals).

    shared:      the model's shared adapter modules (routing memory, generator networks, hypernetworks).
    instruction: (E, d_c) frozen instruction embedding e(c) per member, or None.
    task:        (E, N) long: each sample's task index in a multi-task suite (suites.py), or None (one task).
                 Task-conditioned adapters and instruction routers read it; every other layer ignores it.
    scratch:     per-forward working state owned by adapters (e.g. queryable block summaries and routing weights),
                 keyed by method name; tests and notebooks read routing weights from here.
    """

    shared: nn.ModuleDict
    instruction: torch.Tensor | None = None
    task: torch.Tensor | None = None
    scratch: dict = field(default_factory=dict)
