"""The workload cases of `qlbench bench`, each returning its rows: a Pareto grid's points that differ in k alone
trained as one stack (`pareto_stack`), a suite stage's step against a single-task one (`suite`), the peft tuner
against peft's LoRA on the causal-LM decoder (`hf`), and what a stack's snapshot costs (`snapshot`).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from qlbench import adapters, engine, suites
from qlbench.bench.models import batches, hf_generate, hf_step, stacked_model
from qlbench.bench.timing import BATCH, Settings, alternate, chunk, median_ratio, sync
from qlbench.bench.training import stack_row
from qlbench.engine import snapshot
from qlbench.experiments import multitask, pareto_stack, suite_tasks


def hf_rows(s: Settings, device) -> list[dict]:
    """The peft tuner (qlbench.hf) against peft's LoRA on the same model: the causal-LM experiment's decoder
    (qlbench/experiments/real_lm.py, 2 layers, width 64) with each adapter on q_proj and v_proj; one training step
    (`models.hf_step`) on a batch of 32 sequences of 13 tokens, and greedy generation with the KV cache of 6 tokens
    from 32 prompts of 7 (`models.hf_generate`), each alternating over the methods; ms per call and the ratio to
    LoRA's. None without the hf extra, or without the instruction encoder (its sentence is not in the packaged table;
    the rows are then skipped with a line on stderr, as the other measurements do not need it)."""
    try:
        import peft  # noqa: F401
    except ImportError:
        return []
    from qlbench.instructions import EncoderUnavailable

    methods = ("lora", "queryable", "instruct-queryable")
    try:
        calls = {
            "training step": {m: hf_step(m, device) for m in methods},
            "generate (KV cache)": {m: hf_generate(m, device) for m in methods},
        }
    except EncoderUnavailable as err:
        print(f"qlbench bench: the peft tuner rows are skipped: {err}", file=sys.stderr)
        return []
    rows = []
    for what, fns in calls.items():
        for fn in fns.values():
            fn(), fn()  # warm-up
        n = max(2, s.steps["deep-narrow"] // 2)
        r = alternate({m: (lambda fn=fn, n=n: [fn() for _ in range(n)], n) for m, fn in fns.items()}, s.rounds, device)
        rows += [
            dict(
                model="tiny decoder (real-lm)",
                call=what,
                method=m,
                ms_per_step=1e3 / statistics.median(v),
                vs_lora=median_ratio(r["lora"], v),
            )  # fmt: skip
            for m, v in r.items()
        ]
    return rows


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
    """A Pareto grid's points that differ in k alone (qlbench/experiments/pareto_stack.py): one stack of the P points'
    E members each, every member with its k, against the P stacks of E that a grid trained point by point runs one after
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
        suite_tasks.bind(multi, suite_tasks.instruction_table(suite, config).to(device), E)
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
