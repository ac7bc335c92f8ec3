"""`qlbench verify`: check every norm and Lipschitz statement of the paper on a trained Queryable LoRA model.

    qlbench verify --results results                      # a trained cell: records/<arch>/<function>/queryable.json
    qlbench verify                                        # trains a smoke cell first (in a temp folder, or --out's)

Over the cell's target test set (every member, float64 recomputation of the trained weights) it reports, per
statement: the observed value and the bound at the worst item (largest observed / bound), that tightness ratio, the
number of items (samples x blocks x layers ...) and holds / VIOLATED; prints a table, writes JSON (default
<results>/verify.json). A violated bound is reported on stderr and exits 1; bad input exits 2 (qlbench.cli.UsageError).

The Lipschitz statements are about the instruction embedding e: they probe e' = e + delta per chunk of samples with
each block's states held fixed (their premise; see tests/properties/THEOREMS.md). A model without instruction channels
(lambda_ctx = tau_lang = 0) does not depend on e at all; its rows are reported as vacuous (0 <= 0).
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import sys
import tempfile
from pathlib import Path

import torch

METHOD = "queryable"
DEFAULT_FUNCTION = "dropwave"


def add_parser(subparsers) -> None:
    from qlbench.backbones import ARCHS

    p = subparsers.add_parser(
        "verify", help="check the paper's norm and Lipschitz bounds on a trained queryable model",
        description="Check every norm and Lipschitz statement of the Queryable LoRA paper on a trained queryable "
                    "cell over its target test set: observed value, bound, tightness ratio, holds / VIOLATED. "
                    "Without --results a smoke cell is trained first.")
    p.add_argument("--results", type=Path, metavar="DIR",
                   help="results folder holding records/<arch>/<function>/queryable.json (default: train a smoke "
                        "cell into --out's folder, or a new temp folder)")
    p.add_argument("--function", metavar="NAME",
                   help=f"the cell's function (default: the only one with a queryable record; {DEFAULT_FUNCTION} "
                        f"when training)")
    p.add_argument("--arch", help=f"one of: {', '.join(ARCHS)} (default: the only one with a queryable record; "
                                  "deep-narrow when training)")
    p.add_argument("--out", type=Path, metavar="PATH", help="JSON report (default <results>/verify.json)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (default cpu)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while training")
    p.set_defaults(func=cmd_verify)


def _usage(message: str):
    from qlbench.cli import UsageError

    return UsageError(message)


def find_record(results: Path, arch: str | None, function: str | None) -> Path:
    """records/<arch>/<function>/queryable.json under `results`; arch and function may be left out when unique."""
    from qlbench import zoo
    from qlbench.backbones import ARCHS

    if arch is not None and arch not in ARCHS:
        raise _usage(f"unknown arch {arch!r}; valid: {', '.join(ARCHS)}")
    if function is not None:
        try:
            zoo.card(function)
        except ValueError as err:
            raise _usage(str(err)) from None
    if not results.is_dir():
        raise _usage(f"results folder {results} does not exist")
    found = sorted(results.glob(f"records/{arch or '*'}/{function or '*'}/{METHOD}.json"))
    if not found:
        have = sorted(str(p.relative_to(results)) for p in results.glob(f"records/*/*/{METHOD}.json"))
        raise _usage(f"no {METHOD} record for arch={arch or 'any'}, function={function or 'any'} under "
                     f"{results / 'records'}" + (f"; found: {', '.join(have)}" if have else ""))
    if len(found) > 1:
        cells = ", ".join(f"--arch {p.parent.parent.name} --function {p.parent.name}" for p in found)
        raise _usage(f"several {METHOD} cells under {results}: choose one of {cells}")
    return found[0]


def train_smoke(folder: Path, arch: str, function: str, device: str, progress: bool) -> Path:
    from qlbench import experiment

    try:
        plan = experiment.plan(functions=[function], arch=arch, methods=[METHOD], budget="smoke", device=device,
                               out_dir=folder)
    except ValueError as err:
        raise _usage(str(err)) from None
    print(f"qlbench verify: training a smoke {METHOD} cell ({function} on {arch}) in {folder}", file=sys.stderr,
          flush=True)
    (path,) = experiment.run(plan, progress=progress, log=lambda m: print(m, file=sys.stderr, flush=True))
    return path


def probe_instruction(model, members: int, device) -> torch.Tensor:
    """The instruction embedding e the Lipschitz probes start from: a seeded N(0, I / d_c) per member (the engine
    trains without instructions; a model without instruction channels ignores it)."""
    from qlbench import theory

    d_c = theory.memory_of(model).config.instruction_dim or 1
    g = torch.Generator().manual_seed(0)
    return (torch.randn(members, d_c, generator=g, dtype=torch.float64) / math.sqrt(d_c)).to(device)


def verify_record(record: Path, device: str = "cpu") -> dict:
    """Rebuild the trained cell and check every statement over its target test set; returns the JSON report."""
    from qlbench import __version__, experiment, theory

    try:
        model, data, rec = experiment.load_adapted(record, device=device)
    except (FileNotFoundError, ValueError, KeyError) as err:
        raise _usage(f"cannot rebuild the trained cell from {record}: {err}") from None
    cfg = rec["run_info"]["config"]
    if cfg["method"] != METHOD:
        raise _usage(f"{record} is a {cfg['method']} record, not {METHOD}")
    model.eval()
    x = data.x_test
    e = probe_instruction(model, x.shape[0], x.device)
    bounds = theory.check_model(model, x, e)
    config = theory.memory_of(model).config
    if not (config.lambda_ctx or config.tau_lang):
        for b in bounds:
            if b.label in LIPSCHITZ_LABELS and "(e')" in b.quantity:
                b.note = "vacuous: lambda_ctx = tau_lang = 0, routing does not depend on e"
    rows = [_finite(b.summary()) for b in bounds]
    return {
        "schema": 1,
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "qlbench_version": __version__,
        "record": str(record),
        "function": cfg["function"], "arch": cfg["arch"], "method": cfg["method"],
        "budget": rec["run_info"]["budget"], "seeds": cfg["seeds"],
        "test_samples": int(x.shape[1]), "members": int(x.shape[0]),
        "arithmetic": "float64 recomputation of the trained weights",
        "instruction": "seeded probe e ~ N(0, I/d_c) per member, e' = e + delta (||delta|| = 1e-3 max(1, ||e||))",
        "tolerance": f"holds when observed <= bound + {theory.REL_TOL:.3g} (|bound| + |observed| + operand size)",
        "statements": rows,
        "violated": sum(r["status"] == "VIOLATED" for r in rows),
    }


LIPSCHITZ_LABELS = ("prop:app_summary_lipschitz", "prop:app_router_operator_lipschitz",
                    "thm:app_attention_projection_norm_stability")


def _finite(row: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def format_table(report: dict) -> str:
    head = ("statement", "quantity", "items", "observed*", "bound*", "ratio", "status")
    rows = [(r["label"], r["quantity"], str(r["items"]), _fmt(r["observed"]), _fmt(r["bound"]), _fmt(r["ratio"]),
             r["status"] + (f" ({r['note']})" if r["note"] else "")) for r in report["statements"]]
    widths = [max(len(x[i]) for x in rows + [head]) for i in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in [head] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("* at the item with the largest observed / bound (ratio); items = samples x blocks x layers ...")
    return "\n".join(lines)


def cmd_verify(args: argparse.Namespace) -> int:
    from qlbench import results, zoo
    from qlbench.backbones import ARCHS

    if args.results is not None:
        record = find_record(args.results, args.arch, args.function)
        out = args.out or args.results / "verify.json"
    else:
        arch, function = args.arch or "deep-narrow", args.function or DEFAULT_FUNCTION
        if arch not in ARCHS:
            raise _usage(f"unknown arch {arch!r}; valid: {', '.join(ARCHS)}")
        try:
            zoo.card(function)
        except ValueError as err:
            raise _usage(str(err)) from None
        folder = args.out.parent if args.out is not None else Path(tempfile.mkdtemp(prefix="qlbench-verify-"))
        record = train_smoke(folder, arch, function, args.device, not args.no_progress)
        out = args.out or folder / "verify.json"
    report = verify_record(record, args.device)
    print(f"qlbench verify: {report['method']} on {report['function']} ({report['arch']}, budget {report['budget']}, "
          f"{report['members']} member(s) x {report['test_samples']} test samples)")
    print(format_table(report))
    results.write_json_atomic(report, Path(out))
    print(f"report: {out}")
    bad = [r for r in report["statements"] if r["status"] == "VIOLATED"]
    for r in bad:
        print(f"qlbench verify: VIOLATED {r['label']}: {r['quantity']} (observed {r['observed']:.6g} > bound "
              f"{r['bound']:.6g}, ratio {r['ratio']:.6g})", file=sys.stderr)
    return 1 if bad else 0
