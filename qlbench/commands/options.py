"""Every option that more than one command takes, declared once: one flag, one default, one help text (a command may
change its help or default where the option means a filter there, `add(..., arch=dict(help=...))`).

An option's `target` says where its value goes: "protocol" (qlbench.settings.Protocol: what changes the numbers),
"execution" (Execution: what must not) or None (the command reads it: the functions, methods, suite, --hp). The
defaults are the settings objects' own, so the command line and the library cannot drift; `protocol_of` and
`execution_of` build the two objects from the parsed options (one line and exit 2 on a bad value).

    add(p, "--function", "--arch", "--methods")                  # the target options a command takes
    add_training_options(p)                                      # TRAINING: every command that trains
    add_output_options(p)                                        # --out and --no-progress
    plan = experiment.plan(functions, methods, protocol=protocol_of(args), execution=execution_of(args))
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from qlbench import engine, protocols, zoo
from qlbench.backbones import ARCHS, INITS
from qlbench.commands import parse_overrides, path_arg, usage_errors
from qlbench.experiments import multitask
from qlbench.settings import DEFAULT_EXECUTION, DEFAULT_PROTOCOL, DTYPES, Execution, Protocol


@dataclass(frozen=True)
class Option:
    target: str | None  # "protocol", "execution" or None (the command reads it)
    field: str  # the settings object's field, or the parsed attribute the command reads
    settings: dict  # argparse's


def at_once_value(text: str) -> int | str:
    """--methods-at-once's value: "auto", or an integer as written (its range is checked by Execution); anything
    else is kept as written, so that the check names it."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        return text


def snapshot_value(text: str) -> float | str | None:
    """--snapshot-every's value: None for "off", else a number as written (its range is checked by Execution);
    anything else is kept as written, so that the check names it."""
    if text == "off":
        return None
    try:
        return float(text)
    except ValueError:
        return text


P, X = DEFAULT_PROTOCOL, DEFAULT_EXECUTION
SNAPSHOT_S = engine.SNAPSHOT_EVERY_S

# what a command trains on, and with which methods
TARGET: dict[str, Option] = {
    "--function": Option(None, "function", dict(metavar="NAME", help=f"one of: {', '.join(zoo.names())}")),
    "--functions": Option(
        None,
        "functions",
        dict(
            default="all",
            metavar="F1,F2",
            help=f"comma-separated, or all (default): {', '.join(zoo.names())}; under --protocol, all is its "
            "functions. A variant <card>@s<k> is the card's task with its shift k times as large",
        ),
    ),
    "--suite": Option(None, "suite", dict(metavar="NAME", help="a multi-task suite (qlbench suites lists them)")),
    "--schedule": Option(
        None,
        "schedule",
        dict(metavar="S", help=f"with a suite: one of {', '.join(multitask.SCHEDULES)} (default joint)"),
    ),
    "--arch": Option(
        "protocol", "arch", dict(default=P.arch, metavar="ARCH", help=f"one of: {', '.join(ARCHS)} (default {P.arch})")
    ),
    "--methods": Option(None, "methods", dict(metavar="M1,M2", help="comma-separated")),
    "--method": Option(None, "method", dict(default="queryable", help="the routed method (default queryable)")),
    "--methods-at-once": Option(
        "execution",
        "methods_at_once",
        dict(
            type=at_once_value,
            default="auto",
            metavar="N|auto",
            help="train up to N methods' stacks at once in this process, each in its own thread and, on CUDA, its own "
            "stream, so that small stacks' kernels overlap on the GPU; the numbers do not change (default auto: every "
            "method at once on CUDA for deep-narrow, else 1; N above 1 not with --compile on or --executor ray)",
        ),
    ),
    "--snapshot-every": Option(
        "execution",
        "snapshot_every_s",
        dict(
            type=snapshot_value,
            default=SNAPSHOT_S,
            metavar="SECONDS|off",
            help="save each method stack's training state at an evaluation epoch at least this often (0: at every "
            "evaluation; off: never), so that a run stopped mid-stage goes on from there when started again (default "
            f"{SNAPSHOT_S:g}; more apart where a save is slow)",
        ),
    ),
    "--epochs": Option(None, "epochs", dict(type=int, metavar="N", help="passes over the training set")),
    "--metric": Option(None, "metric", dict(default="test-at-best-train", help="the metric compared")),
    "--protocol": Option(
        None,
        "protocol",
        dict(
            metavar="NAME",
            help=f"a benchmark protocol ({', '.join(protocols.PROTOCOLS)}); run/sweep under it take its arch, budget, "
            "backbone init, dtype, eps and noise, its seeds (--seeds N: the first N) and functions (a subset may be "
            "named), on the backbones it ships (never pretrained), and refuse an option that contradicts it",
        ),
    ),
}


def budget_name(text: str) -> str:
    """argparse type of --budget: a name, never empty (an empty one was taken as unset by some commands)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"empty; give one of: {', '.join(engine.BUDGETS['deep-narrow'])}")
    return text


# how it trains: every command that trains (run, sweep, suite, pareto, ablate); signal, verify, diagnose, bench and
# real take the subset that applies to them (`add_training_options(parser, "device", ...)`)
TRAINING: dict[str, Option] = {
    "--budget": Option(
        "protocol",
        "budget",
        dict(
            type=budget_name,
            default=P.budget,
            help=f"one of: {', '.join(engine.BUDGETS['deep-narrow'])} (default {P.budget})",
        ),
    ),
    "--seeds": Option(
        "protocol", "seeds", dict(type=int, metavar="N", help="number of seeds 0..N-1 (default: the budget's)")
    ),
    "--lr": Option(
        "protocol",
        "lr",
        dict(
            type=float,
            metavar="LR",
            help="the adaptation's learning rate (default: the budget's); part of the cell's config hash",
        ),
    ),
    "--validation": Option(
        "protocol",
        "validation",
        dict(
            action="store_true",
            help="score each evaluation on the target's own validation set too (400 further samples; the record's "
            "val_at_best_train, on which a learning rate is chosen); single-task runs; part of the config hash",
        ),
    ),
    "--device": Option(
        "execution",
        "device",
        dict(default=X.device, help=f"auto (CUDA when present), cpu or cuda (default {X.device})"),
    ),
    "--threads": Option(
        "execution",
        "threads",
        dict(
            type=int,
            metavar="N",
            help="intra-op threads, from 1 to the cores present (default: 1 for a deep-narrow stack below 16 members, "
            "else PyTorch's default)",
        ),
    ),
    "--dtype": Option("protocol", "dtype", dict(default=P.dtype, help=f"{' or '.join(DTYPES)} (default {P.dtype})")),
    "--eps": Option(
        "protocol",
        "eps",
        dict(
            type=float,
            default=P.eps,
            metavar="E",
            help=f"the adaptation optimiser's epsilon (AdamW's, SOAP's for full-soap; default {P.eps:g}, "
            "PyTorch's default and the paper's protocol, which names no other); a non-default value is part of the "
            "cell's config hash. Below 1e-20 use --dtype float64 (warned otherwise): in float32 a gradient's square "
            "underflows and so tiny an eps divides by zero",
        ),
    ),
    "--noise": Option(
        "protocol",
        "noise",
        dict(
            default=P.noise,
            help=f"label noise: {zoo.DEFAULT_NOISE} (default; std 0.05 x each function's own spread over its box, "
            "signal to noise about 400 on every card) or absolute (std 0.05 in raw units, the construction of older "
            "records); part of the cache key and of a relative cell's config hash. A suite's labels are standardised "
            "per task (std 0.05 after that): relative only",
        ),
    ),
    "--backbone-init": Option(
        "protocol",
        "backbone_init",
        dict(
            default=P.backbone_init,
            metavar="INIT",
            help=f"the backbone's initialisation: {INITS[0]} (PyTorch's; the paper does not specify one), "
            f"{' or '.join(INITS[1:])} (variance-preserving for GELU; deep-narrow only; see docs/why.md); part of the "
            "cache key and of a non-default cell's config hash",
        ),
    ),
    "--hp": Option(
        None,
        "hp",
        dict(
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="method hyper-parameter override, e.g. --hp top_k=3 --hp r=4 (applies to every method that has the "
            "field)",
        ),
    ),
    "--force": Option(
        "execution",
        "force",
        dict(
            action="store_true",
            help="re-run cells that already have a finished record of the same config (replacing it)",
        ),
    ),
    "--compile": Option(
        "execution",
        "compile",
        dict(
            default=X.compile,
            help="torch.compile the training step: auto (the paper budget), on, off (a suite's steps run eager: auto "
            "or off)",
        ),
    ),
    "--capture": Option(
        "execution",
        "capture",
        dict(
            default=X.capture,
            help="record the whole training step in a CUDA graph and replay it: auto (on CUDA), on (CUDA only), off",
        ),
    ),
}
OUTPUT: dict[str, Option] = {
    "--out": Option(
        "execution",
        "out_dir",
        dict(dest="out", default=str(X.out_dir), type=path_arg, help=f"results folder (default ./{X.out_dir})"),
    ),
    "--no-progress": Option(None, "no_progress", dict(action="store_true", help="no progress bar")),
}
SHARED = TARGET | TRAINING | OUTPUT


def _add(parser, title: str | None, table: dict[str, Option], names, changes: dict[str, dict]) -> None:
    chosen = [f"--{n.removeprefix('--')}" for n in names] or list(table)
    unknown = [n for n in chosen if n not in table]
    if unknown:
        raise ValueError(f"no shared option {', '.join(unknown)}; valid: {', '.join(table)}")
    group = parser.add_argument_group(title) if title else parser
    for flag in chosen:
        group.add_argument(flag, **(table[flag].settings | changes.get(attribute(flag), {})))


def add(parser, *flags: str, **changes: dict) -> None:
    """The named shared options (any of SHARED), on `parser` (or a group of it: a mutually exclusive one); `changes`:
    per option (by its attribute: arch=..., methods=...) argparse settings that replace the shared ones."""
    _add(parser, None, SHARED, flags, changes)


def add_training_options(parser: argparse.ArgumentParser, *names: str, **changes: dict) -> None:
    """The training options (all of them, or the named ones: "device", "--threads", ...) as one argument group;
    `changes` as `add`'s."""
    _add(parser, "training options (the same for every command)", TRAINING, names, changes)


def add_output_options(parser: argparse.ArgumentParser, *names: str, out: dict | None = None) -> None:
    """--out and --no-progress (or the named one). `out`: argparse settings that replace --out's, for a command
    whose folder is not the results folder (pareto's)."""
    _add(parser, "output options", OUTPUT, names, {"out": out} if out else {})


def attribute(flag: str) -> str:
    """The parsed attribute of a shared option."""
    return SHARED[flag].settings.get("dest", flag.removeprefix("--").replace("-", "_"))


def _fields(args, target: str) -> dict:
    parsed = vars(args)
    return {
        o.field: parsed[attribute(flag)]
        for flag, o in SHARED.items()
        if o.target == target and attribute(flag) in parsed
    }


def protocol_of(args, **fields) -> Protocol:
    """The Protocol of the parsed options `args` holds (the others at their defaults) and `fields`; UsageError (one
    line) on a bad value."""
    with usage_errors():
        return Protocol(**(_fields(args, "protocol") | fields))


def execution_of(args, *, check_threads: bool = True, **fields) -> Execution:
    """The Execution of the parsed options `args` holds and `fields`, with --no-progress as `progress`; --threads is
    checked against the cores present unless the command's executor checks it elsewhere (Ray's). UsageError (one
    line) on a bad value."""
    values = _fields(args, "execution") | fields
    if "no_progress" in vars(args):
        values["progress"] = not args.no_progress
    with usage_errors():
        if check_threads and values.get("threads") is not None:
            engine.check_threads(values["threads"])
        return Execution(**{k: Path(v) if k == "out_dir" else v for k, v in values.items()})


def overrides_of(args) -> dict:
    """--hp's KEY=VALUE pairs (UsageError, one line, on bad syntax)."""
    return parse_overrides(getattr(args, "hp", []) or [])


def non_default(protocol: Protocol) -> dict:
    """The protocol's settings other than the arch, budget and seeds that differ from the defaults."""
    return {
        f.name: getattr(protocol, f.name)
        for f in dataclasses.fields(protocol)
        if f.name not in ("arch", "budget", "seeds") and getattr(protocol, f.name) != getattr(P, f.name)
    }
