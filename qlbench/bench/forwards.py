"""The inference case of `qlbench bench`: every method's forward latency, samples/s and FLOPs at batch 64 and their
overheads against LoRA, eager and, when the run compiles, compiled (`inference`).
"""

from __future__ import annotations

import statistics

import torch

from qlbench import adapters, engine
from qlbench.bench.models import batches, stacked_model
from qlbench.bench.timing import BATCH, Settings, alternate, forward_flops, median_ratio

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
