"""`qlbench results DIR`: what a results folder holds, one line per record (cell and config)."""

from __future__ import annotations

import sys
from pathlib import Path

from qlbench import results, text
from qlbench.commands import UsageError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "results",
        help="list what a results folder holds, one line per record",
        description="List the records of a results folder: arch, function, method, budget, "
        "config hash, status, seeds, diverged seeds, whether the model is saved.",
    )
    p.add_argument("folder", type=Path, metavar="RESULTS", help="a results folder (as given to run --out)")
    p.set_defaults(func=run)


def run(args) -> int:
    if not args.folder.is_dir():
        raise UsageError(f"results folder {args.folder} does not exist")
    table = results.index(args.folder, on_damaged=lambda m: print(f"qlbench results: {m}", file=sys.stderr))
    if table.empty:
        raise UsageError(f"no records under {args.folder / 'records'}; `qlbench run --out {args.folder}` writes some")
    table = table.drop(columns=["record"]).assign(has_model=table["has_model"].map({True: "yes", False: "no"}))
    print(text.markdown(table))
    counts = table.groupby(["arch", "budget"]).size()
    print("\n" + "; ".join(f"{arch}/{budget}: {n} record(s)" for (arch, budget), n in counts.items()))
    return 0
