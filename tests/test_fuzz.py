"""Every command against generated input (hypothesis): options drawn from each command's own parser, values from a
pool of hostile text (empty, blank, nan, inf, negative, huge, repeated list items, a grid axis twice, a device, a
virtual file system, a file where a folder is read, non-ASCII, very long, escape sequences and newlines, a pipe, a
per-seed CSV without rows or breaking its schema). The promise under test: bad input is one printable line on stderr
with exit code 2, before any work, nothing is a traceback, and nothing is written outside --out (in the example's
folder or the working directory; what a command writes elsewhere, a shared cache, is not seen here).

Work is stopped where it would start: pretraining, training (`engine.pretrain`, every binding of `engine.fit`) and the
benchmark's timed cases raise WouldWork, which counts as input accepted. Anything else an example raises is a bug.
"""

from __future__ import annotations

import argparse
import gzip
import os

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from qlbench import cli  # noqa: E402

pytestmark = pytest.mark.faults  # `make test-faults` (CI): a few hundred CLI calls


class WouldWork(Exception):
    """Raised where a command would start pretraining, training or timing: its input was accepted."""


def _stop(*args, **kwargs):
    raise WouldWork


# hostile values; "{file}" and "{folder}" become an existing file and folder of the example's own
VALUES = (
    *("", " ", "0", "-1", "1", "2", "nan", "inf", "-inf", "1e309", "3.5", "99999999999999999999"),
    *("abc", "a,,b", "lora,lora", "lora,", ",", "matyas", "matyas,levy", "deep-narrow", "transformer", "smoke"),
    *("zoo-4", "r=4 r=4", "r=", "r=0", "k=1,1", "lora", "peft:nope", "peft:adalora", "nope.module:X", "kaiming"),
    *("/dev/full", "/proc/qlb/x", "{file}", "{folder}", "{file}/x", "ü×±µ", "x" * 300, "top_k=99", "r=-1"),
    *("lora\x1b]0;t\x07", "two\nlines", "\x1b[2J", "r\x1b=4", "{fifo}", "{header_csv}", "{bad_csv}", "{folder}/x.csv"),
)  # the last: escape sequences and newlines (shown escaped), a pipe, a per-seed CSV without rows, one breaking the
# schema
SKIP_OPTIONS = {"-h", "--help", "--peft-types", "--version", "--ray-address"}  # help exits; no cluster here


def options(command: str) -> list[argparse.Action]:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices[command]._actions if not (set(a.option_strings) & SKIP_OPTIONS)]


COMMANDS = ["run", "sweep", "suite", "pareto", "ablate", "report", "results", "compare", "items", "verify"]
COMMANDS += ["diagnose", "signal", "bench", "suites", "functions", "real", "real-lm"]


def argv_for(command: str, draw) -> list[str]:
    argv = [command]
    acts = options(command)
    chosen = draw(st.lists(st.sampled_from(acts), min_size=1, max_size=4, unique_by=id)) if acts else []
    for a in [a for a in acts if not a.option_strings and a.nargs != "?"] + chosen:  # positionals always
        value = draw(st.sampled_from(VALUES))
        if not a.option_strings:
            argv.insert(1, value)
        elif a.nargs == 0:
            argv.append(a.option_strings[0])
        else:
            argv += [a.option_strings[0], value]
    return argv


@pytest.fixture
def stopped(monkeypatch):
    import importlib

    from qlbench import bench, engine
    from qlbench.bench import schedule

    cache, loop = (importlib.import_module(f"qlbench.engine.{m}") for m in ("cache", "loop"))
    for module, name in ((engine, "fit"), (cache, "fit"), (loop, "fit"), (engine, "pretrain")):
        monkeypatch.setattr(module, name, _stop)
    monkeypatch.setattr(cache, "pretrain", _stop)
    monkeypatch.setattr(bench, "run", _stop)
    monkeypatch.setattr(schedule, "run", _stop)


def written(root) -> dict:
    """Every file under `root` with its (size, modification time)."""
    from pathlib import Path

    return {str(f): (f.stat().st_size, f.stat().st_mtime_ns) for f in Path(root).rglob("*") if f.is_file()}


def inside(path: str, folder: str | None) -> bool:
    """Whether `path` is `folder` or under it (`folder` as given on the command line)."""
    import os.path

    if not folder:
        return False
    folder = os.path.realpath(folder)
    return os.path.realpath(path) == folder or os.path.realpath(path).startswith(folder + os.sep)


# CI: a fixed seed (derandomize); `make fuzz` draws new examples (QLBENCH_FUZZ=random) and more of them. A case it
# finds stays as an explicit example in tests/test_cli.py (the path names over 255 bytes came from here).
RANDOM = os.environ.get("QLBENCH_FUZZ") == "random"


@pytest.mark.parametrize("command", COMMANDS)
@settings(
    max_examples=300 if RANDOM else 60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=not RANDOM
)
@given(data=st.data())
def test_generated_input_is_one_line_or_accepted_never_a_traceback(command, data, stopped, tmp_path_factory, capsys):
    where = tmp_path_factory.mktemp("fuzz")
    (where / "file").write_text("{}")
    (where / "folder").mkdir()
    os.mkfifo(where / "fifo.csv")
    with gzip.open("docs/results/baselines/zoo-v1-aa/per-seed.csv.gz", "rt") as f:
        header, first = f.readline().rstrip("\n"), f.readline().rstrip("\n")
    (where / "header.csv").write_text(header + "\n")
    cells = first.split(",")
    cells[header.split(",").index("best_test_mse")] = "abc"  # a string where an MSE goes
    (where / "bad.csv").write_text(f"{header}\n{','.join(cells)}\n")
    paths = {"file": str(where / "file"), "folder": str(where / "folder"), "fifo": str(where / "fifo.csv")}
    paths |= {"header_csv": str(where / "header.csv"), "bad_csv": str(where / "bad.csv")}
    argv = [a.format(**paths) if "{" in a and "}" in a else a for a in argv_for(command, data.draw)]
    if "--out" not in argv and any("--out" in a.option_strings for a in options(command)):
        argv += ["--out", str(where / "out")]
    (where / "cwd").mkdir()
    before = written(where)
    capsys.readouterr()
    cwd = os.getcwd()
    os.chdir(where / "cwd")  # a relative default (./results) would land here
    try:
        code = cli.main(argv)
    except WouldWork:
        code = None
    finally:
        os.chdir(cwd)
    out, err = capsys.readouterr()
    assert "Traceback" not in err, (argv, err)
    out_dir = argv[argv.index("--out") + 1] if "--out" in argv else None
    outside = [f for f, stamp in written(where).items() if before.get(f) != stamp and not inside(f, out_dir)]
    assert outside == [], (argv, outside)  # nothing written outside --out (in the example's folder or the cwd)
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("qlbench") and lines[0].isprintable(), (argv, err)
    else:
        assert code in (None, 0, 1), (argv, code, err)
