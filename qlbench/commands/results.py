"""`qlbench results DIR`: what a results folder holds, one line per record (cell and config)."""

from __future__ import annotations

import sys

from qlbench import inputs, text
from qlbench.commands import UsageError, check_out_file, path_arg, usage_errors
from qlbench.metrics import suite_stats
from qlbench.records import per_seed, results


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "results",
        help="list what a results folder holds, one line per record",
        description="List the records of a results folder: arch, function, method, budget, "
        "config hash, status, seeds, diverged seeds, whether the model is saved; and the suite records.",
    )
    p.add_argument("folder", type=path_arg, metavar="RESULTS", help="a results folder (as given to run --out)")
    p.add_argument(
        "--per-seed",
        type=path_arg,
        metavar="FILE",
        help="also write the per-seed rows of every single-task cell into FILE (a per-seed CSV, .csv or .csv.gz: "
        "each cell's newest config, and each rate of a learning-rate grid, with its lr column; what a protocol's "
        "baselines are)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    with usage_errors():
        inputs.folder(args.folder, "results folder")
    if args.per_seed is not None and not per_seed.is_csv(args.per_seed):
        raise UsageError(f"--per-seed {args.per_seed}: name a .csv or .csv.gz file")
    if args.per_seed is not None:
        check_out_file(args.per_seed, "per-seed CSV")
    log = lambda m: print(f"qlbench results: {m}", file=sys.stderr)
    table = results.index(args.folder, on_damaged=log)
    suite_table = suite_stats.index(suite_stats.load(args.folder, on_damaged=log))
    if table.empty and suite_table.empty:
        raise UsageError(
            f"no records under {args.folder / 'records'} or {args.folder / 'suites'}; `qlbench run --out "
            f"{args.folder}` or `qlbench suite --out {args.folder}` writes some"
        )
    if not table.empty:
        table = table.drop(columns=["record"])
        print(text.markdown(table))
        counts = table.groupby(["arch", "budget"]).size()
        print("\n" + "; ".join(f"{arch}/{budget}: {n} record(s)" for (arch, budget), n in counts.items()))
        if args.per_seed is not None:
            frame, notes = results.newest_config(results.load(args.folder, on_damaged=log))
            for note in notes:
                log(note)
            written = per_seed.write(frame, args.per_seed)
            print(f"per-seed rows of {frame['record'].nunique()} record(s): {written}")
    if not suite_table.empty:
        print(("\n" if not table.empty else "") + "Suite records (qlbench suite):\n")
        print(text.markdown(suite_table))
    return 0
