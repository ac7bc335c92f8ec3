"""`qlbench verify`: the paper's norm and Lipschitz bounds on a trained queryable or instruct-queryable cell.

Exit 0 when every statement holds, 1 when one is violated (named on stderr), 2 on bad input.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from uuid import uuid4

from qlbench.commands import UsageError, check_out_file, options, path_arg, usage_errors


def register(subparsers) -> None:
    from qlbench import verify
    from qlbench.backbones import ARCHS

    p = subparsers.add_parser(
        "verify",
        help="check the paper's norm and Lipschitz bounds on a trained queryable model",
        description="Check every norm and Lipschitz statement of the Queryable LoRA paper on a trained queryable "
        "cell over its target test set: observed value, bound, tightness ratio, holds / VIOLATED. "
        "Without --results a smoke cell is trained first.",
    )
    p.add_argument(
        "--results",
        type=path_arg,
        metavar="DIR",
        help="results folder holding records/<arch>/<function>/<method>/ (default: train a smoke "
        "cell into --out's folder, or a new temp folder)",
    )
    function = dict(
        help=f"the cell's function (default: the only one with a queryable record; {verify.DEFAULT_FUNCTION} when "
        "training)"
    )
    arch = dict(
        default=None,
        help=f"one of: {', '.join(ARCHS)} (default: the only one with a queryable record; deep-narrow when training)",
    )
    options.add(p, "--function", "--arch", function=function, arch=arch)
    method = dict(
        default=verify.METHOD,
        help=f"the routed method to check, one of: {', '.join(verify.METHODS)} (default {verify.METHOD})",
    )
    options.add(p, "--method", method=method)
    p.add_argument(
        "--peft",
        type=path_arg,
        metavar="FOLDER",
        help="instead of a cell: a saved queryable_lora peft adapter (e.g. qlbench real's results/real/<hash>/"
        "adapters/queryable-seed0), checked on its base model over the real experiment's sentences (hf extra)",
    )
    budget = dict(default=None, help="the cell's budget (default: the only one with a queryable record)")
    options.add_training_options(p, "budget", "device", budget=budget)
    out = dict(default=None, metavar="PATH", help="JSON report (default <results>/verify.json)")
    options.add_output_options(p, out=out)
    p.set_defaults(func=run)


def run(args) -> int:
    from qlbench import verify
    from qlbench.experiments import runner

    log = lambda message: print(message, file=sys.stderr, flush=True)
    if args.peft is not None:
        try:
            import peft  # noqa: F401
        except ImportError as err:
            raise UsageError(f"verify --peft needs the hf extra (pip install 'qlbench[hf]'): {err}") from None
        from qlbench import inputs
        from qlbench.experiments import real

        with usage_errors():
            inputs.folder(args.peft, "--peft adapter folder")
        check_out_file(args.out or args.peft / "verify.json")
        with usage_errors():
            report = real.verify_adapter(args.peft)
        return finish(report, args.out or args.peft / "verify.json", log)
    if args.results is not None:
        with usage_errors():
            record = verify.find_record(args.results, args.arch, args.function, args.budget, args.method)
        out = args.out or args.results / "verify.json"
        check_out_file(out)
    else:
        arch, function = args.arch or "deep-narrow", args.function or verify.DEFAULT_FUNCTION
        # a new temp folder's name, created by the run only once the plan is valid (a refusal leaves nothing)
        folder = args.out.parent if args.out is not None else Path(tempfile.gettempdir()) / f"qlbench-verify-{uuid4()}"
        if args.out is not None:
            check_out_file(args.out)
        with usage_errors():
            plan = verify.smoke_plan(folder, arch, function, args.device, args.method)
        log(f"qlbench verify: training a smoke {args.method} cell ({function} on {arch}) in {folder}")
        (record,) = runner.run(plan, progress=not args.no_progress, log=log)
        out = args.out or folder / "verify.json"
    with usage_errors():
        report = verify.verify_record(record, args.device)
    return finish(report, out, log)


def finish(report: dict, out: Path, log) -> int:
    """Print the report's table, write its JSON and name every violated statement; exit 1 if one is violated."""
    from qlbench import verify
    from qlbench.records.store import write_json

    print(
        f"qlbench verify: {report['method']} on {report['function']} ({report['arch']}, budget {report['budget']}, "
        f"{report['members']} member(s) x {report['test_samples']} test samples)"
    )
    print(verify.format_table(report))
    write_json(report, Path(out))
    print(f"report: {out}")
    bad = [r for r in report["statements"] if r["status"] == "VIOLATED"]
    for r in bad:
        log(
            f"qlbench verify: VIOLATED {r['label']}: {r['quantity']} (observed {r['observed']:.6g} > bound "
            f"{r['bound']:.6g}, ratio {r['ratio']:.6g})"
        )
    return 1 if bad else 0
