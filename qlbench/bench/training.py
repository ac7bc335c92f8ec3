"""The training-step cases of `qlbench bench`, each returning its rows: the plain PyTorch loop against the per-seed
loop, the stacked engine and the kernel floor (`plain`); every method's throughput (`throughput`); Queryable LoRA's
overhead against LoRA (`overhead`); torch.compile against eager (`compile`); the kernels a step dispatches
(`dispatch`); a profile of one step (`profile`); full-soap's optimizer step (`soap`); and what padding a one-member
stack costs (`padding`). `stack_row`, a measured stack's row, is shared with the other case modules.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

from qlbench import engine, soap, zoo
from qlbench.bench.dispatch import step_traffic
from qlbench.bench.models import (
    batches,
    lora_floor_step,
    plain_deep_narrow_lora,
    plain_step,
    stacked_copies,
    stacked_model,
)
from qlbench.bench.timing import BATCH, Settings, alternate, chunk, median_ratio, step_flops, sync, whole_periods


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
