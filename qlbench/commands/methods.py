"""`qlbench methods`: every method a `--methods` list can name; `--peft`: each tuner of the installed peft, stacked,
looped or refused, and why, with its trainable count on both backbones (docs/methods.md holds this table)."""

from __future__ import annotations

from qlbench import adapters, text
from qlbench.commands import options
from qlbench.progress import bar
from qlbench.text import Column


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "methods",
        help="list the methods --methods can name: qlbench's own, installed qlbench.methods entry points and "
        "(--peft) every tuner of the installed peft with how it runs",
    )
    p.add_argument(
        "--peft",
        action="store_true",
        help="the peft tuners' table: status (stacked, looped, refused), why, trainable parameters per member on "
        "deep-narrow and the Transformer (builds each tuner once per backbone: about a minute)",
    )
    options.add(p, "--no-progress")
    p.set_defaults(func=run)


def peft_table(progress: bool = False) -> str:
    """The peft tuners' Markdown table (adapters.peft_tuners.catalogue)."""
    count = lambda v: "" if v is None else f"{v:,}"
    columns = [
        Column("method", "tuner"),
        Column("status", "status"),
        Column("trainable, deep-narrow", "deep-narrow", count),
        Column("trainable, transformer", "transformer", count),
        Column("how (stacked) or why (looped, refused)", "reason"),
    ]
    with bar(
        total=len(adapters.peft_tuners.types()), desc="build peft tuners", unit="tuner", disable=not progress
    ) as b:
        rows = adapters.peft_tuners.catalogue(progress=b.update)
    return text.table(rows, columns)


def run(args) -> int:
    if args.peft:
        print(peft_table(progress=not args.no_progress))
        return 0
    rows = [{"method": n, "kind": m.kind, "summary": m.summary} for n, m in adapters.REGISTRY.items()]
    rows += [
        {"method": n, "kind": "", "summary": "installed entry point"} for n in adapters.outside.entry_point_names()
    ]
    print(text.table(rows, [Column("method", "method"), Column("kind", "kind"), Column("summary", "summary")]))
    print(
        "\nAlso: peft:<type> for every tuner of the installed peft (qlbench methods --peft), and package.module:NAME "
        "for a Method object in an importable module (docs/extending.md)."
    )
    return 0
