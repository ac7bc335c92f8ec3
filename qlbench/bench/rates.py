"""A learning-rate grid in one stack (engine/rates.py) in `qlbench bench` (kind "grid"): a method's stack of E members
at one rate against its stack of G x E members at G rates (zoo-v2's grid), in the same rounds."""

from __future__ import annotations

import statistics

from qlbench import adapters, engine
from qlbench.bench.models import batches, stacked_model
from qlbench.bench.timing import Settings, alternate, chunk, median_ratio
from qlbench.engine.rates import member_rates

GRID = (1.5e-4, 5e-4, 1.5e-3, 5e-3)  # zoo-v2's (protocols.ZOO_V2.lrs)


def grid_rows(arch: str, methods: list[str], E: int, s: Settings, device) -> list[dict]:
    """Per method: model-steps/s of its one-rate stack (E members) and of its grid stack (len(GRID) x E members, a
    rate per member), and the grid step's wall time over the one-rate step's (`grid_vs_one`: the grid's cost
    against one rate; len(GRID) would be no gain over training the rates one after another)."""
    rows, n, G = [], s.steps[arch], len(GRID)
    for m in methods:
        method = adapters.get(m)
        one, one_opt = stacked_model(arch, m, E, device)
        wide, _ = stacked_model(arch, m, G * E, device)
        config = method.make_config()
        grid_opt = member_rates(
            lambda lr, method=method, wide=wide, config=config: method.optimizer(wide, config, lr, 0.01),
            [lr for lr in GRID for _ in range(E)],
        )
        fns = {
            "one": (chunk(engine.make_step(one, one_opt), batches(E, device), n), E * n),
            "grid": (chunk(engine.make_step(wide, grid_opt), batches(G * E, device), n), G * E * n),
        }
        for fn, _ in fns.values():
            fn()  # warm-up
        r = alternate(fns, s.rounds, device)
        rows.append(
            {
                "arch": arch,
                "method": m,
                "members": E,
                "rates": G,
                "one": statistics.median(r["one"]),
                "grid": statistics.median(r["grid"]),
                "grid_vs_one": G * median_ratio(r["one"], r["grid"]),
            }
        )
    return rows
