"""qlbench's command line: one subcommand per module of qlbench/commands/ (COMMANDS; `qlbench --help` lists them).

Bad input (unknown function, arch, method, budget, device, hyper-parameter, or a value out of range) prints one
line naming the problem and the valid choices, and exits with code 2; no traceback. The subcommands live in
qlbench/commands/, one module each.
"""

from __future__ import annotations

import errno
import signal
import sys
import threading

from qlbench import __version__
from qlbench.commands import Parser, UsageError
from qlbench.commands import ablate as ablate_command
from qlbench.commands import bench as bench_command
from qlbench.commands import diagnose as diagnose_command
from qlbench.commands import functions as functions_command
from qlbench.commands import pareto as pareto_command
from qlbench.commands import real as real_command
from qlbench.commands import real_lm as real_lm_command
from qlbench.commands import report as report_command
from qlbench.commands import results as results_command
from qlbench.commands import run as run_command
from qlbench.commands import run_suite as suite_command
from qlbench.commands import signal as signal_command
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
    real_lm_command,
    verify_command,
    diagnose_command,
    signal_command,
    bench_command,
)


def build_parser() -> Parser:
    parser = Parser(prog="qlbench")
    parser.add_argument("--version", action="version", version=f"qlbench {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.register(sub)
    parser.description = f"qlbench: {' | '.join(sub.choices)}"  # from what registered, so none is left out
    return parser


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that atomic writes clean up and the message is the same as SIGINT's."""


def _terminate(signum, frame):
    raise Terminated


FULL = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded"}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = None
    previous = (
        signal.signal(signal.SIGTERM, _terminate) if threading.current_thread() is threading.main_thread() else None
    )
    saved = "finished cells are saved and will be skipped on the next run"
    try:
        args = parser.parse_args(argv)
        return args.func(args)
    except UsageError as err:
        print(f"qlbench {args.command}: error: {err}" if args else f"qlbench: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"qlbench: interrupted; {saved}", file=sys.stderr)
        return 130
    except Terminated:
        print(f"qlbench: terminated (SIGTERM); {saved}", file=sys.stderr)
        return 143
    except OSError as err:
        if err.errno not in FULL:
            raise
        where = f" writing {err.filename}" if err.filename else ""
        print(f"qlbench: error: {FULL[err.errno]}{where}; {saved}: free space and run again", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if "torch" in sys.modules:  # a command that ran torch: its teardown before the interpreter's
            from qlbench.engine.runtime import release

            release()


if __name__ == "__main__":
    sys.exit(main())
