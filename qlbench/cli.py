"""qlbench: functions | suites | run | sweep | suite | results | report | ablate | verify | diagnose | signal | bench.

Bad input (unknown function, arch, method, budget, device, hyper-parameter, or a value out of range) prints one
line naming the problem and the valid choices, and exits with code 2; no traceback. The subcommands live in
qlbench/commands/, one module each.
"""

from __future__ import annotations

import sys

from qlbench import __version__
from qlbench.commands import Parser, UsageError
from qlbench.commands import ablate as ablate_command
from qlbench.commands import bench as bench_command
from qlbench.commands import diagnose as diagnose_command
from qlbench.commands import functions as functions_command
from qlbench.commands import pareto as pareto_command
from qlbench.commands import real as real_command
from qlbench.commands import report as report_command
from qlbench.commands import results as results_command
from qlbench.commands import run as run_command
from qlbench.commands import signal as signal_command
from qlbench.commands import suite as suite_command
from qlbench.commands import suites as suites_command
from qlbench.commands import verify as verify_command

# run registers run and sweep
COMMANDS = (
    functions_command,
    suites_command,
    run_command,
    suite_command,
    results_command,
    report_command,
    ablate_command,
    pareto_command,
    real_command,
    verify_command,
    diagnose_command,
    signal_command,
    bench_command,
)


def build_parser() -> Parser:
    parser = Parser(prog="qlbench", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"qlbench {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = None
    try:
        args = parser.parse_args(argv)
        return args.func(args)
    except UsageError as err:
        print(f"qlbench {args.command}: error: {err}" if args else f"qlbench: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("qlbench: interrupted; finished cells are saved and will be skipped on the next run", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
