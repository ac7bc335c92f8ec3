"""Timing primitives of `qlbench bench`: how much to measure (`Settings`), rounds in which the compared variants
take turns (`alternate`) and their paired ratios, timed chunks of steps, the machine's matmul peak and memory
bandwidth, and FLOP counts of one real step or forward."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode, bmm_flop, mm_flop

from qlbench import engine
from qlbench.soap import StackedSoap

BATCH = 64

# torch.utils.flop_counter has formulas for out-of-place matmuls only, so an in-place one would add no FLOPs to a
# count: Queryable LoRA's eager layer adds its low-rank product with baddbmm_ (adapters/queryable.py). Their formulas,
# on shapes, as the counter's custom_mapping takes them (bench.dispatch uses them too)
IN_PLACE_MATMULS = {
    torch.ops.aten.baddbmm_: lambda self, a, b, *args, out_shape=None, **kwargs: bmm_flop(a, b),
    torch.ops.aten.addmm_: lambda self, a, b, *args, out_shape=None, **kwargs: mm_flop(a, b),
}


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@dataclass
class Settings:
    """How much to measure. `quick` (for CI) runs the same code paths with fewer steps and members."""

    steps: dict[str, int]  # timed steps per round, per arch
    rounds: int  # alternating rounds; medians are reported
    members: tuple[int, ...]  # stacked sizes E
    forward_reps: int
    inference_rounds: int  # more rounds than training: a round of nine models' forwards is short
    compile: bool  # also measure the torch.compile path (warm-up included)
    threads: int | None = None  # intra-op threads of every stacked measurement (None: engine.auto_threads)
    side_by_side_s: float = 8.0  # seconds per timed window of `side_by_side`

    @classmethod
    def make(cls, quick: bool, threads: int | None = None, compile: bool | None = None) -> Settings:
        """The quick or the full settings; `compile` (None: the full run's only) whether the torch.compile variants
        are measured too."""
        compile = not quick if compile is None else compile
        if quick:
            return cls({"deep-narrow": 4, "transformer": 1}, 2, (5,), 3, 2, compile, threads)
        return cls({"deep-narrow": 40, "transformer": 3}, 3, (5, 45), 20, 9, compile, threads)

    def threads_for(self, arch: str, E: int, device) -> int | None:
        """Intra-op threads of a stack of E members: `threads` if set, else the engine's choice (CPU only)."""
        if torch.device(device).type != "cpu":
            return None
        return engine.auto_threads(arch, E, self.threads)

    def side_by_side_for(self, arch: str, E: int) -> tuple[int, int]:
        """(threads, workers) of `side_by_side` on this CPU: the stack's intra-op threads and how many such stacks
        fit on the machine at once (cpu_count // threads)."""
        threads = self.threads_for(arch, E, "cpu") or torch.get_num_threads()
        return threads, (os.cpu_count() or 1) // threads


def alternate(fns: dict[str, tuple[Callable, int]], rounds: int, device) -> dict[str, list[float]]:
    """Rates (units/s) of each fn per round, the fns taking turns within every round; fn() runs one timed chunk
    and the int is the units (model-steps, samples) it processes."""
    rates = {k: [] for k in fns}
    for _ in range(rounds):
        for name, (fn, units) in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            rates[name].append(units / (time.perf_counter() - t0))
    return rates


def median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


def whole_periods(n: int, *optimizers) -> int:
    """n timed steps rounded up to whole periods of the optimisers' periodic work: StackedSoap (full-soap) refreshes
    its eigenbases every `frequency` steps (eagerly, or on CUDA replayed from a recording of its own), so a timed
    chunk shorter than that holds a refresh in some rounds and none in others, and its rate leaves the refresh out
    or counts it several times over (docs/speed.md has the measured gap on a GPU). Every run of `period` consecutive
    steps holds exactly one refresh."""
    period = math.lcm(1, *(o.frequency for o in optimizers if isinstance(o, StackedSoap)))
    return -(-n // period) * period


def chunk(step, data, n, threads: int | None = None):
    """n steps over `data` with `threads` intra-op threads (None: PyTorch's default)."""

    def run():
        with engine.num_threads(threads):
            for i in range(n):
                step(*data[i % len(data)])

    return run


def best_rate(run: Callable[[], None], units: float, trials: int, device) -> float:
    """Units per second of run() (`units` its work), the best of `trials` timings after one untimed call: the best,
    since on a shared machine a slow sample measures the neighbours."""
    run()
    best = 0.0
    for _ in range(trials):
        sync(device)
        t0 = time.perf_counter()
        run()
        sync(device)
        best = max(best, units / (time.perf_counter() - t0))
    return best


def matmul_peak(device, n: int = 2048, reps: int = 3, trials: int = 5) -> float:
    """GFLOP/s of a large float32 matmul, the best of `trials` timings of `reps` products (the dense peak the
    engine is compared with)."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)

    def products() -> None:
        for _ in range(reps):
            a @ b

    return best_rate(products, 2 * n**3 * reps / 1e9, trials, device)


def memory_bandwidth(device, megabytes: int = 256, reps: int = 4, trials: int = 5) -> float:
    """GB/s of a large float32 copy on the device, each byte read once and written once, the best of `trials`
    timings of `reps` copies (the memory rate of the roofline floor, `dispatch.roofline_ms`)."""
    a = torch.ones(megabytes * 2**20 // 4, device=device)
    b = torch.empty_like(a)

    def copies() -> None:
        for _ in range(reps):
            b.copy_(a)

    return best_rate(copies, 2 * a.numel() * a.element_size() * reps / 1e9, trials, device)


def step_flops(model, step, data) -> int:
    """FLOPs (matmul-type ops, forward + backward) of one training step, counted on the real step."""
    with FlopCounterMode(display=False, custom_mapping=IN_PLACE_MATMULS) as counter:
        step(*data[0])
    return counter.get_total_flops()


def forward_flops(model, x) -> int:
    """FLOPs of one forward (counted with autograd on: the counter's module hooks need it; nothing is
    backpropagated)."""
    with FlopCounterMode(display=False, custom_mapping=IN_PLACE_MATMULS) as counter:
        model(x)
    return counter.get_total_flops()
