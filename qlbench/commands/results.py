"""`qlbench results DIR`: what a results folder holds, one line per record (cell and config)."""

from __future__ import annotations

import sys

from qlbench import inputs, text
from qlbench.commands import UsageError, path_arg, usage_errors
from qlbench.metrics import suite_stats
from qlbench.records import results


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "results",
        help="list what a results folder holds, one line per record",
        description="List the records of a results folder: arch, function, method, budget, "
        "config hash, status, seeds, diverged seeds, whether the model is saved; and the suite records.",
    )
    p.add_argument("folder", type=path_arg, metavar="RESULTS", help="a results folder (as given to run --out)")
    p.set_defaults(func=run)


def run(args) -> int:
    with usage_errors():
        inputs.folder(args.folder, "results folder")
    log = lambda m: print(f"qlbench results: {m}", file=sys.stderr)
    table = results.index(args.folder, on_damaged=log)
    suite_table = suite_stats.index(suite_stats.load(args.folder, on_damaged=log))
    if table.empty and suite_table.empty:
        raise UsageError(
            f"no records under {args.folder / 'records'} or {args.folder / 'suites'}; `qlbench run --out "
            f"{args.folder}` or `qlbench suite --out {args.folder}` writes some"
        )
    if not table.empty:
        table = table.drop(columns=["record"]).assign(has_model=table["has_model"].map({True: "yes", False: "no"}))
        print(text.markdown(table))
        counts = table.groupby(["arch", "budget"]).size()
        print("\n" + "; ".join(f"{arch}/{budget}: {n} record(s)" for (arch, budget), n in counts.items()))
    if not suite_table.empty:
        print(("\n" if not table.empty else "") + "Suite records (qlbench suite):\n")
        print(text.markdown(suite_table))
    return 0
