"""Kernels per training step, counted without a GPU: the ATen ops a stack's forward and backward dispatch on
PyTorch's meta device (shapes only, no arithmetic).

On CUDA a step captured in a CUDA graph costs a few µs per kernel on the deep-narrow backbone (docs/speed.md has the
measured figure), so the kernel count is what a change to a method's layers moves. The meta device runs the code a
CUDA device runs where the two differ from the CPU's (`stacked.memberwise` pads on the CPU only), and each
dispatched op is counted as one kernel (a few launch two on CUDA, e.g. a baddbmm's copy of its input): views and
allocations are left out, as they launch none. The step is the engine's, its loss included; not counted: the
optimiser's update (on CUDA one fused AdamW kernel, or full-soap's SOAP step). An estimate of torch.profiler's CUDA
count (`capture.capture_row`; docs/speed.md compares the two on a GPU).

Each kernel is also counted with its FLOPs and the bytes it moves (`step_traffic`), from which `roofline_ms` gives
the step's floor on a device of a given matmul rate and memory bandwidth: what the step would take if every kernel
ran at whichever of the two bounds it, with nothing lost to launches (`qlbench bench` on CUDA compares each captured
step with it, at the rates the run measured).
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, shape_wrapper

from qlbench import engine
from qlbench.bench.models import batches, stacked_model
from qlbench.bench.timing import IN_PLACE_MATMULS
from qlbench.stacked import shapes_only

# ops that return fresh memory without a kernel, or read a value back: no launch
NO_KERNEL = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "_unsafe_view",
    "detach",
    "lift_fresh",
    "resolve_conj",
    "resolve_neg",
    "_local_scalar_dense",
}


class Kernel(NamedTuple):
    """One dispatched kernel: its op, its matmul-type FLOPs (torch.utils.flop_counter's formulas; 0 for the
    element-wise and reduction ops, whose arithmetic is negligible beside their memory traffic) and the bytes it
    reads and writes, each input read once and each output written once (`footprint`)."""

    name: str
    flops: int
    bytes: int


def footprint(t: torch.Tensor) -> int:
    """Bytes of memory a tensor's elements occupy: a broadcast dimension (stride 0) reads the same memory again."""
    elements = 1
    for size, stride in zip(t.shape, t.stride()):
        elements *= size if stride else 1
    return elements * t.element_size()


# the FLOP formulas of torch.utils.flop_counter (on tensors), in-place matmuls included
FORMULAS = flop_registry | {op: shape_wrapper(formula) for op, formula in IN_PLACE_MATMULS.items()}


def _flops(func, args, kwargs, out) -> int:
    formula = FORMULAS.get(func.overloadpacket)
    return int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0


class KernelCount(TorchDispatchMode):
    """The kernel-launching ATen ops dispatched inside the block: by name (`counts`), and in order with their FLOPs
    and bytes (`kernels`)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.kernels: list[Kernel] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        if not view and name not in NO_KERNEL:
            self.counts[name] += 1
            inputs = {id(t): t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}  # each read once
            outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]  # in place: read, then written
            traffic = sum(map(footprint, inputs.values())) + sum(map(footprint, outputs))
            self.kernels.append(Kernel(name, _flops(func, args, kwargs, out), traffic))
        return out


class NoUpdate:
    """An optimiser that changes nothing: the engine's step then runs its forward and backward only."""

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def _dispatched(arch: str, method: str, E: int, **overrides) -> KernelCount:
    with shapes_only():  # built on the meta device, nothing drawn (seconds saved on 45 Transformers): shapes suffice
        model, _ = stacked_model(arch, method, E, "meta", **overrides)
    step = engine.make_step(model, NoUpdate())
    xb, yb = (t.to("meta") for t in batches(E, "cpu", n=1)[0])
    with KernelCount() as seen:
        step(xb, yb)
    return seen


def step_kernels(arch: str, method: str, E: int, **overrides) -> collections.Counter[str]:
    """Kernel-launching ops, by name, of the engine's training step (`engine.make_step`) without its update, for a
    stack of E members of `method` on `arch`, on the meta device. `overrides`: the method's config fields (e.g.
    n_blocks=2), as `models.stacked_model` takes them."""
    return _dispatched(arch, method, E, **overrides).counts


def step_traffic(arch: str, method: str, E: int, **overrides) -> list[Kernel]:
    """The same step's kernels in order, each with its FLOPs and bytes (`Kernel`)."""
    return _dispatched(arch, method, E, **overrides).kernels


def roofline_ms(kernels: list[Kernel], gflops: float, gbytes_per_s: float) -> float:
    """A floor for the step on a device whose matmuls run at `gflops` GFLOP/s and whose memory moves `gbytes_per_s`
    GB/s: each kernel takes at least its FLOPs at the one rate or its bytes at the other, whichever is longer (a
    roofline per kernel), one after another, and launching them costs nothing. The caches are ignored (each input
    comes from memory), so a kernel whose inputs the previous one left in cache can beat its floor a little."""
    return 1e3 * sum(max(k.flops / (gflops * 1e9), k.bytes / (gbytes_per_s * 1e9)) for k in kernels)
