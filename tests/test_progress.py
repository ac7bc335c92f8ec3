"""Progress: a tqdm bar on a terminal; plain lines, never carriage-return redraws, when stderr is not a terminal."""

from __future__ import annotations

import io
import re
import sys

from tqdm import tqdm

from qlbench import cli, progress


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_bar_writes_a_line_every_step_pct_and_one_at_the_end():
    out, clock = io.StringIO(), Clock()
    with progress.LogBar(total=200, desc="adapt lora x3", unit="step", file=out, clock=clock) as bar:
        for _ in range(199):
            clock.t += 0.1
            bar.update(1)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # every 5% of 200 steps = every 10 steps, up to 95% (190 steps); the close writes 199/200
    assert [int(re.search(r": ([\d,]+)/200", line).group(1)) for line in lines] == [*range(10, 200, 10), 199]
    assert lines[0] == "adapt lora x3: 10/200 steps (5%), 0:00:01 elapsed, ETA 0:00:19"
    assert lines[-1].startswith("adapt lora x3: 199/200 steps (100%)")


def test_log_bar_writes_every_interval_without_a_total_and_on_a_new_description():
    out, clock = io.StringIO(), Clock()
    bar = progress.LogBar(desc="pretrain", unit="step", file=out, clock=clock)
    bar.update(5)  # neither 30 s nor a percentage: no line
    clock.t = progress.INTERVAL_S
    bar.update(5)
    bar.set_description("pretrain again")
    bar.set_description("pretrain again")  # unchanged: no line
    bar.close()
    bar.close()  # closed once
    assert out.getvalue().splitlines() == [
        "pretrain: 10 steps, 0:00:30 elapsed",
        "pretrain again: 10 steps, 0:00:30 elapsed",
    ]


def test_log_bar_iterates():
    out = io.StringIO()
    assert list(progress.bar(range(40), desc="bench", file=out)) == list(range(40))
    assert out.getvalue().splitlines()[-1].startswith("bench: 40/40 its (100%)")


def test_bar_picks_tqdm_on_a_terminal_lines_in_a_log_and_nothing_when_disabled():
    assert isinstance(progress.bar(total=3, file=Terminal()), tqdm)
    assert isinstance(progress.bar(total=3, file=io.StringIO()), progress.LogBar)
    off = progress.bar(total=3, file=io.StringIO(), disable=True)
    off.update(3)
    off.set_description("x")
    assert not isinstance(off, tqdm | progress.LogBar)


def test_importing_ipykernel_does_not_make_a_process_a_notebook(monkeypatch):
    """A test runner that executes notebooks imports ipykernel and IPython; its own stderr is still a log."""
    import ipykernel  # noqa: F401
    import IPython  # noqa: F401

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file, whatever terminal pytest runs in
    assert not progress._in_jupyter_kernel()
    assert isinstance(progress.bar(total=3), progress.LogBar)


def test_a_run_logged_to_a_file_has_plain_progress_lines(tmp_path, capsys):
    """`qlbench run ... 2> log`: stderr is not a terminal, so the log holds lines, not carriage-return redraws."""
    argv = ["run", "--function", "matyas", "--methods", "lora", "--budget", "smoke", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    assert re.search(r"^adapt lora x2: [\d,]+/[\d,]+ steps \(100%\)", err, re.M), err
