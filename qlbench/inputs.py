"""What people type, parsed once per kind of input, for every command and the library alike (ValueError in one line
naming the input and what is wrong):

    inputs.items("lora, dora", "--methods")        -> ["lora", "dora"]
    inputs.items("lora,,dora", "--methods")        -> ValueError: --methods: an empty item in 'lora,,dora'
    inputs.grid("r=4,8 k=1", ("r", "M", "k"))      -> {"r": (4, 8), "k": (1,)}
    inputs.folder("results.json", "results folder") -> ValueError: results folder results.json is a file, not a folder
"""

from __future__ import annotations

import os
from pathlib import Path


class Refused(Exception):
    """Input refused once read, before any training: a results folder whose finished record was made from another
    version of a card (experiments.runner.finished). The command line prints its message as one line and exits 2, as
    for a bad option; not a ValueError, so that no handler of bad values in between can take it for one."""


def _looked_up(path, what: str) -> Path:
    path = Path(path)
    try:
        os.lstat(path)
    except FileNotFoundError:
        pass
    except OSError as err:  # a name too long, a component that is a file, a loop
        raise ValueError(f"{what} {str(path)[:80]}: {err.strerror or err}") from None
    return path


def folder(path, what: str) -> Path:
    """A folder to read: ValueError naming `what` when it is missing, a file (or anything but a folder), a link to
    nothing, not readable, or a path the system cannot look up (a name too long)."""
    path = _looked_up(path, what)
    if not path.exists():
        gone = path.is_symlink()
        raise ValueError(f"{what} {path} " + ("is a symbolic link to nothing" if gone else "does not exist"))
    if not path.is_dir():
        raise ValueError(f"{what} {path} is a file, not a folder")
    if not os.access(path, os.R_OK | os.X_OK):
        raise ValueError(f"{what} {path} is not readable")
    return path


def file(path, what: str) -> Path:
    """A file to read: ValueError naming `what` when it is missing, a folder, not readable, or a path the system
    cannot look up."""
    path = _looked_up(path, what)
    if not path.exists():
        raise ValueError(f"{what} {path} does not exist")
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder, not a file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{what} {path} is not readable")
    return path


def items(text: str, what: str = "list") -> list[str]:
    """A comma-separated list: each item stripped of whitespace; a list with no item at all ('', ' ', ' , ') -> []
    (each caller says what an empty list means, with the valid choices); ValueError for an empty item beside others
    ('a,,b', 'a,') or an item given twice."""
    out = [v.strip() for v in text.split(",")]
    if not any(out):
        return []
    if "" in out:
        raise ValueError(f"{what}: an empty item in {text!r}")
    if twice := [v for i, v in enumerate(out) if v in out[:i]]:
        raise ValueError(f"{what}: {twice[0]!r} given twice in {text!r}")
    return out


def grid(text: str, axes: tuple[str, ...], what: str = "--grid") -> dict[str, tuple[int, ...]]:
    """'AXIS=V1,V2 AXIS=V1 ...' -> {axis: values}, each value an integer >= 1; ValueError for an empty text, an
    unknown axis (naming the valid ones), an axis given twice, an empty or repeated value, or a value that is not an
    integer >= 1."""
    if not text.strip():
        raise ValueError(f"{what} is empty; write AXIS=V1,V2 with AXIS one of: {', '.join(axes)}")
    out: dict[str, tuple[int, ...]] = {}
    for item in text.split():
        axis, sep, values = item.partition("=")
        if not sep or axis not in axes:
            raise ValueError(f"{what}: bad item {item!r}; write AXIS=V1,V2 with AXIS one of: {', '.join(axes)}")
        if axis in out:
            raise ValueError(f"{what}: axis {axis} given twice")
        parts = items(values, f"{what} axis {axis}")
        try:
            vals = tuple(int(v) for v in parts)
        except ValueError:
            raise ValueError(f"{what} axis {axis}: values must be integers, got {values!r}") from None
        if not vals or min(vals) < 1:
            raise ValueError(f"{what} axis {axis}: give one or more integers >= 1, got {values!r}")
        out[axis] = vals
    return out
