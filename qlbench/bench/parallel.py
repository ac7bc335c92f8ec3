"""Tasks side by side: the rate of a stack alone against the rates of copies of it running at once in separate
processes, as Ray's workers run a sweep's tasks (`qlbench sweep --executor ray --threads t`). CPU only."""

from __future__ import annotations

import multiprocessing as mp
import queue as queues
import statistics
import time
from dataclasses import dataclass

import torch

from qlbench import engine
from qlbench.bench.models import batches, stacked_model
from qlbench.bench.timing import Settings, chunk, median_ratio


def side_by_side(arch: str, methods: list[str], E: int, s: Settings, device) -> list[dict]:
    """Each method's stack of E members alone and with copies of it running at once, as `sweep --executor ray
    --threads t` runs its tasks: `cpu_count // t` spawned worker processes of t intra-op threads, each with its own
    stack (compiled where the paper budget compiles on this device, if `s.compile`). They stay alive over `s.rounds`
    rounds of two timed windows of `s.side_by_side_s` seconds: worker 0 alone (the others wait at a barrier), then
    every worker at once. Per method: worker 0's median rate alone, the median over rounds of the workers' mean rate
    together, and their median paired ratio `together_vs_alone` (1: tasks side by side keep their rates). CPU only.
    """
    threads, workers = s.side_by_side_for(arch, E)
    compile = s.compile and engine.compile_by_default(device, "paper")
    ctx = mp.get_context("spawn")  # a fresh interpreter per worker, as a Ray worker process
    rows = []
    for method in methods:
        barrier, queue = ctx.Barrier(workers), ctx.Queue()
        case = Worker(arch, method, E, threads, compile, s.side_by_side_s, s.rounds)
        args = (case, barrier, queue)
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


@dataclass(frozen=True)
class Worker:
    """What each process of `side_by_side` trains, and how long it measures: a stack of E members of `method` on
    `arch`, with `threads` intra-op threads, compiled or not, `rounds` windows of `window_s` seconds."""

    arch: str
    method: str
    E: int
    threads: int
    compile: bool
    window_s: float
    rounds: int


def _side_by_side_worker(rank: int, case: Worker, barrier, queue) -> None:
    """One process of `side_by_side`: its own stack and data (seeded alike), warmed up (compiled), then per round
    a window alone (rank 0 only) and a window with every worker; puts (phase, round, model-steps/s)."""
    arch, method, E, window_s = case.arch, case.method, case.E, case.window_s
    torch.set_num_threads(case.threads)
    cpu = torch.device("cpu")
    with engine.flush_denormals():
        model, opt = stacked_model(arch, method, E, cpu)
        step, data = engine.make_step(model, opt, compile=case.compile), batches(E, cpu)
        chunk(step, data, 3)()  # warm-up: compilation, SOAP's first step
        for i in range(case.rounds):
            for phase in ("alone", "together"):
                barrier.wait()
                if phase == "together" or rank == 0:
                    n, t0 = 0, time.perf_counter()
                    while (elapsed := time.perf_counter() - t0) < window_s:
                        step(*data[n % len(data)])
                        n += 1
                    queue.put((phase, i, E * n / elapsed))
                barrier.wait()
