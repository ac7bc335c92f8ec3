"""The command-line layer: argument parsing, printing, report files and exit codes, one module per subcommand.

Each subcommand module has `register(subparsers)`, which adds its parser and sets `func(args) -> exit code`;
`qlbench.cli` registers them all. Library modules never print or exit: they return data and raise ValueError,
which a command turns into a `UsageError` (one line on stderr, exit code 2).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
from pathlib import Path

from qlbench import inputs


class UsageError(Exception):
    """Bad command-line input: reported as one line, exit code 2."""


def printable(message: str) -> str:
    """A message as one line the terminal shows as it is: every character that is not printable (newlines, escape
    sequences' ESC, other C0 and C1 controls, Unicode's line separators, lone surrogates of undecodable bytes) as its
    Python escape (\\n, \\x1b, \\u2028). The one place user text in a message (a name, a path, a value) is made
    safe: `qlbench.cli.main` prints every error through it, argparse's own included."""
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii") for c in message
    )


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors: one line, exit 2, no usage dump
        raise UsageError(message)


@contextlib.contextmanager
def usage_errors():
    """Turn a library's ValueError (bad input, with the valid choices) into a one-line UsageError."""
    try:
        yield
    except ValueError as err:
        raise UsageError(str(err)) from None


def check_out(folder, what: str = "output folder") -> None:
    """UsageError (one line) unless `folder` is, or can be created as, a writable folder; creates nothing."""
    from qlbench.records.store import check_writable

    with usage_errors():
        check_writable(Path(folder), what)


def check_out_file(path, what: str = "report") -> None:
    """The one check of an output file path, made before any work: UsageError (one line) unless a file can be
    written at `path` (missing, or a regular file or a link, never a folder, device, pipe or /proc file; its folder
    writable, or creatable). `what`: what the file is, for the message."""
    from qlbench.records.store import check_replaceable

    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{path} is a folder; give a file path for the {what}")
    with usage_errors():
        check_replaceable(path)
    check_out(path.parent, f"folder of the {what}")


NAME_MAX, PATH_MAX = 255, 4096  # bytes of one name in a path, and of a whole path (Linux's and macOS's limits)


def path_arg(text: str) -> Path:
    """argparse type of every path option and argument: the path, refused when empty (Path("") would be the current
    folder: an empty --out wrote into it), or longer than a file system takes (a lookup of it raises, not says no)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty path; give a folder or file")
    if len(os.fsencode(text)) >= PATH_MAX:
        raise argparse.ArgumentTypeError(f"a path of {len(os.fsencode(text)):,} bytes; at most {PATH_MAX - 1:,}")
    if long := [p for p in Path(text).parts if len(os.fsencode(p)) > NAME_MAX]:
        raise argparse.ArgumentTypeError(
            f"a name of {len(os.fsencode(long[0])):,} bytes in the path; at most {NAME_MAX}"
        )
    return Path(text)


def split_list(text: str, what: str = "list") -> list[str]:
    """'a, b' -> ['a', 'b'] (qlbench.inputs.items): UsageError naming `what` for an empty item or an item given
    twice; '' -> [] (each command says what an empty list means)."""
    with usage_errors():
        return inputs.items(text, what)


HP_VALUE_LENGTH = 200  # characters of one --hp value: every setting's value is a number, a word or a short tuple


def parse_overrides(items: list[str]) -> dict:
    """['top_k=3', 'tau_lang=0.5'] -> {'top_k': 3, 'tau_lang': 0.5}; values are Python literals (inf and nan
    included, as floats) or else strings; the method's config then says which values it accepts. A value longer
    than HP_VALUE_LENGTH is refused before it is parsed (a literal nested thousands deep exhausts the parser)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--hp expects key=value, got {item!r}")
        value = value.strip()
        if key.strip() in out:
            raise UsageError(f"--hp {key.strip()} is given twice; give each key once")
        if len(value) > HP_VALUE_LENGTH:
            raise UsageError(f"--hp {key.strip()}: a value of {len(value):,} characters; at most {HP_VALUE_LENGTH}")
        try:
            out[key.strip()] = float(value) if value.lower() in ("inf", "-inf", "nan") else ast.literal_eval(value)
        except (ValueError, SyntaxError, RecursionError, MemoryError):
            out[key.strip()] = value
    return out
