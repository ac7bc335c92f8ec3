"""qlbench's command line: one subcommand per module of qlbench/commands/ (COMMANDS; `qlbench --help` lists them).

Bad input (unknown function, arch, method, budget, device, hyper-parameter, or a value out of range) prints one
line naming the problem and the valid choices, and exits with code 2; no traceback. The subcommands live in
qlbench/commands/, one module each.
"""

from __future__ import annotations

import codecs
import errno
import os
import signal
import sys
import threading
import traceback

from qlbench import __version__
from qlbench.commands import Parser, UsageError, printable
from qlbench.commands import ablate as ablate_command
from qlbench.commands import bench as bench_command
from qlbench.commands import compare as compare_command
from qlbench.commands import diagnose as diagnose_command
from qlbench.commands import functions as functions_command
from qlbench.commands import items as items_command
from qlbench.commands import methods as methods_command
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
from qlbench.inputs import Refused
from qlbench.records.store import Unreadable

# run registers run and sweep
COMMANDS = (
    functions_command,
    methods_command,
    suites_command,
    run_command,
    suite_command,
    results_command,
    report_command,
    compare_command,
    items_command,
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

# what a table's characters become where the output's encoding lacks them (PYTHONIOENCODING=ascii, a C locale)
ASCII = {"×": "x", "±": "+/-", "µ": "u", "†": "+", "‡": "++", "≤": "<=", "≥": ">=", "–": "-", "—": "-", "…": "..."}
ASCII |= {"→": "->", "←": "<-", "≈": "~", "²": "^2", "√": "sqrt", "·": ".", "θ": "theta", "λ": "lambda", "š": "s"}


def _ascii(err: UnicodeError) -> tuple[str, int]:
    """Codec error handler "qlbench-ascii": each character the output cannot encode as its ASCII spelling, else ?."""
    return "".join(ASCII.get(c, "?") for c in err.object[err.start : err.end]), err.end


codecs.register_error("qlbench-ascii", _ascii)


class QuietStream:
    """stderr as a command writes to it: a write or flush that fails (a full device, a closed pipe) is dropped, so a
    progress or log line never stops the work; everything else is the stream's own."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except (OSError, ValueError):
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name):
        return getattr(self.stream, name)


COERCED = ("C.UTF-8", "C.utf8")  # what Python sets LC_CTYPE to when it starts under the C locale (PEP 538)


def plain_locale(environ=os.environ) -> bool:
    """Whether the user's locale is the plain C (or POSIX) one: LC_ALL, else LC_CTYPE, else LANG, as the C library
    reads them, seen through Python's coercion (an LC_CTYPE of C.UTF-8 beside a C or missing LANG was set by Python,
    not the user). Python then writes UTF-8 anyway, which such a terminal shows as garbage."""
    if environ.get("LC_ALL"):
        value = environ["LC_ALL"]
    else:
        ctype, lang = environ.get("LC_CTYPE"), environ.get("LANG")
        coerced = ctype in COERCED and lang in (None, "", "C", "POSIX")
        value = (lang or "C") if coerced else (ctype or lang or "C")
    return value in ("C", "POSIX")


def plain_output() -> None:
    """stdout and stderr print whatever their encoding can hold: a character it lacks is written as ASCII's spelling
    of it (× as x, ± as +/-), never a UnicodeEncodeError; a terminal under a C or POSIX locale (`plain_locale`) gets
    ASCII whatever encoding Python chose (a file or pipe keeps it). A UTF-8 terminal is unaffected."""
    plain = plain_locale()
    for stream in (sys.stdout, sys.stderr):
        try:
            if plain and stream.isatty():
                stream.reconfigure(encoding="ascii", errors="qlbench-ascii")
            else:
                stream.reconfigure(errors="qlbench-ascii")
        except (AttributeError, ValueError, OSError):  # a stream without reconfigure (a test's capture), or closed
            pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = None
    previous = (
        signal.signal(signal.SIGTERM, _terminate) if threading.current_thread() is threading.main_thread() else None
    )
    saved = "finished cells are saved and will be skipped on the next run"
    plain_output()
    stderr = sys.stderr
    if stderr is not None and not isinstance(stderr, QuietStream):
        sys.stderr = QuietStream(stderr)
    try:
        args = parser.parse_args(argv)
        args.given = {a.split("=", 1)[0] for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")}
        code = args.func(args)
        if sys.stdout is not None:  # None where stdout is closed (`>&-`): the records are the output
            sys.stdout.flush()  # a reader that left (`| head`) fails here, in the handlers below, not in Python's exit
        return code
    except (UsageError, Refused, Unreadable) as err:
        message = printable(str(err))  # user text in it (a name, a path) stays one line, no escape sequences
        print(f"qlbench {args.command}: error: {message}" if args else f"qlbench: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"qlbench: interrupted; {saved}", file=sys.stderr)
        return 130
    except Terminated:
        print(f"qlbench: terminated (SIGTERM); {saved}", file=sys.stderr)
        return 143
    except BrokenPipeError:  # the reader left (`qlbench functions | head`): nothing more to write, no traceback
        try:  # stdout onto /dev/null, or the interpreter's exit flushes into the closed pipe and prints its error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # a stdout without a file descriptor of its own
            pass
        return 1
    except OSError as err:
        if err.errno not in FULL:
            raise
        if not err.filename:  # the command's own output (stdout on a full device): no file of a record
            print(f"qlbench: error: {FULL[err.errno]} writing the output", file=sys.stderr)
            return 1
        where = f" writing {printable(str(err.filename))}"
        print(f"qlbench: error: {FULL[err.errno]}{where}; {saved}: free space and run again", file=sys.stderr)
        return 1
    finally:
        sys.stderr = stderr
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if "torch" in sys.modules:  # a command that ran torch: its teardown before the interpreter's
            from qlbench.engine.runtime import release

            release()


def used_cuda() -> bool:
    """Whether this process initialised CUDA (torch left unimported when the command did not need it)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def exit_status(err: BaseException) -> int:
    """The status the interpreter would exit with for an exception that ended `main`, its message printed as the
    interpreter prints it: SystemExit's code (None: 0; a message: printed, 1), else the traceback and 1."""
    if not isinstance(err, SystemExit):
        traceback.print_exception(err)
        return 1
    if err.code is None or isinstance(err.code, int):
        return err.code or 0
    print(err.code, file=sys.stderr)
    return 1


def entry() -> None:
    """The `qlbench` console script: `main`, then the exit. A process that initialised CUDA leaves through
    os._exit once its output is flushed, skipping the interpreter's teardown, which can crash after CUDA use
    (docs/design.md, "Why a CUDA process leaves through os._exit"); every file a command writes is closed by then
    and `main` has run `release`. A process that never touched CUDA exits as the interpreter always does."""
    try:
        code = main()
    except BaseException as err:
        if not used_cuda():
            raise
        code = exit_status(err)
    else:
        if not used_cuda():
            sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # a closed pipe (`| head`), a closed or absent stream
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
