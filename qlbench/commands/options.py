"""The options shared by the commands, each declared once: one flag, one default, one help text.

TRAINING are the options of every command that trains (run, sweep, suite, pareto, ablate); signal, verify,
diagnose, bench and real take the subset that applies to them (`add_training_options(parser, "device", ...)`).
OUTPUT are the results folder and the progress switch. The defaults are read from `experiment.plan`'s signature,
so the command line and the library cannot drift; `plan_kwargs` turns the parsed options into the library's
keyword arguments (experiment.plan, multitask.plan, pareto.plans, ablation.plans).
"""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

from qlbench import engine, zoo
from qlbench.backbones import INITS
from qlbench.commands import parse_overrides, path_arg, usage_errors
from qlbench.experiments import experiment, planning

DEFAULTS = {name: p.default for name, p in inspect.signature(experiment.plan).parameters.items()}

# option -> (the library's keyword, argparse's settings); the parsed attribute is the option's name (`attribute`)
TRAINING: dict[str, tuple[str, dict]] = {
    "--budget": (
        "budget",
        dict(
            default=DEFAULTS["budget"],
            help=f"one of: {', '.join(engine.BUDGETS['deep-narrow'])} (default {DEFAULTS['budget']})",
        ),
    ),
    "--seeds": ("seeds", dict(type=int, metavar="N", help="number of seeds 0..N-1 (default: the budget's)")),
    "--device": (
        "device",
        dict(default=DEFAULTS["device"], help=f"auto (CUDA when present), cpu or cuda (default {DEFAULTS['device']})"),
    ),
    "--threads": (
        "threads",
        dict(
            type=int,
            metavar="N",
            help="intra-op threads, from 1 to the cores present (default: 1 for a deep-narrow stack below 16 members, "
            "else PyTorch's default)",
        ),
    ),
    "--dtype": (
        "dtype",
        dict(
            default=DEFAULTS["dtype"],
            help=f"{' or '.join(planning.DTYPES)} (default {DEFAULTS['dtype']})",
        ),
    ),
    "--eps": (
        "eps",
        dict(
            type=float,
            default=DEFAULTS["eps"],
            metavar="E",
            help=f"the adaptation optimiser's epsilon (AdamW's, SOAP's for full-soap; default {DEFAULTS['eps']:g}, "
            "PyTorch's default and the paper's protocol, which names no other); a non-default value is part of the "
            "cell's config hash. Below 1e-20 use --dtype float64 (warned otherwise): in float32 a gradient's square "
            "underflows and so tiny an eps divides by zero",
        ),
    ),
    "--noise": (
        "noise",
        dict(
            default=DEFAULTS["noise"],
            help=f"label noise: {zoo.DEFAULT_NOISE} (default; std 0.05 x each function's own spread over its box, "
            "signal to noise about 400 on every card) or absolute (std 0.05 in raw units, the construction of older "
            "records); part of the cache key and of a relative cell's config hash. A suite's labels are standardised "
            "per task (std 0.05 after that): relative only",
        ),
    ),
    "--backbone-init": (
        "backbone_init",
        dict(
            default=DEFAULTS["backbone_init"],
            metavar="INIT",
            help=f"the backbone's initialisation: {INITS[0]} (PyTorch's; the paper does not specify one), "
            f"{' or '.join(INITS[1:])} (variance-preserving for GELU; deep-narrow only; see docs/why.md); part of the "
            "cache key and of a non-default cell's config hash",
        ),
    ),
    "--hp": (
        "overrides",
        dict(
            dest="hp",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="method hyper-parameter override, e.g. --hp top_k=3 --hp r=4 (applies to every method that has the "
            "field)",
        ),
    ),
    "--force": (
        "force",
        dict(
            action="store_true",
            help="re-run cells that already have a finished record of the same config (replacing it)",
        ),
    ),
    "--compile": (
        "compile",
        dict(
            default=DEFAULTS["compile"],
            help="torch.compile the training step: auto (the paper budget), on, off (a "
            "suite's steps run eager: auto or off)",
        ),
    ),
    "--capture": (
        "capture",
        dict(
            default=DEFAULTS["capture"],
            help="record the whole training step in a CUDA graph and replay it: auto (on CUDA), on (CUDA only), off",
        ),
    ),
}
OUTPUT: dict[str, tuple[str | None, dict]] = {
    "--out": (
        "out_dir",
        dict(default=DEFAULTS["out_dir"], type=path_arg, help=f"results folder (default ./{DEFAULTS['out_dir']})"),
    ),
    "--no-progress": (None, dict(action="store_true", help="no progress bar")),  # the commands read it
}


def _add(parser: argparse.ArgumentParser, title: str, table: dict, names: tuple[str, ...], **settings) -> None:
    chosen = [f"--{n.removeprefix('--')}" for n in names] or list(table)
    unknown = [n for n in chosen if n not in table]
    if unknown:
        raise ValueError(f"no shared option {', '.join(unknown)}; valid: {', '.join(table)}")
    group = parser.add_argument_group(title)
    for flag in chosen:
        group.add_argument(flag, **(table[flag][1] | settings.get(flag, {})))


def add_training_options(parser: argparse.ArgumentParser, *names: str) -> None:
    """The training options (all of them, or the named ones: "device", "--threads", ...) as one argument group."""
    _add(parser, "training options (the same for every command)", TRAINING, names)


def add_output_options(parser: argparse.ArgumentParser, *names: str, out: dict | None = None) -> None:
    """--out and --no-progress (or the named one). `out`: argparse settings that replace --out's, for a command
    whose folder is not the results folder (pareto's)."""
    _add(parser, "output options", OUTPUT, names, **({"--out": out} if out else {}))


def attribute(flag: str) -> str:
    """The parsed attribute of a shared option."""
    table = TRAINING | OUTPUT
    return table[flag][1].get("dest", flag.removeprefix("--").replace("-", "_"))


def plan_kwargs(args, *, check_threads: bool = True) -> dict:
    """The library's keyword arguments from the shared options `args` holds (the others left out), checked where
    the library would only find out late: --hp's syntax and (unless the command's executor checks it elsewhere)
    --threads against the cores present (an empty --out is refused by argparse: `path_arg`). UsageError (one line)
    on bad input."""
    parsed = vars(args)
    out = {}
    if check_threads and "threads" in parsed:
        with usage_errors():
            engine.check_threads(args.threads)
    for flag, (keyword, _) in TRAINING.items():
        if attribute(flag) in parsed:
            out[keyword] = parsed[attribute(flag)]
    if "overrides" in out:
        out["overrides"] = parse_overrides(out["overrides"])
    if "out" in parsed:
        out["out_dir"] = Path(args.out)
    return out
