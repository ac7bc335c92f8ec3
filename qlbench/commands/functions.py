"""`qlbench functions`: the zoo, one line per card (name, domain, optimum)."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("functions", help="list the function zoo (name, domain, optimum)")
    p.set_defaults(func=run)


def run(args) -> int:
    from qlbench import zoo

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
    return 0
