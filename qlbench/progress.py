"""Progress of long work: a tqdm bar on a terminal, plain lines in a log.

    with progress.bar(total=steps, desc="adapt", unit="step", disable=not show) as bar:
        bar.update(n)

On a terminal this is `tqdm.auto.tqdm` (a redrawn bar with ETA). When stderr is not a terminal (CI, `nohup`, a
`make run > log 2>&1` file) a redrawn bar fills the file with carriage returns, so `LogBar` writes one plain line
instead every `STEP_PCT` percent of the total or every `INTERVAL_S` seconds, whichever comes first, one when the
description changes and one at the end:

    adapt lora x3: 1,120/5,600 steps (20%), 0:00:41 elapsed, ETA 0:02:44
"""

from __future__ import annotations

import datetime as dt
import sys
import time
from collections.abc import Callable, Iterable

from tqdm.auto import tqdm

STEP_PCT = 5  # a log line every this many percent of the total ...
INTERVAL_S = 30.0  # ... or every this many seconds, whichever comes first


def _clock(seconds: float) -> str:
    return str(dt.timedelta(seconds=round(seconds)))


class LogBar:
    """The part of tqdm's interface qlbench uses (update, set_description, iteration, context manager, close),
    written as plain lines to `file`."""

    def __init__(
        self,
        iterable: Iterable | None = None,
        *,
        total: int | None = None,
        desc: str = "",
        unit: str = "it",
        file=None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.iterable = iterable
        self.total = len(iterable) if total is None and hasattr(iterable, "__len__") else total
        self.desc, self.unit, self.n = desc, unit, 0
        self.file = file if file is not None else sys.stderr  # None where stderr is closed
        self.clock = clock
        self.start = self.last_time = clock()
        self.last_pct = 0
        self.written = None  # n at the last line written
        self.closed = False

    def line(self) -> str:
        elapsed = self.clock() - self.start
        head = f"{self.desc}: " if self.desc else ""
        if not self.total:
            return f"{head}{self.n:,} {self.unit}s, {_clock(elapsed)} elapsed"
        pct = 100 * self.n / self.total
        eta = f", ETA {_clock(elapsed * (self.total - self.n) / self.n)}" if 0 < self.n < self.total else ""
        return f"{head}{self.n:,}/{self.total:,} {self.unit}s ({pct:.0f}%), {_clock(elapsed)} elapsed{eta}"

    def write(self) -> None:
        if self.file is not None:  # stderr closed (`2>&-`): no line (a failing one is the CLI's QuietStream's)
            print(self.line(), file=self.file, flush=True)
        self.written, self.last_time = self.n, self.clock()
        self.last_pct = 100 * self.n // self.total if self.total else 0

    def update(self, n: int = 1) -> None:
        self.n += n
        due_pct = bool(self.total) and 100 * self.n // self.total >= self.last_pct + STEP_PCT
        if due_pct or self.clock() - self.last_time >= INTERVAL_S:
            self.write()

    def set_description(self, desc: str) -> None:
        if desc != self.desc:
            self.desc = desc
            self.write()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.written != self.n:
                self.write()

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update()

    def __enter__(self) -> LogBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Off:
    """A disabled bar: every call does nothing."""

    def __init__(self, iterable=None):
        self.iterable = iterable

    def update(self, n: int = 1) -> None:
        pass

    def set_description(self, desc: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __iter__(self):
        return iter(self.iterable)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def _in_jupyter_kernel() -> bool:
    """Whether this process is a Jupyter kernel (as tqdm.autonotebook tells): an IPython shell run by IPKernelApp.
    Importing ipykernel or IPython (a test runner that executes notebooks does) is not enough."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def bar(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    disable: bool = False,
    leave: bool = True,
    file=None,
):
    """A progress bar on `file` (default stderr): tqdm when it is a terminal, a `LogBar` otherwise, nothing when
    `disable`; in a Jupyter kernel tqdm's notebook widget. `leave` (tqdm's: keep the finished bar on screen) only
    applies to tqdm: a log keeps every line."""
    if disable:
        return _Off(iterable)
    stream = file if file is not None else sys.stderr
    notebook = stream is sys.stderr and _in_jupyter_kernel()
    if notebook or getattr(stream, "isatty", lambda: False)():
        return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, file=stream)
    return LogBar(iterable, total=total, desc=desc, unit=unit, file=stream)
