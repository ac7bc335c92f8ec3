"""The captured-step cases of `qlbench bench`, each returning its rows: every trained method's step eager against
captured whole in a CUDA graph, with the CUDA kernels it executes (torch.profiler) and its roofline floor
(`capture`); and several methods' stacks trained at once, as `--methods-at-once` trains them (`at_once`).
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from qlbench import engine
from qlbench.bench.dispatch import roofline_ms, step_traffic
from qlbench.bench.models import batches, stacked_copies
from qlbench.bench.timing import Settings, alternate, chunk, median_ratio, sync, whole_periods
from qlbench.bench.training import evaluation_seconds, native_stderr_silenced, stack_row

# the float32 matmul precision of each variant's warm-up and recording: "high" lets cuBLAS use TF32 tensor cores (10
# explicit mantissa bits in the products, float32 sums). qlbench trains at "highest", PyTorch's default; the TF32
# variant only measures what that choice costs where the step is bound by its arithmetic (the Transformer at E = 45).
PRECISION = {"captured_tf32": "high"}


def capture_row(arch: str, method: str, E: int, s: Settings, device, rates: tuple[float, float] | None = None) -> dict:
    """CUDA only: the training step eager, captured whole in a CUDA graph (engine/step.py), captured with TF32
    matmuls (`PRECISION`) and, when the run compiles, compiled and compiled + captured, alternating (ms per step,
    speed-up against eager, the recording's warm-up); and the CUDA kernels each executes per step (torch.profiler),
    with µs per kernel of the captured step. Every variant trains its own copy of the same stack on the same
    batches; and one evaluation of the stack (the last variant's model), captured as a captured stage evaluates
    (`eval_s`, the estimate's) and eager (`eval_eager_s`). With `rates` (the run's matmul GFLOP/s and memory GB/s),
    the step's roofline floor (`dispatch.roofline_ms` over its kernels on the meta device; the optimiser's update
    not counted) and the captured step's share of it: near 1, the step runs as fast as its arithmetic and memory
    traffic allow; far below, launches or slow kernels take the rest (the top kernels name the slow ones).

    A variant's matmul precision is set while it warms up and records: a recording keeps the kernels chosen then,
    and every later step of the same batch shape replays them (`batches` are all one shape)."""
    variants = {"eager": dict(), "captured": dict(capture=True), "captured_tf32": dict(capture=True)}
    if s.compile:
        variants |= {"compiled": dict(compile=True), "compiled_captured": dict(compile=True, capture=True)}
    data, warmup = batches(E, device), {}
    stacks = stacked_copies(arch, method, E, device, len(variants))
    n = whole_periods(s.steps[arch], stacks[0][1])  # full-soap: whole periods of its refresh (replayed or eager)
    # every variant built before any warms up: building a compiled step resets torch._dynamo (engine.compiled), which
    # would drop an earlier variant's compiled forward (recompiled, then, inside the timed rounds)
    steps = {name: engine.make_step(m, opt, **how) for (name, how), (m, opt) in zip(variants.items(), stacks)}
    model = stacks[-1][0]  # the model whose evaluation is timed below
    try:
        for name, step in steps.items():
            sync(device)
            t0 = time.perf_counter()
            with matmul_precision(PRECISION.get(name, "highest")):
                chunk(step, data, engine.step.WARMUP + 2)()  # the warm-up steps, compilation and the recording
                sync(device)
            warmup[name] = time.perf_counter() - t0
        r = alternate({k: (chunk(fn, data, n), n) for k, fn in steps.items()}, s.rounds, device)
        ms = {k: 1e3 / statistics.median(v) for k, v in r.items()}
        kernels = {
            k: kernel_summary(profiled_kernels(steps[k], data, device), PROFILED_STEPS) for k in ("eager", "captured")
        }
    finally:  # the recordings released here, as a training stage releases them at its end (engine.fit)
        for step in steps.values():
            step.close()
        sync(device)
    floor = {}
    if rates is not None:
        floor["roofline_ms"] = roofline_ms(step_traffic(arch, method, E), *rates)
        floor["roofline_share"] = floor["roofline_ms"] / ms["captured"]
    return stack_row(
        arch,
        method,
        E,
        None,
        **{f"{k}_ms": v for k, v in ms.items()},
        **{f"{k}_speedup": median_ratio(r[k], r["eager"]) for k in r if k != "eager"},
        **{f"{k}_warmup_s": v for k, v in warmup.items() if k != "eager"},
        tf32_speedup=median_ratio(r["captured_tf32"], r["captured"]),  # the captured step, TF32 against float32
        eager_kernels=kernels["eager"]["kernels"],
        captured_kernels=kernels["captured"]["kernels"],
        captured_us_per_kernel=1e3 * ms["captured"] / kernels["captured"]["kernels"],
        # the device's own time in the captured step's kernels, and its share of the step: near 1, the step is bound
        # by what its kernels compute; far below, by launching them one after another
        captured_kernel_ms=kernels["captured"]["kernel_ms"],
        captured_busy=kernels["captured"]["kernel_ms"] / ms["captured"],
        captured_top_kernels=kernels["captured"]["top"],
        captured_rate=E * 1e3 / ms["captured"],  # model-steps/s, the paper estimate's rate on CUDA
        # one evaluation of this stack, captured as a captured stage evaluates (at E = 45 the estimate's: on a GPU
        # it grows with the members far less than linearly, as the step does), and eager
        eval_s=evaluation_seconds(model, E, None, s.rounds, device, captured=True),
        eval_eager_s=evaluation_seconds(model, E, None, s.rounds, device),
        **floor,
    )


# rounds per timed call of engine.concurrently in the at_once row, as multiples of the other rows' chunks: a run starts
# its threads and streams once and trains on them for its whole length, while each timed call here starts them anew.
# The GPU's --quick rows (4 rounds a call) ran slower at once, where the quick run itself ran faster (docs/speed.md)
AT_ONCE_CHUNK = 10


def at_once_row(arch: str, methods: list[str], E: int, width: int, s: Settings, device) -> dict:
    """`methods`' training steps, each its own stack of E members, as `--methods-at-once` trains them (captured on
    CUDA; eager on the CPU, with the stack's intra-op threads): a round, one step of each method, timed one method
    after another (each method's steps, then the next's, as one method at a time trains) and `width` at a time,
    each in its own thread and, on CUDA, its own stream (`engine.concurrently`, the engine's own mechanism),
    alternating; ms per round and the speed-up, which the paper-table estimate applies to the adapted methods
    (`at_once`)."""
    data, threads = batches(E, device), s.threads_for(arch, E, device)
    steps, optimizers = [], []
    try:
        for m in methods:
            ((model, opt),) = stacked_copies(arch, m, E, device, 1)
            steps.append(engine.make_step(model, opt, capture=torch.device(device).type == "cuda"))
            optimizers.append(opt)
            chunk(steps[-1], data, engine.step.WARMUP + 2, threads)()  # the warm-up steps (and the recording)
        sync(device)
        n = whole_periods(s.steps[arch] * AT_ONCE_CHUNK, *optimizers)  # full-soap: whole periods of its refresh
        chunks = [chunk(step, data, n, threads) for step in steps]  # each: n steps of its method

        def one_after_another() -> None:
            for run in chunks:
                run()

        at_once = lambda: engine.concurrently(chunks, width, device)
        r = alternate({"one_after_another": (one_after_another, n), "at_once": (at_once, n)}, s.rounds, device)
    finally:  # the recordings released, as a training stage releases them
        for step in steps:
            step.close()
        sync(device)
    return stack_row(
        arch,
        None,
        E,
        threads,
        methods=list(methods),
        width=width,
        one_after_another_ms=1e3 / statistics.median(r["one_after_another"]),
        at_once_ms=1e3 / statistics.median(r["at_once"]),
        at_once_speedup=median_ratio(r["at_once"], r["one_after_another"]),
    )


@contextlib.contextmanager
def matmul_precision(precision: str):
    """torch.set_float32_matmul_precision inside the block, restored after."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


PROFILED_STEPS = 3  # steps of a capture row's step profiled for its CUDA kernels
TOP_KERNELS = 5  # the kernels a capture row names, by their device time per step


def profiled_kernels(step, data, device, n: int = PROFILED_STEPS) -> list[tuple[str, float]]:
    """(name, device µs) of every CUDA kernel executed over n profiled steps (torch.profiler's CUDA activity; memory
    copies and sets left out)."""
    with native_stderr_silenced(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        chunk(step, data, n)()
        sync(device)
    kinds = ("memcpy", "memset")
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [(e.name, e.time_range.elapsed_us()) for e in kernels if not any(k in e.name.lower() for k in kinds)]


def kernel_summary(kernels: list[tuple[str, float]], steps: int, top: int = TOP_KERNELS) -> dict:
    """Per step, of the (name, device µs) kernels profiled over `steps` steps: how many (`kernels`), their device
    time in ms (`kernel_ms`), and the `top` names by device time (`top`: each name's launches and µs per step, and
    its share of the kernels' device time)."""
    launches, device_us = collections.Counter(), collections.Counter()
    for name, us in kernels:
        launches[name] += 1
        device_us[name] += us
    total_us = sum(device_us.values())
    return dict(
        kernels=len(kernels) / steps,
        kernel_ms=total_us / steps / 1e3,
        top=[
            dict(
                kernel=name,
                per_step=launches[name] / steps,
                us_per_step=us / steps,
                share=us / total_us if total_us else 0.0,
            )
            for name, us in device_us.most_common(top)
        ],
    )
