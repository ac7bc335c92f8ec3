"""`qlbench bench`: speed, measured side by side in one process, reported as ratios.

The tables:
  - adaptation throughput (model-steps/s at batch 64) of every method on both backbones: the stacked engine at
    E = 5 and E = 45 members against a naive per-seed eager loop (the same modules, one member at a time, PyTorch's
    default threads), plus a plain-PyTorch anchor (nn.Linear + LoRA, the loop a user would write) so the naive
    baseline can be seen not to be artificially slow, and the kernel floor of the anchor's stacks (the same LoRA
    step with its backward written out and nothing else, compiled where the run compiles), the rate the engine
    would reach without the fixed cost of autograd and per-tensor optimizer bookkeeping;
  - the share of this machine's dense matmul peak the stacked engine reaches (FLOPs counted with
    torch.utils.flop_counter over one real step; the peak is the best large-sgemm rate timed at the start and at
    the end of the same run);
  - inference efficiency like the paper's: forward latency at batch 64, overhead against LoRA, samples/s and FLOP
    overhead against LoRA, for every method on both backbones;
  - outside --quick: every trained method's deep-narrow stack at the largest E compiled against eager (warm-up and
    steady rate), Queryable LoRA against LoRA compiled, and the anchor's stacks compiled, so the estimate of the
    full deep-narrow paper table counts the steps as the paper budget runs them (`--compile auto`), in one process
    and, when `threads` lets several stacks fit on the machine, that many at once: the rates of a few stacks run
    side by side in separate processes (as Ray's workers run a sweep's tasks) are measured against their rates
    alone, and the estimate slows every task by that ratio.
Measurements alternate between the compared variants in rounds (A B A B ...) and report medians, so slow drift of
a shared machine hits both sides alike. Nothing here asserts a speed: the numbers are reported, not tested.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from tqdm.auto import tqdm

from qlbench import adapters, engine, results, zoo
from qlbench.backbones import build_backbone
from qlbench.seeding import generator
from qlbench.stacked import bmm_add, stacked_linear

BATCH = 64


def stacked_model(arch: str, method_name: str, members: int, device) -> tuple[nn.Module, object]:
    """A randomly initialised stack with the method `method_name` built on it, and its optimizer (throughput does
    not depend on the values; `run` flushes denormals so tiny values do not slow the CPU)."""
    keys = [("bench", e) for e in range(members)]
    method = adapters.get(method_name)
    config = method.make_config()
    y = torch.zeros(members, BATCH, device=device)
    model = method.build(
        build_backbone(arch, keys, device=device), config, [generator("init", "bench", method_name, k) for k in keys], y
    )
    # what depends on the members beyond their data (instruct-queryable's e(c)): a real function's, member by member
    functions = [zoo.names()[e % len(zoo.names())] for e in range(members)]
    method.bind(model, [(f, e) for f, (_, e) in zip(functions, keys)], config)
    opt = method.optimizer(model, config, 5e-4, 0.01) if method.trains else None
    return model, opt


def batches(members: int, device, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.rand(members, BATCH, 2, generator=g).to(device), torch.rand(members, BATCH, generator=g).to(device))
        for _ in range(n)
    ]


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class PlainLoraLinear(nn.Module):
    """The textbook LoRA layer on nn.Linear (loralib style), for the plain-PyTorch anchor."""

    def __init__(self, base: nn.Linear, r: int = 8, alpha: float = 16.0):
        super().__init__()
        self.base, self.scale = base, alpha / r
        self.A = nn.Parameter(torch.empty(r, base.in_features).uniform_(-1, 1) / math.sqrt(base.in_features))
        self.B = nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x):
        return self.base(x) + self.scale * F.linear(F.linear(x, self.A), self.B)


def plain_deep_narrow_lora() -> tuple[nn.Module, torch.optim.Optimizer]:
    """deep-narrow + LoRA written the usual way: nn.Sequential of nn.Linear, PyTorch's default AdamW."""
    layers = [nn.Linear(2, 32), nn.GELU()]
    for _ in range(32):
        layers += [PlainLoraLinear(nn.Linear(32, 32)), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(32, 1))
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith((".A", ".B")))
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-4)


def plain_step(model, opt):
    def step(xb, yb):  # xb (1, b, 2): one member
        loss = (model(xb[0]).squeeze(-1) - yb[0]).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def lora_floor_step(model: nn.Module, opt: torch.optim.Optimizer, *, compile: bool = False):
    """The kernels a training step of a stacked deep-narrow LoRA model must run, and nothing else: the forward and
    its backward written out as tensor ops (merged weights W0 + s B A, as the engine merges them), then one fused
    AdamW update with `opt`'s settings. No autograd graph and no per-parameter optimizer bookkeeping (one shared step
    count instead of one per tensor); with `compile`, the forward and backward are one torch.compile'd function, so
    Inductor fuses them as it fuses the engine's compiled step. It updates `model`'s LoRA factors exactly as
    `engine.make_step` with `opt` does (tests/test_bench.py), so its rate is what an engine on these kernels
    would reach if the kernels were its only cost: the anchor's "kernel floor" (measured, not a proven bound).
    step(xb (E, b, 2), yb (E, b)); returns nothing."""
    layers = list(model.hidden)
    params = [p for layer in layers for p in (layer.lora_A, layer.lora_B)]  # A_0, B_0, A_1, ...
    (group,) = opt.param_groups
    state = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]  # exp_avg, exp_avg_sq
    count = torch.zeros((), dtype=torch.float32, device=params[0].device)  # the shared step count

    def gradients(xb: torch.Tensor, yb: torch.Tensor) -> list[torch.Tensor]:  # [dL/dA_0, dL/dB_0, dL/dA_1, ...]
        inp, head = model.inp, model.head
        h = [F.gelu(stacked_linear(xb, inp.weight, inp.bias))]  # (E, b, 32)
        pre, W = [], []
        for layer in layers:
            W.append(bmm_add(layer.base.weight, layer.lora_B, layer.lora_A, alpha=layer.scale))  # (E, 32, 32)
            pre.append(stacked_linear(h[-1], W[-1], layer.base.bias))
            h.append(F.gelu(pre[-1]))
        out = stacked_linear(h[-1], head.weight, head.bias)  # (E, b, 1)
        g = (out.squeeze(-1) - yb).mul(2.0 / yb.shape[1]).unsqueeze(-1)  # d(sum of member means)/d out
        g = torch.bmm(g, head.weight)  # (E, b, 32)
        grads = [None] * len(params)
        for i in reversed(range(len(layers))):
            g = torch.ops.aten.gelu_backward(g, pre[i])
            gW = torch.bmm(g.transpose(1, 2), h[i]).mul(layers[i].scale)  # s dL/dW
            grads[2 * i] = torch.bmm(layers[i].lora_B.transpose(1, 2), gW)  # dL/dA = s B^T dL/dW
            grads[2 * i + 1] = torch.bmm(gW, layers[i].lora_A.transpose(1, 2))  # dL/dB = s dL/dW A^T
            if i:
                g = torch.bmm(g, W[i])
        return grads

    if compile:
        torch._dynamo.reset()  # as engine.compiled: a fresh in-process cache, below the recompile limit
        gradients = torch.compile(gradients, dynamic=False)

    @torch.no_grad()
    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        grads = gradients(xb, yb)
        count.add_(1)
        torch._fused_adamw_(
            params, grads, *state, [], [count] * len(params),
            lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1], weight_decay=group["weight_decay"],
            eps=group["eps"], amsgrad=False, maximize=False,
        )  # fmt: skip

    return step


def matmul_peak(device, n: int = 2048, reps: int = 3, trials: int = 5) -> float:
    """GFLOP/s of a large float32 matmul, the best of `trials` timings of `reps` products (the dense peak the
    engine is compared with; the best, since on a shared machine a slow sample measures the neighbours)."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    for _ in range(2):
        a @ b
    best = 0.0
    for _ in range(trials):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync(device)
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9)
    return best


def step_flops(model, step, data) -> int:
    """FLOPs (matmul-type ops, forward + backward) of one training step, counted on the real step."""
    with FlopCounterMode(display=False) as counter:
        step(*data[0])
    return counter.get_total_flops()


def forward_flops(model, x) -> int:
    """FLOPs of one forward (counted with autograd on: the counter's module hooks need it; nothing is
    backpropagated)."""
    with FlopCounterMode(display=False) as counter:
        model(x)
    return counter.get_total_flops()


# ---------------------------------------------------------------------------------------------------------------


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
    def make(cls, quick: bool, threads: int | None = None) -> Settings:
        if quick:
            return cls({"deep-narrow": 4, "transformer": 1}, 2, (5,), 3, 2, False, threads)
        return cls({"deep-narrow": 40, "transformer": 3}, 3, (5, 45), 20, 9, True, threads)

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


def alternate(fns: dict[str, tuple[callable, int]], rounds: int, device) -> dict[str, list[float]]:
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


def chunk(step, data, n, threads: int | None = None):
    """n steps over `data` with `threads` intra-op threads (None: PyTorch's default)."""

    def run():
        with engine.num_threads(threads):
            for i in range(n):
                step(*data[i % len(data)])

    return run


def throughput(arch: str, method: str, E: int, s: Settings, device) -> dict:
    """The stacked engine at E members (with the engine's thread setting) against the naive per-seed loop: the
    same modules and step, one member at a time, with PyTorch's default threads."""
    n = s.steps[arch]
    model, opt = stacked_model(arch, method, E, device)
    step, data = engine.make_step(model, opt), batches(E, device)
    naive_model, naive_opt = stacked_model(arch, method, 1, device)
    naive, naive_data = engine.make_step(naive_model, naive_opt), batches(1, device)
    threads = s.threads_for(arch, E, device)
    for fn, d in ((step, data), (naive, naive_data)):
        chunk(fn, d, 2)()  # warm-up (SOAP's first step only builds its basis)
    with engine.num_threads(1):  # counting FLOPs is not timed
        flops = step_flops(model, step, data)
    r = alternate(
        {"stacked": (chunk(step, data, n, threads), E * n), "naive": (chunk(naive, naive_data, n), n)}, s.rounds, device
    )
    stacked = statistics.median(r["stacked"])
    return dict(
        arch=arch,
        method=method,
        members=E,
        threads=threads or torch.get_num_threads(),
        stacked=stacked,
        eval_s=evaluation_seconds(model, E, threads, s.rounds, device),
        naive=statistics.median(r["naive"]),
        speedup=median_ratio(r["stacked"], r["naive"]),
        step_gflop=flops / 1e9,
        gflops=flops / 1e9 * stacked / E,
    )


def evaluation_seconds(model, E: int, threads, rounds: int, device) -> float:
    """Median seconds of one evaluation as the engine runs it every `eval_every` epochs: train and test MSE of all
    E members on the target's 400 + 800 samples (zoo.TARGET_TRAIN of zoo.TARGET_SIZE)."""

    g = torch.Generator().manual_seed(1)
    times = []
    for _ in range(rounds):
        x = torch.rand(E, zoo.TARGET_SIZE, 2, generator=g).to(device)
        y = torch.rand(E, x.shape[1], generator=g).to(device)
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad(), engine.num_threads(threads):
            engine.evaluate(model, x[:, : zoo.TARGET_TRAIN], y[:, : zoo.TARGET_TRAIN])
            engine.evaluate(model, x[:, zoo.TARGET_TRAIN :], y[:, zoo.TARGET_TRAIN :])
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paper_estimate(report: dict, arch: str = "deep-narrow", compiled: bool = False) -> dict | None:
    """Wall time of the full paper table of `arch` (nine functions x five seeds = 45 members per method) predicted
    from the measured rates at the largest E of the run: per method, the adaptation steps (5,000 epochs of the
    400-sample target at batch 64 per member) at the stacked rate plus its evaluations (every 10 epochs and at 0) at
    the measured evaluation time, scaled linearly from E to 45 members. With `compiled` (the paper budget compiles
    its training step on this device, engine.compile_by_default) a method's compiled rate at that E is used where
    the run measured one, plus its measured compile warm-up; evaluation always runs eager. Pretraining is not
    included (it is cached and shared by the methods). None when the run has no throughput row of `arch`."""

    rows = [r for r in report["throughput"] if r["arch"] == arch]
    if not rows:
        return None
    E = max(r["members"] for r in rows)
    budget = engine.BUDGETS[arch]["paper"]
    members = 9 * budget.seeds
    steps = engine.steps(budget.adapt, zoo.TARGET_TRAIN)  # per member
    evaluations = budget.adapt.epochs // budget.eval_every + 1
    comp = {r["method"]: r for r in report.get("compile", []) if r["arch"] == arch and r["members"] == E}
    methods = {}
    for r in rows:
        if r["members"] != E:
            continue
        c = comp.get(r["method"]) if compiled else None
        rate = c["compiled"] if c else r["stacked"]  # model-steps/s
        train = members * steps / rate + (c["warmup_s"] if c else 0.0)
        evaluation = evaluations * r["eval_s"] * members / E
        methods[r["method"]] = dict(
            train_s=train, eval_s=evaluation, total_s=train + evaluation, mode="compiled" if c else "eager"
        )
    out = dict(
        arch=arch, measured_at=E, members=members, methods=methods, total_s=sum(m["total_s"] for m in methods.values())
    )
    threads = max(r["threads"] for r in rows if r["members"] == E)
    workers = (report.get("meta", {}).get("cpu_count") or 1) // threads
    if workers > 1:  # what `sweep --executor ray --threads <threads>` would run at once on this machine
        out["parallel"] = dict(workers=workers, threads=threads, total_s=list_schedule(methods, workers))
        measured = {
            r["method"]: r["together_vs_alone"]
            for r in report.get("side_by_side", [])
            if r["arch"] == arch and r["members"] == E and r["workers"] == workers and r["method"] in methods
        }
        if measured:  # each task slowed by its measured side-by-side ratio (the mean of those measured elsewhere)
            mean = statistics.mean(measured.values())
            slowed = {m: dict(total_s=v["total_s"] / measured.get(m, mean)) for m, v in methods.items()}
            out["parallel"] |= dict(measured_total_s=list_schedule(slowed, workers), together_vs_alone=measured)
    return out


def side_by_side(arch: str, methods: list[str], E: int, s: Settings, device) -> list[dict]:
    """Each method's stack of E members alone and with copies of it running at once, as `sweep --executor ray
    --threads t` runs its tasks: `cpu_count // t` spawned worker processes of t intra-op threads, each with its own
    stack (compiled where the paper budget compiles on this device, if `s.compile`). They stay alive over `s.rounds`
    rounds of two timed windows of `s.side_by_side_s` seconds: worker 0 alone (the others wait at a barrier), then
    every worker at once. Per method: worker 0's median rate alone, the median over rounds of the workers' mean rate
    together, and their median paired ratio `together_vs_alone` (1: tasks side by side keep their rates). CPU only.
    """
    import multiprocessing as mp

    threads, workers = s.side_by_side_for(arch, E)
    compile = s.compile and engine.compile_by_default(device, "paper")
    ctx = mp.get_context("spawn")  # a fresh interpreter per worker, as a Ray worker process
    rows = []
    for method in methods:
        barrier, queue = ctx.Barrier(workers), ctx.Queue()
        args = (arch, method, E, threads, compile, s.side_by_side_s, s.rounds, barrier, queue)
        procs = [ctx.Process(target=_side_by_side_worker, args=(rank, *args), daemon=True) for rank in range(workers)]
        for proc in procs:
            proc.start()
        rates = {"alone": [[] for _ in range(s.rounds)], "together": [[] for _ in range(s.rounds)]}
        try:
            for _ in range(s.rounds * (1 + workers)):
                phase, i, rate = _get(queue, procs)
                rates[phase][i].append(rate)
        finally:
            for proc in procs:
                proc.join(timeout=60)
                if proc.is_alive():
                    proc.kill()
        alone = [r[0] for r in rates["alone"]]
        together = [statistics.mean(r) for r in rates["together"]]
        rows.append(
            dict(
                arch=arch,
                method=method,
                members=E,
                threads=threads,
                workers=workers,
                compiled=compile,
                alone=statistics.median(alone),
                together=statistics.median(together),
                together_vs_alone=median_ratio(together, alone),
            )
        )
    return rows


def _get(queue, procs, timeout: float = 900.0):
    """The next (phase, round, rate) a side-by-side worker reports; an error if a worker died or none reports."""
    import queue as queues

    deadline = time.monotonic() + timeout
    while True:
        try:
            return queue.get(timeout=1.0)
        except queues.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                why = f"exited with code {dead[0]}" if dead else f"reported nothing for {timeout:.0f} s"
                raise RuntimeError(f"a side-by-side benchmark worker {why}") from None


def _side_by_side_worker(rank, arch, method, E, threads, compile, window_s, rounds, barrier, queue) -> None:
    """One process of `side_by_side`: its own stack and data (seeded alike), warmed up (compiled), then per round
    a window alone (rank 0 only) and a window with every worker; puts (phase, round, model-steps/s)."""
    torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    with engine.flush_denormals():
        model, opt = stacked_model(arch, method, E, cpu)
        step, data = engine.make_step(model, opt, compile=compile), batches(E, cpu)
        chunk(step, data, 3)()  # warm-up: compilation, SOAP's first step
        for i in range(rounds):
            for phase in ("alone", "together"):
                barrier.wait()
                if phase == "together" or rank == 0:
                    n, t0 = 0, time.perf_counter()
                    while (elapsed := time.perf_counter() - t0) < window_s:
                        step(*data[n % len(data)])
                        n += 1
                    queue.put((phase, i, E * n / elapsed))
                barrier.wait()


def list_schedule(methods: dict[str, dict], workers: int) -> float:
    """Makespan of the methods' tasks (total_s each) on `workers`, each task taken in the given order by the first
    worker to be free, as Ray runs a sweep's tasks in submission order; tasks assumed to keep their rates."""
    free = [0.0] * workers
    for m in methods.values():
        i = free.index(min(free))
        free[i] += m["total_s"]
    return max(free)


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
    """torch.compile against eager for one stack: the warm-up (compilation) and the steady rate, alternating."""
    n = s.steps[arch]
    eager_model, eager_opt = stacked_model(arch, method, E, device)
    comp_model, comp_opt = stacked_model(arch, method, E, device)
    data = batches(E, device)
    eager = engine.make_step(eager_model, eager_opt)
    comp = engine.make_step(comp_model, comp_opt, compile=True)
    threads = s.threads_for(arch, E, device)
    chunk(eager, data, 2, threads)()
    t0 = time.perf_counter()
    chunk(comp, data, 2, threads)()  # compiles (one batch shape)
    warmup = time.perf_counter() - t0
    r = alternate(
        {"eager": (chunk(eager, data, n, threads), E * n), "compiled": (chunk(comp, data, n, threads), E * n)},
        s.rounds,
        device,
    )
    return dict(
        arch=arch,
        method=method,
        members=E,
        threads=threads or torch.get_num_threads(),
        warmup_s=warmup,
        eager=statistics.median(r["eager"]),
        compiled=statistics.median(r["compiled"]),
        speedup=median_ratio(r["compiled"], r["eager"]),
    )


def anchor(s: Settings, device) -> dict:
    """The plain-PyTorch deep-narrow LoRA loop a user would write (PyTorch's default threads, and one thread), next
    to qlbench's naive loop (E = 1, default threads), the stacked engine at each E of the run (its own thread
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
        "qlbench_e1": (chunk(qstep, data, n), n),
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
    from torch.profiler import ProfilerActivity, profile

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
    return dict(
        arch=arch,
        method=method,
        members=E,
        threads=threads or torch.get_num_threads(),
        step_ms=1e3 * wall,
        aten_ops=ops,
        matmul_share=matmul / profiled,
        gelu_share=gelu / profiled,
        us_per_op=1e6 * wall / ops,
    )


# methods whose inference forward is also timed compiled when the run compiles: the routed methods and their anchor
COMPILED_FORWARDS = ("lora", "queryable", "instruct-queryable")


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
    fixed random gradients, alternating; optimizer steps per second of the whole stack."""
    from pytorch_optimizer import SOAP

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

    n = max(2, s.steps[arch] // 4)
    for _ in range(2):  # past SOAP's initialising first step
        batched.step()
        loop()
    no_data = [()]  # the optimizer steps take no batch
    r = alternate(
        {"batched": (chunk(batched.step, no_data, n, threads), n), "per-member": (chunk(loop, no_data, n, threads), n)},
        s.rounds,
        device,
    )
    return dict(
        arch=arch,
        members=E,
        threads=threads or torch.get_num_threads(),
        batched_ms=1e3 / statistics.median(r["batched"]),
        per_member_ms=1e3 / statistics.median(r["per-member"]),
        speedup=median_ratio(r["batched"], r["per-member"]),
    )


def tasks(archs: list[str], methods: list[str], s: Settings, device, report: dict) -> list[tuple[str, Callable]]:
    """The measurements of a run, in order, as (label, fn) pairs; each fn adds its rows to `report`."""
    out = []
    add = lambda key, fn: lambda: report[key].append(fn())
    if "deep-narrow" in archs:
        out.append(("anchor", lambda: report.update(anchor=anchor(s, device))))
    trained = [m for m in methods if adapters.get(m).trains]
    pair = [m for m in ("lora", "queryable") if m in methods]
    forwarded = [m for m in methods if m != "mean"]
    for arch in archs:
        for E in s.members:
            for m in trained:
                if arch == "transformer" and m == "full-soap" and E > 5:
                    continue  # 45 per-member SOAP states of a 6.3M-parameter model
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
        if "full-soap" in methods:
            for E in s.members:
                if arch == "transformer" and E > 5:
                    continue  # 45 per-member SOAP states of a 6.3M-parameter model
                out.append((f"{arch} SOAP E={E}", add("soap", lambda a=arch, E=E: soap_row(a, E, s, device))))
        if s.compile and arch == "deep-narrow":  # every trained method at the largest E: the paper estimate's rates
            E = max(s.members)
            for m in trained:
                row = lambda a=arch, m=m, E=E: compile_row(a, m, E, s, device)
                out.append((f"{arch} compile {m} E={E}", add("compile", row)))
            paired = [m for m in ("full-soap", "lora", "queryable") if m in trained]
            if torch.device(device).type == "cpu" and s.side_by_side_for(arch, E)[1] > 1 and paired:
                row = lambda a=arch, E=E, p=paired: report["side_by_side"].extend(side_by_side(a, p, E, s, device))
                out.append((f"{arch} side by side E={E}", row))
        out.append((f"{arch} inference", lambda a=arch: report["inference"].extend(inference(a, forwarded, s, device))))
    return out


@engine.flush_denormals()
def run(archs: list[str], methods: list[str], s: Settings, device, *, progress: bool = True) -> dict:
    """Every measurement of `tasks`, with a progress bar; returns the report (JSON-ready)."""
    report = dict(
        meta=results.meta_info(device),
        settings=vars(s) | {"batch": BATCH},
        throughput=[],
        overhead=[],
        compile=[],
        inference=[],
        profile=[],
        soap=[],
        side_by_side=[],
    )
    report["peak_gflops_start"] = matmul_peak(device)
    todo = tasks(archs, methods, s, device, report)
    with tqdm(todo, desc="bench", unit="measurement", disable=not progress) as bar:
        for label, fn in bar:
            bar.set_description(f"bench: {label}")
            fn()
    report["peak_gflops_end"] = matmul_peak(device)
    report["peak_gflops"] = max(report["peak_gflops_start"], report["peak_gflops_end"])
    for row in report["throughput"]:
        row["peak_share"] = row["gflops"] / report["peak_gflops"]
    report["paper_estimate"] = paper_estimate(report, compiled=engine.compile_by_default(device, "paper"))
    return report


def _f(v, digits=1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _pct(v) -> str:
    return "-" if v is None else f"{v:+.0f}%"


def _stack(row: dict) -> dict:
    """The columns that name a measured stack in the Markdown tables."""
    return dict(arch=row["arch"], method=row["method"], E=row["members"], threads=row["threads"])


def _floors(anchor: dict) -> str:
    """The anchor's kernel floors, each with the share of it the engine's faster stack (eager or compiled) of that
    E reaches."""
    parts = []
    for k, rate in anchor.items():
        if k.startswith("floor_e") and not k.endswith("_vs_plain"):
            E = k[len("floor_e") :]
            engine_rate = max(anchor.get(f"stacked_e{E}", 0.0), anchor.get(f"stacked_e{E}_compiled", 0.0))
            parts.append(
                f"at E = {E} {rate:.0f} model-steps/s = x{anchor[k + '_vs_plain']:.1f} the plain loop, of which the "
                f"engine reaches {100 * engine_rate / rate:.0f}%"
            )
    return "; ".join(parts)


def markdown(report: dict) -> str:
    """The report as Markdown tables (what `qlbench bench` prints and writes to bench.md)."""
    import pandas as pd

    from qlbench.report import markdown as table

    out = [
        f"Matmul peak (float32 2048^3 sgemm, best at the start and end of the run): "
        f"{report['peak_gflops']:.1f} GFLOP/s; threads "
        f"{report['meta']['threads']}; batch {BATCH}; medians of {report['settings']['rounds']} alternating rounds "
        f"({report['settings']['inference_rounds']} for inference)."
    ]
    if "anchor" in report:
        a = report["anchor"]
        stacks = "; ".join(
            f"stacked engine at E = {k.split('_')[1][1:]}{' compiled' if k.endswith('compiled') else ''} "
            f"{a[k]:.0f} model-steps/s = x{a[k + '_vs_plain']:.1f} the plain loop"
            for k in a
            if k.startswith("stacked_") and not k.endswith("_vs_plain")
        )
        floors = _floors(a)
        out.append(
            f"\nNaive-loop anchor (deep-narrow LoRA, steps/s of one seed): plain PyTorch nn.Linear loop "
            f"{a['plain']:.0f} (default threads), {a['plain_1_thread']:.0f} (one thread); qlbench per-seed "
            f"loop {a['qlbench_e1']:.0f}; {stacks}."
        )
        if floors:
            out.append(
                f"\nKernel floor (the same LoRA stack's step with its backward written out and one fused AdamW "
                f"update: no autograd graph, no per-tensor optimizer bookkeeping; compiled when the run compiles, so "
                f"Inductor fuses it as it fuses the engine's step; a bound measured for engines on these kernels, "
                f"not a proven one): {floors}."
            )
    rows = [
        dict(
            **_stack(r),
            **{
                "stacked model-steps/s": _f(r["stacked"], 0),
                "naive model-steps/s": _f(r["naive"], 1),
                "speed-up": f"x{r['speedup']:.1f}",
                "GFLOP/s": _f(r["gflops"], 2),
                "% of peak": f"{100 * r['peak_share']:.1f}",
            },
        )
        for r in report["throughput"]
    ]
    out += ["\n### Adaptation throughput: stacked engine vs naive per-seed loop\n", table(pd.DataFrame(rows))]
    if report.get("paper_estimate"):
        est = report["paper_estimate"]
        rows = [
            dict(
                method=m,
                **{
                    "adaptation h": f"{v['train_s'] / 3600:.2f}",
                    "evaluation h": f"{v['eval_s'] / 3600:.2f}",
                    "total h": f"{v['total_s'] / 3600:.2f}",
                    "training step": v.get("mode", "eager"),
                },
            )
            for m, v in est["methods"].items()
        ]
        out += [
            f"\n### Estimate: the full {est['arch']} paper table ({est['members']} members per method, 5,000 epochs; "
            f"from the rates at E = {est['measured_at']}, linear in members; training steps compiled where "
            f"`--compile auto` compiles the paper budget on this device, warm-up included; one process; pretraining "
            f"not included): {est['total_s'] / 3600:.2f} h for the methods measured\n",
            table(pd.DataFrame(rows)),
        ]
        if par := est.get("parallel"):
            out.append(
                f"\nWith {par['workers']} such tasks at once (`qlbench sweep --executor ray --threads "
                f"{par['threads']}` on this machine; tasks taken in this order by the first free worker): "
                f"{par['total_s'] / 3600:.2f} h if each task kept the rate measured here alone"
                + (
                    f"; {par['measured_total_s'] / 3600:.2f} h with each task slowed by its measured side-by-side "
                    f"ratio ({', '.join(f'{m} x{v:.2f}' for m, v in par['together_vs_alone'].items())}; the mean "
                    f"of these for the others)."
                    if "measured_total_s" in par
                    else "."
                )
            )
    if report["overhead"]:
        rows = [
            dict(
                arch=r["arch"],
                E=r["members"],
                **{
                    "training step vs LoRA": _pct(r["train_step_overhead_pct"]),
                    "compiled training step vs LoRA compiled": _pct(r.get("compiled_train_step_overhead_pct")),
                    "forward vs LoRA": _pct(r["forward_overhead_pct"]),
                    "compiled forward vs LoRA compiled": _pct(r.get("compiled_forward_overhead_pct")),
                },
            )
            for r in report["overhead"]
        ]
        out += ["\n### Queryable LoRA against LoRA (paired, same E)\n", table(pd.DataFrame(rows))]
    if report.get("profile"):
        rows = [
            dict(
                **_stack(r),
                **{
                    "step ms": _f(r["step_ms"], 2),
                    "ATen ops / step": _f(r["aten_ops"], 0),
                    "µs per op": _f(r["us_per_op"], 1),
                    "matmul share of step": f"{100 * r['matmul_share']:.0f}%",
                    "GELU fwd+bwd share": f"{100 * r['gelu_share']:.0f}%",
                },
            )
            for r in report["profile"]
        ]
        out += [
            "\n### Profile of one training step (torch.profiler; ops include nested calls)\n",
            table(pd.DataFrame(rows)),
        ]
    if report.get("soap"):
        rows = [
            dict(
                arch=r["arch"],
                E=r["members"],
                threads=r["threads"],
                **{
                    "batched StackedSoap ms/step": _f(r["batched_ms"], 1),
                    "pytorch_optimizer.SOAP per member ms/step": _f(r["per_member_ms"], 1),
                    "speed-up": f"x{r['speedup']:.1f}",
                },
            )
            for r in report["soap"]
        ]
        out += [
            "\n### full-soap's optimizer step: batched vs one SOAP per member (paired)\n",
            table(pd.DataFrame(rows)),
        ]
    if report["compile"]:
        rows = [
            dict(
                **_stack(r),
                **{
                    "warm-up s": _f(r["warmup_s"]),
                    "eager": _f(r["eager"], 0),
                    "compiled": _f(r["compiled"], 0),
                    "speed-up": f"x{r['speedup']:.2f}",
                },
            )
            for r in report["compile"]
        ]
        out += ["\n### torch.compile (model-steps/s after warm-up)\n", table(pd.DataFrame(rows))]
    if report.get("side_by_side"):
        rows = [
            dict(
                **_stack(r),
                **{
                    "processes at once": r["workers"],
                    "step": "compiled" if r["compiled"] else "eager",
                    "alone model-steps/s": _f(r["alone"], 0),
                    "each, side by side": _f(r["together"], 0),
                    "side by side vs alone": f"x{r['together_vs_alone']:.2f}",
                },
            )
            for r in report["side_by_side"]
        ]
        out += [
            "\n### Tasks side by side (separate processes, as Ray's workers; rate of one process alone against each "
            "of them at once, paired)\n",
            table(pd.DataFrame(rows)),
        ]
    rows = [
        dict(
            arch=r["arch"],
            method=r["method"],
            **{
                "latency ms": _f(r["latency_ms"], 2),
                "vs LoRA": "-" if r.get("latency_overhead_pct") is None else f"{r['latency_overhead_pct']:+.0f}%",
                "samples/s": _f(r["samples_per_s"], 0),
                "GFLOP": _f(r["gflop"], 4),
                "FLOPs vs LoRA": "-" if r.get("flop_overhead_pct") is None else f"{r['flop_overhead_pct']:+.1f}%",
            },
        )
        for r in report["inference"]
    ]
    if any("compiled_latency_ms" in r for r in report["inference"]):
        for row, r in zip(rows, report["inference"]):
            row["compiled ms"] = _f(r["compiled_latency_ms"], 2) if "compiled_latency_ms" in r else "-"
            row["compiled vs LoRA compiled"] = _pct(r.get("compiled_latency_overhead_pct"))
    out += [
        "\n### Inference: forward at batch 64, one model (no grad; compiled: the same model through torch.compile)\n",
        table(pd.DataFrame(rows)),
    ]
    return "\n".join(out) + "\n"
