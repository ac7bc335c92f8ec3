"""`qlbench functions`: the zoo, one line per card (name, domain, optimum), then how much of each target is signal."""

from __future__ import annotations

from qlbench import text, zoo
from qlbench.text import Column


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "functions", help="list the function zoo (name, domain, optimum) and each target's signal and noise"
    )
    p.set_defaults(func=run)


def run(args) -> int:
    rows = []
    for name in zoo.names():
        c = zoo.card(name)
        box = " x ".join(f"[{lo:g}, {hi:g}]" for lo, hi in c.bounds)
        where = "; ".join("(" + ", ".join(f"{v:.6g}" for v in loc) + ")" for loc in c.optimum_locations)
        rows.append((name, box, f"{c.optimum_value:.10g} at {where}"))
    head = ("function", "domain", "optimum")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    for r in [head, *rows]:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    snr = [
        {
            "function": name,
            **zoo.signal_to_noise(name),
            "legacy_snr": zoo.signal_to_noise(name, noise=zoo.LEGACY_NOISE)["snr"],
        }
        for name in zoo.names()
    ]
    sig = lambda v: text.num(v, 3)
    ratio = lambda v: f"{v:,.0f}" if v >= 100 else f"{v:.1f}"
    print(
        f"\nTargets: signal and noise (the target's seeded datasets, seeds 0-2, default {zoo.DEFAULT_NOISE} label "
        f"noise: std {zoo.NOISE_FRACTION:g} x the target's spread over its box). Label variance of the clean target, "
        "noise variance, their ratio, the `mean` row's test MSE, the source function's own test MSE on the target "
        f"(how far the shift moved the labels), and the ratio under --noise {zoo.LEGACY_NOISE} (std "
        f"{zoo.LABEL_NOISE:g}, the construction of older records)\n"
    )
    columns = [
        Column("function", "function"),
        Column("label variance", "label_var", sig),
        Column("noise variance", "noise_var", sig),
        Column("signal / noise", "snr", ratio),
        Column("mean MSE", "mean_mse", sig),
        Column("source on target MSE", "shift_mse", sig),
        Column(f"signal / noise, {zoo.LEGACY_NOISE}", "legacy_snr", ratio),
    ]
    print(text.table(snr, columns))
    return 0
