"""Kernels per training step, counted without a GPU: the ATen ops a stack's forward and backward dispatch on
PyTorch's meta device (shapes only, no arithmetic).

On CUDA a step captured in a CUDA graph costs about 2 to 3 µs per kernel on the deep-narrow backbone (docs/speed.md),
so the kernel count is what a change to a method's layers moves. The meta device runs the code a CUDA device runs
where the two differ from the CPU's (`stacked.memberwise` pads on the CPU only), and each dispatched op is counted
as one kernel (a few launch two on CUDA, e.g. a baddbmm's copy of its input): views and allocations are left out,
as they launch none. The step is the
engine's, its loss included; not counted: the optimiser's update (on CUDA one fused AdamW kernel, or full-soap's
eager SOAP step). An estimate of torch.profiler's CUDA count (`cases.capture_row`): on an NVIDIA H200 the profiler
counted 369 kernels for deep-narrow LoRA's whole step and 1,396 for Queryable LoRA's, where this count gives 332 and
1,473 for the same code (docs/speed.md).
"""

from __future__ import annotations

import collections

from torch.utils._python_dispatch import TorchDispatchMode

from qlbench import engine
from qlbench.bench.models import batches, stacked_model

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


class KernelCount(TorchDispatchMode):
    """The kernel-launching ATen ops dispatched inside the block, by name (`counts`)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        if not view and name not in NO_KERNEL:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


class NoUpdate:
    """An optimiser that changes nothing: the engine's step then runs its forward and backward only."""

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def step_kernels(arch: str, method: str, E: int, **overrides) -> collections.Counter[str]:
    """Kernel-launching ops, by name, of the engine's training step (`engine.make_step`) without its update, for a
    stack of E members of `method` on `arch`, on the meta device. `overrides`: the method's config fields (e.g.
    n_blocks=2), as `models.stacked_model` takes them."""
    model, _ = stacked_model(arch, method, E, "cpu", **overrides)
    model.to("meta")
    step = engine.make_step(model, NoUpdate())
    xb, yb = (t.to("meta") for t in batches(E, "cpu", n=1)[0])
    with KernelCount() as seen:
        step(xb, yb)
    return seen.counts
