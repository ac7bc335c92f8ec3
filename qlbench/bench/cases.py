"""The measured cases of `qlbench bench`, each returning its rows: the plain PyTorch loop against the per-seed loop,
the stacked engine and the kernel floor; every method's throughput; Queryable LoRA's overhead against LoRA; a
profile of one step; torch.compile against eager; inference; full-soap's optimizer step; a suite stage's step
against a single-task one; and `run`, which takes them in order (`tasks`) and adds the peak and the paper-table
estimate.

Over 500 lines: one function per measured case, kept together so that `tasks` reads as the benchmark's contents.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

from qlbench import adapters, engine, multitask, pareto_stack, results, soap, suites, zoo
from qlbench.bench.dispatch import roofline_ms, step_traffic
from qlbench.bench.estimate import paper_estimate
from qlbench.bench.members import member_rows
from qlbench.bench.models import (
    PRETRAINING,
    batches,
    hf_step,
    lora_floor_step,
    plain_deep_narrow_lora,
    plain_step,
    stacked_copies,
    stacked_model,
)
from qlbench.bench.parallel import side_by_side
from qlbench.bench.timing import (
    BATCH,
    Settings,
    alternate,
    chunk,
    forward_flops,
    matmul_peak,
    median_ratio,
    memory_bandwidth,
    step_flops,
    sync,
    whole_periods,
)
from qlbench.engine import snapshot
from qlbench.engine.step import first_line
from qlbench.progress import bar as progress_bar


def stack_row(arch: str, method: str | None, E: int, threads: int | None, **fields) -> dict:
    """A measured stack's row: what names the stack (arch, method unless None, E as `members`, the intra-op threads
    it ran with) and then `fields`."""
    row = dict(arch=arch, method=method, members=E, threads=threads or torch.get_num_threads())
    return ({k: v for k, v in row.items() if v is not None}) | fields


def throughput(arch: str, method: str, E: int, s: Settings, device) -> dict:
    """The stacked engine at E members (with the engine's thread setting) against the per-seed loop: the same
    modules and step, one member at a time, with PyTorch's default threads."""
    model, opt = stacked_model(arch, method, E, device)
    n = whole_periods(s.steps[arch], opt)  # full-soap: whole periods of its refresh
    step, data = engine.make_step(model, opt), batches(E, device)
    seed_model, seed_opt = stacked_model(arch, method, 1, device)
    per_seed, seed_data = engine.make_step(seed_model, seed_opt), batches(1, device)
    threads = s.threads_for(arch, E, device)
    for fn, d in ((step, data), (per_seed, seed_data)):
        chunk(fn, d, 2)()  # warm-up (SOAP's first step only builds its basis)
    with engine.num_threads(1):  # counting FLOPs is not timed
        flops = step_flops(model, step, data)
    r = alternate(
        {"stacked": (chunk(step, data, n, threads), E * n), "per_seed": (chunk(per_seed, seed_data, n), n)},
        s.rounds,
        device,
    )
    stacked = statistics.median(r["stacked"])
    return stack_row(
        arch,
        method,
        E,
        threads,
        stacked=stacked,
        eval_s=evaluation_seconds(model, E, threads, s.rounds, device),
        per_seed=statistics.median(r["per_seed"]),
        speedup=median_ratio(r["stacked"], r["per_seed"]),
        step_gflop=flops / 1e9,
        gflops=flops / 1e9 * stacked / E,
    )


def evaluation_seconds(model, E: int, threads, rounds: int, device, captured: bool = False) -> float:
    """Median seconds of one evaluation as the engine runs it every `eval_every` epochs: train and test MSE of all
    E members on the target's 400 + 800 samples (zoo.TARGET_TRAIN of zoo.TARGET_SIZE); `captured`: each set's
    evaluation recorded and replayed (engine.CapturedEvaluation, as a captured stage evaluates; CUDA)."""
    g = torch.Generator().manual_seed(1)
    x = torch.rand(E, zoo.TARGET_SIZE, 2, generator=g).to(device)
    y = torch.rand(E, x.shape[1], generator=g).to(device)
    T = zoo.TARGET_TRAIN
    sets = [lambda: engine.evaluate(model, x[:, :T], y[:, :T]), lambda: engine.evaluate(model, x[:, T:], y[:, T:])]
    if captured:
        sets = [engine.CapturedEvaluation(fn, torch.device(device)) for fn in sets]
        for fn in sets:
            fn(), fn()  # the ordinary evaluation before the recording, and the recording
    times = []
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad(), engine.num_threads(threads):
            for fn in sets:
                fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    if captured:
        for fn in sets:
            fn.close()
    return statistics.median(times)


def overhead(arch: str, E: int, s: Settings, device) -> dict:
    """Queryable LoRA's training-step and forward cost against LoRA's, alternating the two; with `s.compile` also
    the compiled training steps and compiled forwards of both, the arms of each taking turns in the same rounds."""
    n = s.steps[arch]
    out = dict(arch=arch, members=E)
    threads = s.threads_for(arch, E, device)
    variants = [("lora", False), ("queryable", False)]
    compiled_pair = ("lora", "queryable") if s.compile else ()  # the paper budget compiles both backbones
    variants += [(m, True) for m in compiled_pair]
    steps, fwds, eager_models = {}, {}, {}
    x = batches(E, device)[0][0]

    def forward(model):
        def run():
            with torch.no_grad(), engine.num_threads(threads):
                for _ in range(s.forward_reps):
                    model(x)

        return run, E * BATCH * s.forward_reps

    for m, comp in variants:
        model, opt = stacked_model(arch, m, E, device)
        data = batches(E, device)
        steps[m + "_compiled" * comp] = (chunk(engine.make_step(model, opt, compile=comp), data, n, threads), E * n)
        if not comp:
            eager_models[m] = model
            fwds[m] = forward(model)
    fwds |= {f"{m}_compiled": forward(engine.compiled(eager_models[m])) for m in compiled_pair}  # no-grad forwards
    for fn, _ in (steps | fwds).values():  # warm-up, compilation included
        fn()
    r = alternate(steps, s.rounds, device)
    out["train_step_overhead_pct"] = (median_ratio(r["lora"], r["queryable"]) - 1) * 100
    if "lora_compiled" in r:
        out["compiled_train_step_overhead_pct"] = (median_ratio(r["lora_compiled"], r["queryable_compiled"]) - 1) * 100
    r = alternate(fwds, s.rounds, device)
    out["forward_overhead_pct"] = (median_ratio(r["lora"], r["queryable"]) - 1) * 100
    if "lora_compiled" in r:
        out["compiled_forward_overhead_pct"] = (median_ratio(r["lora_compiled"], r["queryable_compiled"]) - 1) * 100
    return out


def compile_row(arch: str, method: str, E: int, s: Settings, device) -> dict:
    """torch.compile against eager for one stack, alternating: the step `--compile on` runs (the forward compiled,
    and the optimiser's update where that pays, engine/step.py), its forward alone compiled (the compiled step
    before the update was compiled too) and eager; the warm-up (compilation) of the first and the steady rates."""
    variants = {
        "eager": dict(),
        "compiled": dict(compile=True),
        "compiled_forward": dict(compile=True, compile_update=False),
    }
    data, threads = batches(E, device), s.threads_for(arch, E, device)
    # every variant built before any compiles: building a compiled step resets torch._dynamo (engine.compiled), which
    # drops what was compiled before, so a variant warmed up in between would compile again inside the timed rounds
    stacks = stacked_copies(arch, method, E, device, len(variants))
    steps = {name: engine.make_step(model, opt, **how) for (name, how), (model, opt) in zip(variants.items(), stacks)}
    n = whole_periods(s.steps[arch], stacks[0][1])  # full-soap: whole periods of its refresh
    for name, step in steps.items():
        t0 = time.perf_counter()
        chunk(step, data, 2, threads)()  # compiles (one batch shape)
        if name == "compiled":
            warmup = time.perf_counter() - t0
    r = alternate({k: (chunk(fn, data, n, threads), E * n) for k, fn in steps.items()}, s.rounds, device)
    return stack_row(
        arch,
        method,
        E,
        threads,
        warmup_s=warmup,
        **{k: statistics.median(v) for k, v in r.items()},
        speedup=median_ratio(r["compiled"], r["eager"]),
        update_speedup=median_ratio(r["compiled"], r["compiled_forward"]),
    )


PAPER_MEMBERS = 45  # a method's members in the paper table (9 functions x 5 seeds): one stack on a GPU


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
# The H200's --quick rows (4 rounds a call) ran slower at once, where the quick run itself ran faster (docs/speed.md)
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


def dispatch_rows(arch: str, methods: list[str], E: int) -> list[dict]:
    """Kernels per training step's forward and backward, counted without a GPU (`dispatch.step_traffic`: the meta
    device), per trained method, with its ratio to LoRA's where LoRA is among them, and the step's matmul GFLOP and
    the GB its kernels read and write. The same on every machine."""
    traffic = {m: step_traffic(arch, m, E) for m in methods}
    lora = len(traffic["lora"]) if "lora" in traffic else None
    return [
        dict(
            arch=arch,
            method=m,
            members=E,
            kernels=len(kernels),
            gflop=sum(k.flops for k in kernels) / 1e9,
            gbyte=sum(k.bytes for k in kernels) / 1e9,
        )
        | ({"vs_lora": len(kernels) / lora} if lora else {})
        for m, kernels in traffic.items()
    ]


@contextlib.contextmanager
def matmul_precision(precision: str):
    """torch.set_float32_matmul_precision inside the block, restored after."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def hf_rows(s: Settings, device) -> list[dict]:
    """The peft tuner (qlbench.hf) against peft's LoRA on the same model: the causal-LM experiment's decoder
    (qlbench/real_lm.py, 2 layers, width 64) with each adapter on q_proj and v_proj, one training step
    (`models.hf_step`) on a batch of 32 sequences of 13 tokens, alternating; ms per step and the ratio to LoRA's.
    None without the hf extra, or without the instruction encoder (its sentence is not in the packaged table; the
    rows are then skipped with a line on stderr, as the other measurements do not need it)."""
    try:
        import peft  # noqa: F401
    except ImportError:
        return []
    from qlbench.instructions import EncoderUnavailable

    try:
        steps = {m: hf_step(m, device) for m in ("lora", "queryable", "instruct-queryable")}
    except EncoderUnavailable as err:
        print(f"qlbench bench: the peft tuner rows are skipped: {err}", file=sys.stderr)
        return []
    for step in steps.values():
        step(), step()  # warm-up
    n = max(2, s.steps["deep-narrow"] // 2)
    r = alternate({m: (lambda fn=fn: [fn() for _ in range(n)], n) for m, fn in steps.items()}, s.rounds, device)
    return [
        dict(
            model="tiny decoder (real-lm)",
            method=m,
            ms_per_step=1e3 / statistics.median(v),
            vs_lora=median_ratio(r["lora"], v),
        )  # fmt: skip
        for m, v in r.items()
    ]


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


def plain_loop(s: Settings, device) -> dict:
    """The plain PyTorch deep-narrow LoRA loop a user would write (PyTorch's default threads, and one thread), next
    to qlbench's per-seed loop (E = 1, default threads), the stacked engine at each E of the run (its own thread
    setting), eager and, with `s.compile`, compiled as the paper budget runs it on CPU, and at each E the kernel
    floor (`lora_floor_step`: the same step's kernels alone, compiled with `s.compile`); all taking turns."""
    n = s.steps["deep-narrow"]
    plain, opt = plain_deep_narrow_lora()
    pstep = plain_step(plain.to(device), opt)
    model, qopt = stacked_model("deep-narrow", "lora", 1, device)
    qstep = engine.make_step(model, qopt)
    data = batches(1, device)
    fns = {
        "plain": (chunk(pstep, data, n), n),
        "plain_1_thread": (chunk(pstep, data, n, 1), n),
        "per_seed": (chunk(qstep, data, n), n),
    }
    for E in s.members:
        threads = s.threads_for("deep-narrow", E, device)
        for comp in (False, True) if s.compile else (False,):
            stack, sopt = stacked_model("deep-narrow", "lora", E, device)
            step = engine.make_step(stack, sopt, compile=comp)
            fns[f"stacked_e{E}" + "_compiled" * comp] = (chunk(step, batches(E, device), n, threads), E * n)
        floor = lora_floor_step(*stacked_model("deep-narrow", "lora", E, device), compile=s.compile)
        fns[f"floor_e{E}"] = (chunk(floor, batches(E, device), n, threads), E * n)
    for fn, _ in fns.values():  # warm-up (compilation included, after every arm is built)
        fn()
    r = alternate(fns, s.rounds, device)
    out = {k: statistics.median(v) for k, v in r.items()}
    for k in fns:
        if k.startswith(("stacked_", "floor_")):
            out[f"{k}_vs_plain"] = median_ratio(r[k], r["plain"])
    return out


@contextlib.contextmanager
def native_stderr_silenced():
    """Send file descriptor 2 to /dev/null inside the block: the profiler's native library prints two "USDT: ...
    profiler_start/stop" lines per use that a Python-level redirect cannot catch."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


MATMUL_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm")


def profile_row(arch: str, method: str, E: int, s: Settings, device) -> dict:
    """Where a training step's time goes (torch.profiler over a few steps): the number of ATen ops dispatched per
    step, the step's wall time (timed without the profiler), and the shares of the profiled steps' wall time spent
    inside matmul kernels and in GELU forward/backward (the same steps, so a slow spell of a shared machine between
    two timings cannot push a share past 1; the profiler's own overhead makes them slight underestimates). Many tiny
    ops and a small matmul share mean the step is bound by per-op dispatch and element-wise work, not by arithmetic
    the matmul peak measures."""
    n = max(2, s.steps[arch] // 4)
    model, opt = stacked_model(arch, method, E, device)
    step, data = engine.make_step(model, opt), batches(E, device)
    threads = s.threads_for(arch, E, device)
    chunk(step, data, 2, threads)()
    sync(device)
    t0 = time.perf_counter()
    chunk(step, data, n, threads)()  # wall time without the profiler's own overhead
    sync(device)
    wall = (time.perf_counter() - t0) / n
    with native_stderr_silenced(), profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        chunk(step, data, n, threads)()
        sync(device)
        profiled = (time.perf_counter() - t0) / n  # the shares' denominator: the same steps the ops were timed in
    events = prof.key_averages()
    # top-level ATen calls only would need the call tree; count every ATen op (nested ones included) and the
    # self time of the matmul kernels, which is where the arithmetic happens
    ops = sum(e.count for e in events if e.key.startswith("aten::")) / n
    matmul = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS) / 1e6 / n
    gelu = sum(e.self_cpu_time_total for e in events if e.key in ("aten::gelu", "aten::gelu_backward")) / 1e6 / n
    return stack_row(
        arch,
        method,
        E,
        threads,
        step_ms=1e3 * wall,
        aten_ops=ops,
        matmul_share=matmul / profiled,
        gelu_share=gelu / profiled,
        us_per_op=1e6 * wall / ops,
    )


# methods whose inference forward is also timed compiled when the run compiles: LoRA (what the overhead columns
# compare with) and the routed methods
COMPILED_FORWARDS = ("lora", *adapters.of_kind("routed"))


def inference(arch: str, methods: list[str], s: Settings, device) -> list[dict]:
    """Forward latency of one model at batch 64 (no grad), every method taking turns in each round; with `s.compile`
    also the compiled forwards of COMPILED_FORWARDS, in the same rounds."""
    x = batches(1, device, n=1)[0][0]
    models = {m: stacked_model(arch, m, 1, device)[0].eval() for m in methods}
    threads = s.threads_for(arch, 1, device)

    def forward(model):
        def run():
            with torch.no_grad(), engine.num_threads(threads):
                for _ in range(s.forward_reps):
                    model(x)

        return run

    fns = {m: (forward(model), s.forward_reps) for m, model in models.items()}
    compiled = [m for m in COMPILED_FORWARDS if m in models] if s.compile else []
    fns |= {f"{m}_compiled": (forward(engine.compiled(models[m])), s.forward_reps) for m in compiled}
    for fn, _ in fns.values():
        fn()  # warm-up, compilation included
    r = alternate(fns, s.inference_rounds, device)  # forwards per second
    with engine.num_threads(1):
        flops = {m: forward_flops(model, x) for m, model in models.items()}
    rows = []
    for m in models:
        row = dict(
            arch=arch,
            method=m,
            latency_ms=1e3 / statistics.median(r[m]),
            samples_per_s=BATCH * statistics.median(r[m]),
            gflop=flops[m] / 1e9,
        )
        if "lora" in models:
            row["latency_overhead_pct"] = (median_ratio(r["lora"], r[m]) - 1) * 100
            row["flop_overhead_pct"] = (flops[m] / flops["lora"] - 1) * 100
        if m in compiled:
            row["compiled_latency_ms"] = 1e3 / statistics.median(r[f"{m}_compiled"])
            if "lora" in compiled:
                row["compiled_latency_overhead_pct"] = (median_ratio(r["lora_compiled"], r[f"{m}_compiled"]) - 1) * 100
        rows.append(row)
    return rows


def soap_row(arch: str, E: int, s: Settings, device) -> dict:
    """`full-soap`'s optimizer step alone: the batched StackedSoap against pytorch_optimizer.SOAP stepped once per
    member over aliases of the member's slices (what full-soap did before), on the backbone's parameters with
    fixed random gradients, alternating; optimizer steps per second of the whole stack, over whole periods of its
    eigenbases' refresh; and that refresh alone (`StackedSoap.refresh`, every `precondition_frequency` steps, eager
    where the step is not captured), with its share of the batched step's time; where the refresh's small QRs take
    the batched Householder reflections (off the CPU, `soap.householder_q`), also the same refresh with
    torch.linalg.qr at every size, as before, side by side; and on CUDA, where the refresh is device work alone
    (`refresh_recordable`), the refresh replayed from a CUDA graph, as a captured full-soap stage runs it
    (engine/step.py `CapturedRefresh`)."""
    from pytorch_optimizer import SOAP  # here, not at the top: importing pytorch_optimizer takes seconds

    threads = s.threads_for(arch, E, device)
    model, batched = stacked_model(arch, "full-soap", E, device)
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator(device=device).manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, device=device, dtype=p.dtype) * 1e-3
    aliases = [[nn.Parameter(p.data[e]) for p in params] for e in range(E)]  # views: SOAP updates in place
    per_member = [SOAP(a, lr=5e-4, weight_decay=0.01) for a in aliases]

    def loop():  # as full-soap stepped before StackedSoap: each member's gradient slices, then its own SOAP
        for e, (opt, members) in enumerate(zip(per_member, aliases)):
            for alias, p in zip(members, params):
                alias.grad = p.grad[e]
            opt.step()

    n = whole_periods(max(2, s.steps[arch] // 4), batched)
    for _ in range(2):  # past SOAP's initialising first step
        batched.step()
        loop()
    no_data = [()]  # the optimizer steps take no batch
    timed = {
        "batched": (chunk(batched.step, no_data, n, threads), n),
        "per-member": (chunk(loop, no_data, n, threads), n),
        "refresh": (chunk(batched.refresh, no_data, 1, threads), 1),
    }
    if torch.device(device).type not in soap.LAPACK_QR_DEVICES:
        timed["refresh_lapack"] = (chunk(lambda: batched.refresh(lapack_qr=True), no_data, 1, threads), 1)
    recorded = None
    if batched.refresh_recordable():  # CUDA on deep-narrow: as a captured full-soap stage runs it
        recorded = engine.step.CapturedRefresh(batched, engine.step.RECORDER(device))
        for _ in range(engine.step.REFRESH_WARMUP + 1):  # its eager refreshes, then the recording and a replay
            recorded.refresh()
        timed["refresh_recorded"] = (chunk(recorded.refresh, no_data, 1, threads), 1)
    try:
        r = alternate(timed, s.rounds, device)
    finally:
        if recorded is not None:
            recorded.close()
    batched_ms = 1e3 / statistics.median(r["batched"])
    refresh_ms = 1e3 / statistics.median(r["refresh"])
    return stack_row(
        arch,
        None,
        E,
        threads,
        batched_ms=batched_ms,
        per_member_ms=1e3 / statistics.median(r["per-member"]),
        speedup=median_ratio(r["batched"], r["per-member"]),
        refresh_ms=refresh_ms,
        refresh_share=refresh_ms / batched.frequency / batched_ms,  # of a step, one refresh per `frequency` steps
        **({"refresh_lapack_ms": 1e3 / statistics.median(r["refresh_lapack"])} if "refresh_lapack" in r else {}),
        **({"refresh_recorded_ms": 1e3 / statistics.median(r["refresh_recorded"])} if recorded is not None else {}),
    )


def padding_row(arch: str, method: str, s: Settings, device) -> dict:
    """What stack independence costs (engine.MIN_STACK): a one-member cell trains as a stack of two, itself and a
    copy. The training step of that padded stack against the unpadded one-member stack it replaces (same thread
    setting, alternating); only one-member stacks pay it (one seed of one function, or a Ray group of one)."""
    threads = s.threads_for(arch, 1, device)
    n = s.steps[arch]
    steps = {}
    for E in (1, engine.MIN_STACK):
        model, opt = stacked_model(arch, method, E, device)
        steps[E] = (engine.make_step(model, opt), batches(E, device))
        chunk(*steps[E], 2)()  # warm-up
    r = alternate(
        {"alone": (chunk(*steps[1], n, threads), n), "padded": (chunk(*steps[engine.MIN_STACK], n, threads), n)},
        s.rounds,
        device,
    )
    return stack_row(
        arch,
        method,
        1,
        threads,
        alone_ms=1e3 / statistics.median(r["alone"]),
        padded_ms=1e3 / statistics.median(r["padded"]),
        cost=median_ratio(r["alone"], r["padded"]),
    )


def snapshot_row(arch: str, method: str, E: int, s: Settings, device) -> dict:
    """What a stack's snapshot costs (engine/snapshot.py): its size, the time to save it (`Snapshots.save`, atomic,
    into a temporary folder) and to read it back, after a few training steps (so the optimiser holds its state);
    its cost in training steps (the save against the stack's step time, alternating) and its share of the training
    time at the default interval (a save every engine.SNAPSHOT_EVERY_S seconds, or further apart where a save is
    slow: `snapshot.gap`)."""
    import tempfile

    from qlbench.engine.loop import training_state

    threads = s.threads_for(arch, E, device)
    model, opt = stacked_model(arch, method, E, device)
    step, data = engine.make_step(model, opt), batches(E, device)
    chunk(step, data, 2, threads)()  # full-soap's first step only initialises its state: two steps
    order = [torch.Generator().manual_seed(e) for e in range(E)]
    history = {"epochs": [], "train": [], "test": [], "diverged": [None] * E, "initial": [], "grads": []}
    state = training_state(0, 0.0, model, opt, order, history)
    with tempfile.TemporaryDirectory() as folder:
        snaps = engine.Snapshots(Path(folder) / "s.pt", "bench", every_s=0.0)
        n = s.steps[arch]
        save = chunk(lambda: snaps.save(state), [()], 1, threads)
        r = alternate({"save": (save, 1), "step": (chunk(step, data, n, threads), n)}, s.rounds, device)
        size = snaps.path.stat().st_size
        t0 = time.perf_counter()
        snaps.load(device)
        sync(device)
        load_s = time.perf_counter() - t0
    save_s = 1 / statistics.median(r["save"])
    step_ms = 1e3 / statistics.median(r["step"])
    return stack_row(
        arch,
        method,
        E,
        threads,
        snapshot_mb=size / 2**20,
        save_s=save_s,
        load_s=load_s,
        step_ms=step_ms,
        save_in_steps=1e3 * save_s / step_ms,
        share_at_default=save_s / (snapshot.gap(engine.SNAPSHOT_EVERY_S, save_s) + save_s),
    )


PARETO_KS = (1, 2, 4)  # the k of one (r, M) of a Pareto grid (the paper's k <= M = 4)


def pareto_stack_row(arch: str, method: str, s: Settings, device) -> dict:
    """A Pareto grid's points that differ in k alone (qlbench/pareto_stack.py): one stack of the P points' E members
    each, every member with its k, against the P stacks of E that a grid trained point by point runs one after
    another (each with its engine thread setting, alternating); model-steps/s of both and the speed-up."""
    E, n, P = min(s.members), s.steps[arch], len(PARETO_KS)
    size = dict(n_atoms=max(PARETO_KS), n_experts=max(PARETO_KS))
    alone = []
    for k in PARETO_KS:
        model, opt = stacked_model(arch, method, E, device, top_k=k, **size)
        alone.append((engine.make_step(model, opt), batches(E, device)))
    model, opt = stacked_model(arch, method, P * E, device, top_k=max(PARETO_KS), **size)
    pareto_stack.member_top_k(model, tuple(k for k in PARETO_KS for _ in range(E)))
    stacked = (engine.make_step(model, opt), batches(P * E, device))
    points = [chunk(step, data, n, s.threads_for(arch, E, device)) for step, data in alone]
    for fn in (*points, chunk(*stacked, 2)):
        fn()  # warm-up
    r = alternate(
        {
            "alone": (lambda: [fn() for fn in points], P * E * n),
            "stacked": (chunk(*stacked, n, s.threads_for(arch, P * E, device)), P * E * n),
        },
        s.rounds,
        device,
    )
    return stack_row(
        arch,
        method,
        E,
        s.threads_for(arch, P * E, device),
        points=P,
        alone=statistics.median(r["alone"]),
        stacked=statistics.median(r["stacked"]),
        speedup=median_ratio(r["stacked"], r["alone"]),
    )


# the suite rows: the static baseline, the task controls, the routed methods over shared atoms
SUITE_METHODS = (adapters.BASELINE, *adapters.of_kind("task"), *adapters.of_family("queryable"))
SUITE = "zoo-4"  # its four sentences for the instruction table; the timing does not depend on the suite's data


def suite_row(arch: str, method: str, E: int, s: Settings, device) -> dict:
    """A suite stage's training step against a single-task step of the same size (same method, batch, members and
    thread setting, alternating): the batch mixes the suite's T tasks (each sample's task index passed down; the
    instruction router gathers each sample's sentence from an (E, T, d_c) table; lora-per-task and task-lora built
    for T tasks). The single-task step of lora-per-task and task-lora is their one-task build (= LoRA, LoRA with one
    core)."""
    suite = suites.get(SUITE)
    T, n, threads = len(suite.tasks), s.steps[arch], s.threads_for(arch, E, device)
    single, single_opt = stacked_model(arch, method, E, device)
    multi, multi_opt = stacked_model(arch, method, E, device, tasks=T)
    config = adapters.get(method).make_config(**({"tasks": T} if adapters.kind_of(method) == "task" else {}))
    if multitask.reads_instruction(config):
        multitask.bind(multi, multitask.instruction_table(suite, config).to(device), E)
    data = batches(E, device)
    g = torch.Generator().manual_seed(1)
    task = [torch.randint(0, T, (E, BATCH), generator=g).to(device) for _ in data]  # (E, b) per batch
    single_step, multi_step = engine.make_step(single, single_opt), engine.make_step(multi, multi_opt)
    mixed = [(x, y, None, t) for (x, y), t in zip(data, task)]  # step(xb, yb, inspect, task)
    chunk(single_step, data, 2)()  # warm-up
    chunk(multi_step, mixed, 2)()
    r = alternate(
        {"single": (chunk(single_step, data, n, threads), n), "suite": (chunk(multi_step, mixed, n, threads), n)},
        s.rounds,
        device,
    )
    return stack_row(
        arch,
        method,
        E,
        threads,
        tasks=T,
        single_ms=1e3 / statistics.median(r["single"]),
        suite_ms=1e3 / statistics.median(r["suite"]),
        cost=median_ratio(r["single"], r["suite"]),
    )


# mean's model is a constant (each member's training-label mean), no network: its forward is not timed. Not a kind:
# frozen, the other reference row, is the backbone's own forward and is timed.
UNTIMED_FORWARDS = ("mean",)


def tasks(archs: list[str], methods: list[str], s: Settings, device, report: dict) -> list[tuple[str, Callable]]:
    """The measurements of a run, in order, as (label, fn) pairs; each fn adds its rows to `report`."""
    out = []
    add = lambda key, fn: kind(key, lambda: report[key].append(fn()))
    one_member = [m for m in methods if isinstance(adapters.get(m), adapters.MemberMethod)]  # their own rows only
    methods = [m for m in methods if m not in one_member]
    for arch in archs if one_member else []:
        E = min(s.members)
        row = lambda a=arch, E=E: report["members"].extend(member_rows(a, one_member, E, s, device))
        out.append((f"{arch} methods written for one member E={E}", kind("members", row)))
    if "deep-narrow" in archs:
        out.append(("plain loop", kind("plain", lambda: report.update(plain=plain_loop(s, device)))))
    trained = [m for m in methods if adapters.get(m).trains]
    pair = [m for m in ("lora", "queryable") if m in methods]  # on purpose: Queryable LoRA against the LoRA it extends
    forwarded = [m for m in methods if m not in UNTIMED_FORWARDS]
    timed = [PRETRAINING, *trained] if trained else []  # the stacks the paper-table estimate counts
    for arch in archs:
        for E in s.members:
            for m in timed:
                if arch == "transformer" and m in ("full-soap", PRETRAINING) and E > 5:
                    continue  # 45 copies of a 6.3M-parameter model with their optimizer states: a GPU's (capture)
                out.append(
                    (f"{arch} {m} E={E}", add("throughput", lambda a=arch, m=m, E=E: throughput(a, m, E, s, device)))
                )
            if len(pair) == 2:
                out.append((f"{arch} overhead E={E}", add("overhead", lambda a=arch, E=E: overhead(a, E, s, device))))
            for m in pair:
                out.append(
                    (
                        f"{arch} profile {m} E={E}",
                        add("profile", lambda a=arch, m=m, E=E: profile_row(a, m, E, s, device)),
                    )
                )
        for m in pair:
            out.append((f"{arch} padding {m}", add("padding", lambda a=arch, m=m: padding_row(a, m, s, device))))
        row = lambda a=arch: report["dispatch"].extend(dispatch_rows(a, trained, min(s.members)))
        out.append((f"{arch} kernels dispatched", kind("dispatch", row)))
        for m in (m for m in pair if pareto_stack.stackable(m)):  # a Pareto grid's k stacked (Queryable LoRA)
            out.append(
                (f"{arch} pareto stack {m}", add("pareto_stack", lambda a=arch, m=m: pareto_stack_row(a, m, s, device)))
            )
        for m in SUITE_METHODS:  # the suite rows: the static baseline, the task controls, the routed methods
            if m in methods or adapters.kind_of(m) == "task":
                E = min(s.members)
                out.append(
                    (f"{arch} suite {m} E={E}", add("suite", lambda a=arch, m=m, E=E: suite_row(a, m, E, s, device)))
                )
        if "full-soap" in methods:  # on CUDA at the paper's 45 members too: its refresh's QRs, 3,060 matrices there
            cuda_widths = {PAPER_MEMBERS} if torch.device(device).type == "cuda" else set()
            for E in sorted(set(s.members) | cuda_widths):
                if arch == "transformer" and E > 5:
                    continue  # 45 per-member SOAP states of a 6.3M-parameter model
                out.append((f"{arch} SOAP E={E}", add("soap", lambda a=arch, E=E: soap_row(a, E, s, device))))
        E = PAPER_MEMBERS if torch.device(device).type == "cuda" else max(s.members)  # a stack of the paper table
        for m in trained:  # what a stopped stack keeps (pretraining takes no snapshots)
            if not (arch == "transformer" and m == "full-soap" and E > 5):  # too large, as above
                row = lambda a=arch, m=m, E=E: snapshot_row(a, m, E, s, device)
                out.append((f"{arch} snapshot {m} E={E}", add("snapshot", row)))
        if s.compile and arch == "deep-narrow":  # every trained method at the largest E: the paper estimate's rates
            E = max(s.members)
            for m in timed:
                row = lambda a=arch, m=m, E=E: compile_row(a, m, E, s, device)
                out.append((f"{arch} compile {m} E={E}", add("compile", row)))
            # on purpose: three tasks of unlike weight (full-soap's per-member SOAP step, LoRA, Queryable LoRA); the
            # estimate slows the others by the mean of their ratios
            paired = [m for m in ("full-soap", "lora", "queryable") if m in trained]
            if torch.device(device).type == "cpu" and s.side_by_side_for(arch, E)[1] > 1 and paired:
                row = lambda a=arch, E=E, p=paired: report["side_by_side"].extend(side_by_side(a, p, E, s, device))
                out.append((f"{arch} side by side E={E}", kind("side_by_side", row)))
        # on CUDA the captured step of every trained method at the paper's stack width, which the estimate uses, and
        # then at every E of the run (widest first: a run stopped at a time limit has the estimate's rows first);
        # full-soap's 45 Transformers last of all (each copy's first SOAP step solves 4,590 eigenproblems, 720 of
        # them 1,024 x 1,024: a stopped run keeps every other row, and the estimate scales full-soap from E = 5)
        if torch.device(device).type == "cuda":
            widths = sorted(set(s.members) | {PAPER_MEMBERS}, reverse=True)
            pairs = [(E, m) for E in widths for m in timed]
            last = (PAPER_MEMBERS, "full-soap") if arch == "transformer" else None
            rates = (report["peak_gflops_start"], report["bandwidth_gbs"]) if "bandwidth_gbs" in report else None
            for E, m in sorted(pairs, key=lambda pair, last=last: pair == last):  # stable: the others keep their order
                label = f"{arch} capture {m} E={E}"
                row = functools.partial(capture_row, arch, m, E, s, device, rates)
                out.append((label, kind("capture", lambda lb=label, r=row: if_it_fits(lb, report["capture"], r))))
        # every adapted method's stack, as many at once as `--methods-at-once` would train: on CUDA all of them at the
        # paper's 45 members (full-soap's 45 Transformers left out, as above: too large); on the CPU as many as its
        # cores hold at the stacks' intra-op threads, at the run's narrowest E (a deep-narrow stack of 5 runs on one)
        cuda = torch.device(device).type == "cuda"
        E = PAPER_MEMBERS if cuda else min(s.members)
        together = [m for m in trained if not (arch == "transformer" and m == "full-soap" and E > 5)]
        width = len(together) if cuda else s.side_by_side_for(arch, E)[1]
        if len(together) > 1 and width > 1:
            label = f"{arch} {len(together)} methods, {width} at once E={E}"
            row = functools.partial(at_once_row, arch, together, E, width, s, device)
            fits = lambda lb=label, r=row: if_it_fits(lb, report["at_once"], r, failing=(RuntimeError,))
            out.append((label, kind("at_once", fits)))
        row = lambda a=arch: report["inference"].extend(inference(a, forwarded, s, device))
        out.append((f"{arch} inference", kind("inference", row)))
    if "lora" in methods and "queryable" in methods:  # the peft tuner against peft's LoRA
        out.append(("peft tuner", kind("hf", lambda: report["hf"].extend(hf_rows(s, device)))))
    return out


def if_it_fits(label: str, rows: list, measure: Callable[[], dict], failing: tuple[type, ...] = ()) -> None:
    """rows.append(measure()), or, where the device runs out of memory (a wide stack of a large model, such as
    full-soap's 45 Transformers with their SOAP states, on a smaller GPU), a line on stderr and no row: the estimate
    then scales that method from its narrower stack. `failing`: further errors that are likewise a line and no row,
    so that the rows after them are still measured and the estimate still made (the `at_once` rows train several
    threads' stacks at once, recording CUDA graphs among them, where a RuntimeError once failed every method on an
    H200: docs/speed.md)."""
    try:
        rows.append(measure())
        return
    except torch.OutOfMemoryError as err:
        print(f"qlbench bench: {label} skipped: the device ran out of memory ({first_line(err)})", file=sys.stderr)
    except failing as err:
        print(f"qlbench bench: {label} failed: {type(err).__name__}: {first_line(err)}", file=sys.stderr)
    gc.collect()
    torch.cuda.empty_cache()


# what `qlbench bench --only` selects: a measurement's kind, the report's key it writes (plain: the plain PyTorch loop
# and the kernel floor)
KINDS = (
    "plain", "throughput", "overhead", "profile", "dispatch", "padding", "pareto_stack", "suite", "soap", "compile",
    "side_by_side", "capture", "at_once", "inference", "hf", "snapshot", "members",
)  # fmt: skip


def kind(name: str, fn: Callable) -> Callable:
    """fn, tagged with its measurement's kind (one of KINDS)."""
    assert name in KINDS, name
    fn.kind = name
    return fn


@engine.flush_denormals()
def run(
    archs: list[str],
    methods: list[str],
    s: Settings,
    device,
    *,
    progress: bool = True,
    only: set[str] | None = None,
    partial: Callable[[dict], None] | None = None,
) -> dict:
    """Every measurement of `tasks` (those of the kinds in `only`, when given), with a progress bar; returns the
    report (JSON-ready). `partial(report)`, if given, is called after each measurement with the report so far (the
    command writes it, so that a run stopped at a time limit keeps the rows it measured)."""
    report = dict(
        meta=results.meta_info(device),
        settings=vars(s) | {"batch": BATCH},
        only=None if only is None else sorted(only),
        throughput=[],
        overhead=[],
        compile=[],
        inference=[],
        profile=[],
        dispatch=[],
        soap=[],
        padding=[],
        suite=[],
        side_by_side=[],
        pareto_stack=[],
        capture=[],
        at_once=[],
        hf=[],
        snapshot=[],
        members=[],
    )
    report["peak_gflops_start"] = matmul_peak(device)
    report["bandwidth_gbs"] = memory_bandwidth(device)  # the roofline floor's memory rate (capture rows)
    todo = [(label, fn) for label, fn in tasks(archs, methods, s, device, report) if only is None or fn.kind in only]
    with progress_bar(todo, desc="bench", unit="measurement", disable=not progress) as bar:
        for label, fn in bar:
            bar.set_description(f"bench: {label}")
            fn()
            if partial is not None:
                partial(report)
    report["peak_gflops_end"] = matmul_peak(device)
    report["peak_gflops"] = max(report["peak_gflops_start"], report["peak_gflops_end"])
    for row in report["throughput"]:
        row["peak_share"] = row["gflops"] / report["peak_gflops"]
    compiled = engine.compile_by_default(device, "paper")
    report["paper_estimate"] = paper_estimate(report, compiled=compiled)
    if torch.device(device).type == "cuda":  # on CUDA the paper table of each backbone, at the captured rates
        report["paper_estimates"] = [paper_estimate(report, a, compiled=compiled) for a in archs]
    return report
