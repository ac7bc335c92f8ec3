"""`qlbench report RESULTS`: the paper's tables (one row per function, one column per method) with paired
statistics against LoRA, in Markdown, LaTeX and CSV, and seaborn figures; one table set per (arch, budget, backbone
init); the gradient concentration table and gradient figures where records hold gradient diagnostics; a suite
section (qlbench/report/suite.py) for the records of `qlbench suite`; and a real-model section
(qlbench/report/real.py) for the records of `qlbench real`."""

from __future__ import annotations

import sys
from pathlib import Path

from qlbench import inputs, text
from qlbench.backbones import ARCHS
from qlbench.commands import UsageError, check_out, options, path_arg, split_list, usage_errors
from qlbench.metrics import stats, suite_stats
from qlbench.records import per_seed, results, store


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="paper-style tables, paired statistics and figures from a results folder",
        description="Tables like the paper's (one row per function, one column per method, "
        "mean ± std, best marked, significance against LoRA), paired statistics "
        "and figures, for every (arch, budget) in a results folder.",
    )
    p.add_argument(
        "folder",
        type=path_arg,
        metavar="RESULTS",
        help="a results folder (as given to run/sweep --out), or a report's per-seed CSV (per-seed.csv.gz), which "
        "rebuilds that report's tables",
    )
    options.add(p, "--arch", arch=dict(default=None, help="only this arch (default: every arch in the folder)"))
    options.add_training_options(
        p,
        "budget",
        "backbone-init",
        budget=dict(default=None, help="only this budget (default: every budget in the folder)"),
        backbone_init=dict(
            default=None, help="only records of this backbone init (default: every init, each a slice of its own)"
        ),
    )
    metric = dict(
        help=f"the test table's metric, one of: {', '.join(stats.METRICS)} (default test-at-best-train; the "
        "train table always shows best-train)",
    )
    options.add(p, "--metric", metric=metric)
    p.add_argument("--format", default=",".join(text.FORMATS), help=f"comma-separated from: {', '.join(text.FORMATS)}")
    out = dict(
        default=None,
        help="folder for the tables and figures (default <RESULTS>/report; for a per-seed CSV, the folder it is in)",
    )
    options.add_output_options(p, "out", out=out)
    p.add_argument("--no-figures", action="store_true", help="tables only")
    p.set_defaults(func=run)


def run(args) -> int:
    from qlbench import report  # imported here: seaborn and matplotlib would slow qlbench --help and bad input

    with usage_errors():
        stats.metric_column(args.metric)  # unknown metric: one line naming the valid ones
    formats = split_list(args.format, "--format")
    if not formats or (bad := [f for f in formats if f not in text.FORMATS]):
        raise UsageError(
            f"unknown format {', '.join(bad) if formats else repr(args.format)}; valid: {', '.join(text.FORMATS)}"
        )
    if args.arch is not None and args.arch not in ARCHS:
        raise UsageError(f"unknown arch {args.arch!r}; valid: {', '.join(ARCHS)}")
    if per_seed.is_csv(args.folder):
        return _from_per_seed(args, formats)
    with usage_errors():
        inputs.folder(args.folder, "results folder")
    check_out(args.out or args.folder / "report", "report folder")
    damaged = []
    log = lambda message: print(f"qlbench report: {message}", file=sys.stderr)

    def on_damaged(message: str) -> None:
        damaged.append(message)
        log(message)

    frame = results.load(args.folder, on_damaged=on_damaged)
    suite_frame = suite_stats.load(args.folder, on_damaged=on_damaged)
    real_dir = store.Store(args.folder).real_dir
    real_runs = sorted(p for p in real_dir.glob("*") if p.is_dir() and any(p.glob("*.json")))
    if frame.empty and suite_frame.empty and not real_runs:
        if damaged:  # said above, one line each
            raise UsageError(f"no readable records: the {len(damaged)} found are damaged (a run recomputes them)")
        raise UsageError(
            f"no records under {args.folder / 'records'}, {args.folder / 'suites'} or {real_dir}; "
            f"`qlbench sweep --out {args.folder}`, `qlbench suite` or `qlbench real` writes some"
        )
    for key, value in (("arch", args.arch), ("budget", args.budget), ("backbone_init", args.backbone_init)):
        if value is not None:
            present = set(frame.get(key, [])) | set(suite_frame.get(key, []))
            if value not in present:
                raise UsageError(
                    f"no records with {key} {value!r} under {args.folder}; present: {', '.join(sorted(present))}"
                )
            frame = frame[frame[key] == value] if not frame.empty else frame
            suite_frame = suite_frame[suite_frame[key] == value] if not suite_frame.empty else suite_frame
    out = args.out or args.folder / "report"
    markdown, files, provenance = [], [], []  # provenance: (records, results.provenance) of every section
    if not frame.empty:
        written = _single_task(args, frame, formats, out, log)
        markdown.append(written["markdown"])
        files += written["files"]
        provenance.append(("cell records", written["provenance"]))
    if not suite_frame.empty:
        written = report.write_suite_report(suite_frame, out, formats=tuple(formats), figures=not args.no_figures)
        markdown.append(written["markdown"])
        files += written["files"]
        provenance.append(("suite records", written["provenance"]))
        if "md" in formats and frame.empty:  # the single-task report writes report.md; a suites-only one here
            store.write_text(written["markdown"], out / "report.md")
            files.append(out / "report.md")
        elif "md" in formats:  # append the suite section to the single-task report
            store.write_text("\n\n".join(markdown), out / "report.md")
    for run_dir in real_runs:  # qlbench real's records, one folder per configuration
        from qlbench.report import real as real_report

        written = real_report.write(sorted(run_dir.glob("*.json")), out / "real" / run_dir.name, on_damaged=log)
        if written["markdown"]:
            markdown.append(written["markdown"])
            files += written["files"]
            provenance.append((f"real-model records ({run_dir.name})", written["provenance"]))
    if real_runs and "md" in formats and markdown:
        store.write_text("\n\n".join(markdown), out / "report.md")
        files.append(out / "report.md")
    print("\n\n".join(markdown))
    print()  # each section's provenance again, where a user sees it: the tables state it per slice
    for name, line in provenance:
        print("\n".join(f"{name}: {part}" for part in line.split("\n\n")))
    print(f"\nwritten to {out}: {', '.join(sorted(set(str(Path(p).relative_to(out)) for p in files)))}")
    return 0


def _single_task(args, frame, formats, out: Path, log) -> dict:
    from qlbench import report

    frame, notes = results.newest_config(frame)
    for note in notes:
        log(note)
    curves = results.load_curves(sorted(set(frame["record"])), on_damaged=log)
    gradients = results.load_gradients(sorted(set(frame["record"])), on_damaged=log)
    with usage_errors():
        return report.write_report(
            frame,
            curves,
            out,
            metric=args.metric,
            formats=tuple(formats),
            figures=not args.no_figures,
            gradients=gradients if len(gradients) else None,
        )


def _from_per_seed(args, formats) -> int:
    """`qlbench report per-seed.csv.gz`: the single-task tables rebuilt from a report's per-seed CSV (no curves or
    gradients: those figures and the gradient table need the JSON records)."""
    from qlbench import report

    if not args.folder.is_file():
        raise UsageError(f"per-seed CSV {args.folder} " + ("is a folder" if args.folder.exists() else "does not exist"))
    out = args.out or args.folder.parent
    check_out(out, "report folder")
    try:
        frame = full = per_seed.load(args.folder)
    except store.DamagedFile as err:
        raise UsageError(str(err)) from None
    for key, value in (("arch", args.arch), ("budget", args.budget), ("backbone_init", args.backbone_init)):
        if value is not None:
            if value not in set(frame[key]):
                present = ", ".join(sorted(map(str, set(frame[key]))))
                raise UsageError(f"no rows with {key} {value!r} in {args.folder}; present: {present}")
            frame = frame[frame[key] == value]
    if frame.empty:
        raise UsageError(f"per-seed CSV {args.folder} has no rows")
    if (out / per_seed.FILE).resolve() == args.folder.resolve() and len(frame) < len(full):
        raise UsageError(f"--arch/--budget/--backbone-init would replace {args.folder} with a part of it: give --out")
    with usage_errors():
        written = report.write_report(frame, None, out, metric=args.metric, formats=tuple(formats), figures=False)
    print(written["markdown"])
    print(f"cell records: {written['provenance']}")
    print(f"\nwritten to {out}: {', '.join(sorted(set(str(Path(p).relative_to(out)) for p in written['files'])))}")
    return 0
