"""Methods written for one member (peft's tuners, methods from outside; adapters/member.py) in `qlbench bench`: each
one's training step stacked (vmap over the members) and looped (one member at a time on the same stacked
parameters), against qlbench's own stacked `lora` in the same rounds (kind "members")."""

from __future__ import annotations

import statistics

from qlbench import adapters, engine
from qlbench.bench.models import batches, stacked_model
from qlbench.bench.timing import Settings, alternate, chunk, median_ratio


def member_rows(arch: str, methods: list[str], E: int, s: Settings, device) -> list[dict]:
    """Per method: model-steps/s of qlbench's `lora`, of the method on the path it trains on, and of its loop, in
    alternating rounds; the stacked column is empty where the method itself loops (its reason in `path`)."""
    rows = []
    lora, lora_opt = stacked_model(arch, adapters.BASELINE, E, device)
    data = batches(E, device)
    n = s.steps[arch]
    for m in methods:
        model, opt = stacked_model(arch, m, E, device)
        path = model.path
        looped, looped_opt = stacked_model(arch, m, E, device)
        looped.path = "looped: timed for the comparison"
        fns = {"lora": (chunk(engine.make_step(lora, lora_opt), data, n), E * n)}
        if path.startswith("stacked"):
            fns["stacked"] = (chunk(engine.make_step(model, opt), data, n), E * n)
        fns["looped"] = (chunk(engine.make_step(looped, looped_opt), data, n), E * n)
        for fn, _ in fns.values():
            fn()  # warm-up
        r = alternate(fns, s.rounds, device)
        rows.append(
            {
                "arch": arch,
                "method": m,
                "members": E,
                "path": path,
                "lora": statistics.median(r["lora"]),
                "stacked": statistics.median(r["stacked"]) if "stacked" in r else None,
                "looped": statistics.median(r["looped"]),
                "stacked_vs_loop": median_ratio(r["stacked"], r["looped"]) if "stacked" in r else None,
                "vs_lora": median_ratio(r["stacked"] if "stacked" in r else r["looped"], r["lora"]),
            }
        )
    return rows
