"""The fault suite: bad input, damaged files and killed or racing processes, as a new user and a hostile one would
try them (docs/faults.md lists the cases). Every case ends in one line, never a traceback; nothing finished is
lost; a damaged file is set aside and recomputed; nothing that was refused leaves a folder or a temp file behind.
The property-based test at the end feeds random damage to the files of a finished results folder. The slower
cases carry the `faults` marker: `make test-faults` runs them (CI does, after `make test`)."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qlbench import adapters, cli
from qlbench.experiments import adapted, planning
from qlbench.records import results, store
from qlbench.records.store import DamagedFile, Store

from helpers import one_line_error

SMOKE = ["--function", "matyas", "--arch", "deep-narrow", "--budget", "smoke", "--no-progress", "--threads", "1"]


def run(out: Path, *args) -> int:
    return cli.main(["run", *SMOKE, "--out", str(out), *args])


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A results folder with finished smoke cells of lora and queryable (records, adapter files, backbones)."""
    out = tmp_path_factory.mktemp("finished")
    assert run(out, "--methods", "lora,queryable") == 0
    return out


@pytest.fixture
def folder(finished, tmp_path) -> Path:
    """A private copy of `finished` to damage."""
    shutil.copytree(finished, tmp_path / "r")
    return tmp_path / "r"


def record(out: Path, method: str = "lora") -> Path:
    (path,) = Store(out).records(method=method)
    return path


def asides(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f"{path.name}.damaged-*"))


def temps(out: Path) -> list[Path]:
    return sorted(Path(out).rglob("*.tmp"))


# ---------------------------------------------------------------------------------------------------------------
# 1. Unbounded resources are refused before anything is allocated.


@pytest.mark.parametrize(
    "argv",
    [
        ["run", *SMOKE, "--seeds", "100000000000"],
        ["run", *SMOKE, "--hp", "r=100000000"],
        ["run", *SMOKE, "--methods", "queryable", "--hp", "n_atoms=100000000"],
        ["run", *SMOKE, "--methods", "hyra", "--hp", "hyper_hidden=100000000"],  # allocated float64 zeros on CPU
        ["run", *SMOKE, "--methods", "replora", "--hp", "r=100000000"],
        ["sweep", "--functions", "matyas,levy", "--budget", "smoke", "--seeds", "100000000000"],
        ["suite", "--suite", "zoo-4", "--budget", "smoke", "--methods", "lora", "--seeds", "100000000000"],
    ],
)
def test_a_plan_larger_than_memory_is_refused_with_its_estimate(tmp_path, capsys, argv):
    out = tmp_path / "out"
    line = one_line_error(capsys, [*argv, "--out", str(out)])
    assert "needs at least" in line and "GiB" in line and "available" in line, line
    assert not out.exists()  # refused before any folder is made


def test_the_memory_estimate_counts_every_trainable_number_four_times():
    # independent count: LoRA r=8 on deep-narrow adapts 32 hidden 32x32 layers: 32 * (8*32 + 32*8) trainable
    sizes = planning.dry_build("deep-narrow", {"lora": adapters.get("lora").make_config()})
    held, trainable = sizes["lora"]
    assert trainable == 32 * (8 * 32 + 32 * 8)
    need = planning.plan_bytes(sizes, 10, "float64")
    assert need == 10 * 8 * (held + 3 * trainable + planning.DATA_PER_MEMBER)


# ---------------------------------------------------------------------------------------------------------------
# 2. Output paths are checked before any work; a full disk loses nothing finished.


@pytest.mark.parametrize(
    "argv",
    [
        ["report", "{finished}", "--out", "{file}/report"],
        ["diagnose", "{finished}", "--function", "matyas", "--method", "queryable", "--out", "{file}/d"],
        ["verify", "--results", "{finished}", "--method", "queryable", "--out", "{file}/v.json"],
        ["verify", "--results", "{finished}", "--method", "queryable", "--out", "{tmp}"],
        ["verify", "--budget", "smoke", "--out", "{file}/v.json"],
        ["signal", "--function", "matyas", "--threads", "1", "--out", "{file}/s"],
        ["bench", "--quick", "--out", "{file}/b"],
        ["ablate", "--function", "matyas", "--out", "{file}"],
        ["real", "--out", "{file}/q"],
        ["run", *SMOKE, "--out", "{file}/r"],
        ["suite", "--suite", "zoo-4", "--out", "{file}/s"],
        ["pareto", "--function", "matyas", "--out", "{file}/p"],
        ["results", "{file}"],
        ["signal", "--function", "matyas", "--threads", "1", "--out", "{tmp}/s", "--figure", "{tmp}"],
        ["signal", "--function", "matyas", "--threads", "1", "--out", "{tmp}/s", "--figure", "{file}/x.png"],
        ["signal", "--function", "matyas", "--threads", "1", "--out", "{tmp}/s", "--figure", "{fifo}"],
        ["results", "{finished}", "--per-seed", "{file}/x.csv"],
        ["results", "{finished}", "--per-seed", "{tmp}/dir.csv"],
        ["results", "{finished}", "--per-seed", "{fifo}"],
    ],
)
def test_an_impossible_destination_fails_in_one_line_before_any_work(finished, tmp_path, capsys, argv):
    afile = tmp_path / "afile"
    afile.write_text("x")
    (tmp_path / "dir.csv").mkdir()
    os.mkfifo(tmp_path / "fifo.csv")  # a pipe: writing it would block, and it is no file to replace
    fill = dict(finished=finished, file=afile, tmp=tmp_path, fifo=tmp_path / "fifo.csv")
    t0 = time.perf_counter()
    line = one_line_error(capsys, [a.format(**fill) for a in argv])
    assert str(afile) in line or str(tmp_path) in line, line
    assert time.perf_counter() - t0 < 30  # refused up front, not after training (bench alone measures for minutes)


def test_a_full_disk_keeps_every_finished_record_and_says_so_in_one_line(folder, capsys, monkeypatch):
    lora = record(folder)
    before = lora.read_bytes()
    replace = os.replace

    def full(src, dst):  # the disk fills when the queryable cell's files are committed
        if "/dora/" in str(dst):
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return replace(src, dst)

    monkeypatch.setattr(store.os, "replace", full)
    code = cli.main(["run", *SMOKE, "--out", str(folder), "--methods", "lora,dora", "--force"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    (line,) = [m for m in err.splitlines() if "disk is full" in m]
    assert "/dora/" in line and "finished cells are saved" in line
    assert lora.read_bytes() != before and results.read_record(lora)  # lora finished again and is whole
    assert not Store(folder).records(method="dora") and not temps(folder)


def test_a_disk_that_fills_while_an_adapter_is_written_is_the_disk_full_line(folder, capsys, monkeypatch):
    real_open = open

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    def full_open(path, mode="r", *args, **kwargs):  # adapter weights (torch) fill the disk; JSON still writes
        f = real_open(path, mode, *args, **kwargs)
        return Full(f) if "b" in mode and "w" in mode else f

    monkeypatch.setattr(store, "open", full_open, raising=False)
    code = cli.main(["run", *SMOKE, "--out", str(folder), "--methods", "dora", "--force"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    (line,) = [m for m in err.splitlines() if "disk is full" in m]
    assert "/dora/" in line and line.endswith("free space and run again") and not temps(folder)


READS = {  # what each command reads of a finished results folder (run: the resumed cell's record and adapter)
    "results": ["record"],
    "report": ["record"],
    "run": ["record", "adapter"],
    "verify": ["record", "adapter", "backbone"],
}


@pytest.mark.parametrize("command, what", [(c, w) for c, ws in READS.items() for w in ws])
def test_a_file_this_process_may_not_read_is_one_line_naming_it(folder, capsys, monkeypatch, what, command):
    """A record, adapter or backbone of mode 000 (read as another user): the one guarded reader of each kind says so
    in one line, whichever command reads it (as root, modes do not refuse: the refusal is planted)."""
    target = {
        "record": record(folder, "queryable"),
        "adapter": Store.model_of(record(folder, "queryable")),
        "backbone": next((folder / "backbones").rglob("*.pt")),
    }[what]
    real_open, real_load = open, store.torch.load

    def refuse(path):
        if Path(path) == target:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(store, "open", lambda p, *a, **k: refuse(p) or real_open(p, *a, **k), raising=False)
    monkeypatch.setattr(store.torch, "load", lambda p, *a, **k: refuse(p) or real_load(p, *a, **k))
    argv = {
        "results": ["results", str(folder)],
        "report": ["report", str(folder), "--no-figures"],
        "run": ["run", *SMOKE, "--out", str(folder), "--methods", "queryable"],
        "verify": ["verify", "--results", str(folder), "--method", "queryable", "--function", "matyas"],
    }[command]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert f"cannot read {target}: permission denied" in line, line


def _planted(name: str, monkeypatch) -> None:
    """Break one shared guard as a careless edit would: its check gone, the raw behaviour left."""
    from qlbench import commands
    from qlbench.commands import results as results_command
    from qlbench.commands import signal as signal_command
    from qlbench.records import per_seed

    if name == "quoting":
        monkeypatch.setattr(cli, "printable", lambda message: message)
    elif name == "output path":
        for module in (commands, results_command, signal_command):
            monkeypatch.setattr(module, "check_out_file", lambda *a, **k: None)
    elif name == "guarded reader":
        monkeypatch.setattr(store, "read_json", lambda path: json.load(store.open(path)))  # open: the test's
        monkeypatch.setattr(results, "read_json", store.read_json)
    elif name == "schema":
        monkeypatch.setattr(per_seed, "check", lambda frame, where: None)


@pytest.mark.parametrize("guard", ["quoting", "output path", "guarded reader", "schema"])
@pytest.mark.parametrize("planted", [False, True])
def test_each_shared_guard_holds_its_case_and_a_planted_regression_of_it_fails(
    folder, tmp_path, capsys, monkeypatch, guard, planted
):
    """Each cause's one place (docs/faults.md), checked on a case of its own, and the same case with the guard broken:
    the check must tell the two apart (a check that passes either way would prove nothing)."""
    bad = tmp_path / "bad.csv"
    rows = per_seed_rows()
    rows[1][rows[0].index("best_test_mse")] = "abc"
    bad.write_text("\n".join(",".join(r) for r in rows) + "\n")
    (tmp_path / "dir.csv").mkdir()
    target = record(folder)
    argv = {
        "quoting": ["report", f"/nonexistent/\x1b[2J{tmp_path}"],
        "output path": ["results", str(folder), "--per-seed", str(tmp_path / "dir.csv")],
        "guarded reader": ["results", str(folder)],
        "schema": ["report", str(bad), "--out", str(tmp_path / "r")],
    }[guard]
    if guard == "guarded reader":
        real_open = open

        def refuse(path, *a, **k):
            if Path(path) == target:
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real_open(path, *a, **k)

        monkeypatch.setattr(store, "open", refuse, raising=False)  # what the store's reader opens files with
    if planted:
        _planted(guard, monkeypatch)
    try:
        code = cli.main(argv)
    except Exception:  # noqa: BLE001 - a planted regression may end in a traceback
        code = None
    err = capsys.readouterr().err.strip()
    held = code == 2 and len(err.splitlines()) == 1 and err.isprintable()
    held &= {
        "quoting": "\\x1b[2J" in err,
        "output path": "is a folder" in err,
        "guarded reader": "permission denied" in err,
        "schema": "line 2: column best_test_mse" in err,
    }[guard]
    assert held is not planted, (guard, planted, code, err)


def per_seed_rows() -> list[list[str]]:
    import gzip

    with gzip.open("docs/results/baselines/zoo-v1-aa/per-seed.csv.gz", "rt") as f:
        return [f.readline().rstrip("\n").split(",") for _ in range(2)]


def test_stdout_on_a_full_device_is_the_output_not_the_cells(capsys, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(cli.sys.stdout, "flush", full)
        assert cli.main(["functions"]) == 1
    assert capsys.readouterr().err.strip() == "qlbench: error: the disk is full writing the output"


# ---------------------------------------------------------------------------------------------------------------
# 3. Records are validated by content: a wrong one is set aside and recomputed, and readers say so.


def _edit(rec: dict, how: str) -> None:
    seeds = rec["train_info"]["per_seed"]
    if how == "per-seed strings":
        rec["train_info"]["per_seed"] = ["0.1", "0.2"]
    elif how == "missing best_train_mse":
        del seeds[0]["best_train_mse"]
    elif how == "null best_train_mse on a finished seed":
        seeds[0]["best_train_mse"] = None
    elif how == "status 42":
        rec["train_info"]["status"] = 42
    elif how == "edited config_hash":
        rec["run_info"]["config_hash"] = "0" * 16
    elif how == "edited config":
        rec["run_info"]["config"]["method_config"]["r"] = 4
    elif how == "a seed dropped":
        seeds.pop()
    elif how == "ok with a diverged seed":
        seeds[0]["status"] = "diverged"
    elif how == "curve of strings":
        seeds[1]["test_curve"] = ["x"]
    elif how == "cost a string":
        rec["train_info"]["cost"] = "cheap"
    elif how == "peak memory a word":
        rec["train_info"]["cost"]["peak_train_bytes"] = "big"
    elif how == "a latency a string":
        rec["train_info"]["cost"]["latency_s_per_sample"]["1"]["adapted"] = "fast"
    else:
        raise AssertionError(how)


DAMAGE = (
    "per-seed strings",
    "missing best_train_mse",
    "null best_train_mse on a finished seed",
    "status 42",
    "edited config_hash",
    "edited config",
    "a seed dropped",
    "ok with a diverged seed",
    "curve of strings",
    "cost a string",
    "peak memory a word",
    "a latency a string",
)


@pytest.mark.faults  # slow: run by `make test-faults` (CI)
@pytest.mark.parametrize("how", DAMAGE)
def test_a_record_with_wrong_contents_is_set_aside_listed_and_recomputed(folder, capsys, how):
    path = record(folder)
    rec = json.loads(path.read_text())
    _edit(rec, how)
    path.write_text(json.dumps(rec))
    with pytest.raises(DamagedFile, match="is damaged"):
        results.read_record(path)
    for argv in (["results", str(folder)], ["report", str(folder), "--out", str(folder / "rep")]):
        assert cli.main(argv) == 0
        err = capsys.readouterr().err
        assert f"{path} is damaged" in err and "Traceback" not in err
    assert run(folder, "--methods", "lora") == 0
    err = capsys.readouterr().err
    assert f"{path} is damaged" in err and "moved to" in err and "recomputed" in err
    assert len(asides(path)) == 1 and results.read_record(path)["run_info"]["config"]["method"] == "lora"


def test_results_load_counts_a_diverged_seed_as_inf(folder):
    path = record(folder)
    rec = json.loads(path.read_text())
    rec["train_info"]["status"] = "diverged"
    rec["train_info"]["per_seed"][1] |= {"status": "diverged", "diverged_epoch": 2}  # its finite best values stay
    path.write_text(json.dumps(rec))
    frame = results.load([path]).set_index("seed")
    assert frame.loc[1, "best_train_mse"] == frame.loc[1, "test_at_best_train"] == float("inf")
    assert 0 < frame.loc[0, "best_train_mse"] < float("inf")


# ---------------------------------------------------------------------------------------------------------------
# 4. Model files are validated by content.


def _damage_model(folder: Path, how: str) -> Path:
    path = Store.model_of(record(folder))
    saved = torch.load(path)
    if how == "empty dict":
        saved = {}
    elif how == "another cell's weights":
        saved = torch.load(Store.model_of(record(folder, "queryable")))
    elif how == "another config's hash":
        saved["config_hash"] = "f" * 16
    elif how == "a tensor cut":
        name = next(iter(saved["state"]))
        saved["state"][name] = saved["state"][name][..., :1]
    elif how == "one seed's rows":
        saved["state"] = {k: v[:1] for k, v in saved["state"].items()}
    elif how == "a list":
        saved = [1, 2, 3]
    torch.save(saved, path)
    return path


MODEL_DAMAGE = (
    "empty dict",
    "another cell's weights",
    "another config's hash",
    "a tensor cut",
    "one seed's rows",
    "a list",
)


@pytest.mark.parametrize("how", ["empty dict", "another config's hash", "a list", "truncated"])
def test_results_lists_a_damaged_adapter_as_damaged_and_says_so(folder, capsys, how):
    if how == "truncated":
        path = Store.model_of(record(folder))
        path.write_bytes(path.read_bytes()[:100])
    else:
        path = _damage_model(folder, how)
    assert cli.main(["results", str(folder)]) == 0
    out, err = capsys.readouterr()
    (row,) = [line for line in out.splitlines() if "| lora " in line]
    assert row.split("|")[-2].strip() == "damaged" and f"{path} is damaged" in err and "Traceback" not in err
    assert path.exists() and not asides(path)  # listed, not moved: `run` sets it aside


@pytest.mark.faults  # slow: run by `make test-faults` (CI)
@pytest.mark.parametrize("how", MODEL_DAMAGE)
def test_an_adapter_file_with_wrong_contents_is_set_aside_and_recomputed(folder, capsys, how):
    path = _damage_model(folder, how)
    damaged = path.read_bytes()
    with pytest.raises(ValueError, match="is damaged"):  # a reader that loads it says so in one line
        adapted.load_adapted(record(folder))
    assert len(asides(path)) == 1
    with pytest.raises(ValueError, match="was damaged and set aside as"):  # the next reader: not "no saved weights"
        adapted.load_adapted(record(folder))
    path.write_bytes(damaged)
    capsys.readouterr()
    assert run(folder, "--methods", "lora") == 0
    err = capsys.readouterr().err
    assert f"{path} is damaged" in err and "Traceback" not in err
    assert len(asides(path)) == 2
    model, data, rec = adapted.load_adapted(record(folder))  # recomputed and whole
    assert rec["train_info"]["status"] == "ok"


@pytest.mark.faults  # slow: run by `make test-faults` (CI)
@pytest.mark.parametrize(
    "how",
    [
        "empty dict",
        "deep-narrow weights cut",
        "no source MSEs",
        "another member's file",
        "NaN weights",
        "no member key",
    ],
)
def test_a_backbone_file_with_wrong_contents_is_set_aside_and_retrained(folder, capsys, how):
    """Damage found by content, shape or identity: a file copied over another member's (same shapes) is found by
    the member key it holds, NaN weights by their values."""
    backbone, other = sorted(Store(folder).backbone_dir.glob("*.pt"))[:2]
    saved = torch.load(backbone)
    if how == "empty dict":
        saved = {}
    elif how == "deep-narrow weights cut":
        saved["state"] = dict(list(saved["state"].items())[:-1])
    elif how == "another member's file":
        saved = torch.load(other)
    elif how == "NaN weights":
        name = next(iter(saved["state"]))
        saved["state"][name] = torch.full_like(saved["state"][name], float("nan"))
    elif how == "no member key":
        del saved["key"]
    else:
        del saved["source_test_mse"]
    torch.save(saved, backbone)
    assert run(folder, "--methods", "lora", "--force") == 0
    err = capsys.readouterr().err
    assert f"{backbone} is damaged" in err and "retraining" in err and "Traceback" not in err
    assert len(asides(backbone)) == 1 and "state" in torch.load(backbone)


@pytest.mark.faults  # slow: run by `make test-faults` (CI)
@pytest.mark.parametrize("kind", ["a folder", "a symbolic-link loop"])
def test_a_record_or_backbone_that_is_not_a_file_is_reported_and_recomputed(folder, capsys, kind):
    """A folder or a link loop where a record or a backbone file should be: `results` and `report` say so in one
    line each, `run` sets it aside (or replaces the link) and recomputes; never a traceback."""
    rec, backbone = record(folder), sorted(Store(folder).backbone_dir.glob("*.pt"))[0]
    for path in (rec, backbone):
        path.unlink()
        path.mkdir() if kind == "a folder" else path.symlink_to(path)
    capsys.readouterr()
    cli.main(["results", str(folder)])
    cli.main(["report", str(folder), "--no-figures"])
    err = capsys.readouterr().err
    assert "Traceback" not in err and ("is damaged" in err or kind != "a folder"), err
    assert run(folder, "--methods", "lora") == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert rec.is_file() and backbone.is_file()  # recomputed in place
    assert results.read_record(rec)["train_info"]["status"] == "ok"


# ---------------------------------------------------------------------------------------------------------------
# 5. No debris, no races.


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_temporaries_of_killed_writers_are_removed_and_a_live_writers_kept(folder, capsys):
    host = store._WRITER.rsplit("-", 1)[0]
    cell = record(folder).parent
    dead = cell / f".smoke-0123456789abcdef.json.{host}-{_dead_pid()}.abc123.tmp"
    other_host = cell / f".smoke-0123456789abcdef.json.elsewhere-{_dead_pid()}.abc124.tmp"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = cell / f".smoke-0123456789abcdef.json.{host}-{sleeper.pid}.abc125.tmp"
        for t in (dead, other_host, live):
            t.write_text("{")
        assert run(folder, "--methods", "lora") == 0
        assert "removed 1 temporary file" in capsys.readouterr().err
        assert not dead.exists() and other_host.exists() and live.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.faults  # slow: run by `make test-faults` (CI)
def test_a_killed_run_leaves_no_temp_file_after_the_next_run(tmp_path):
    out = tmp_path / "r"
    cmd = [sys.executable, "-m", "qlbench.cli", "run", *SMOKE, "--methods", "lora,queryable", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (out / "backbones").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stale = out / "records" / f".x.json.{store._WRITER.rsplit('-', 1)[0]}-{proc.pid}.kill9.tmp"  # as a kill mid-write
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text("{")
    assert run(out, "--methods", "lora,queryable") == 0
    assert not temps(out) and len(Store(out).records()) == 2


@pytest.mark.parametrize(
    "argv",
    [
        ["run", *SMOKE, "--methods", "moe"],
        ["run", *SMOKE, "--seeds", "100000000000"],
        ["sweep", "--functions", "matyas,matyas", "--budget", "smoke"],
        ["suite", "--suite", "nope"],
    ],
)
def test_a_rejected_command_creates_no_out_folder(tmp_path, capsys, argv):
    out = tmp_path / "new"
    one_line_error(capsys, [*argv, "--out", str(out)])
    assert not out.exists()


def test_a_rejected_verify_leaves_no_temp_folder(capsys):
    before = set(Path(tempfile.gettempdir()).glob("qlbench-verify-*"))
    one_line_error(capsys, ["verify", "--method", "lora"])
    one_line_error(capsys, ["verify", "--function", "nope"])
    assert set(Path(tempfile.gettempdir()).glob("qlbench-verify-*")) == before


def _set_aside(path: str, barrier, out) -> None:
    barrier.wait()
    try:
        out.put(store.set_aside(Path(path)))
    except Exception as err:  # what the race produced before: FileNotFoundError
        out.put(f"error {type(err).__name__}")


@pytest.mark.faults  # slow: run by `make test-faults` (CI)
def test_processes_setting_aside_one_damaged_file_at_once_never_fail_or_duplicate(tmp_path):
    ctx = multiprocessing.get_context("fork")
    for trial in range(20):
        path = tmp_path / f"t{trial}" / "cell.json"
        path.parent.mkdir()
        path.write_text("{")
        barrier, out = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_set_aside, args=(str(path), barrier, out)) for _ in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(30)
        said = [str(out.get(timeout=5)) for _ in procs]
        assert not [s for s in said if s.startswith("error")], said
        assert sum(not s.startswith("already") for s in said) == 1, said  # one process moved it, the others say so
        assert not path.exists() and len(asides(path)) == 1 and asides(path)[0].read_text() == "{"


def test_set_aside_takes_the_next_free_name(tmp_path):
    path = tmp_path / "cell.json"
    for n in (1, 2):
        path.write_text(str(n))
        assert store.set_aside(path) == f"moved to cell.json.damaged-{n}"
    assert [p.read_text() for p in asides(path)] == ["1", "2"]


def test_a_cell_another_process_trains_is_left_to_it(folder, capsys):
    path = record(folder)
    with store.claim([path]) as mine, store.claim([path]) as theirs:  # flock: two opens conflict like two processes
        assert mine == {path} and theirs == set()
        assert run(folder, "--methods", "lora", "--force") == 0
        err = capsys.readouterr().err
        assert "1 cell(s) are being trained by another process" in err
    assert not list(path.parent.glob(".*.lock"))  # released locks leave no file
    with store.claim([path]) as again:
        assert again == {path}


@pytest.mark.faults  # slow: run by `make test-faults` (CI)
def test_sigterm_stops_with_a_message_like_sigint(tmp_path):
    out = tmp_path / "r"
    cmd = [sys.executable, "-m", "qlbench.cli", "run", *SMOKE, "--budget", "quick", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("qlbench run:")  # the plan is made: pretraining starts
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "terminated (SIGTERM)" in err and "Traceback" not in err
    assert not temps(out)


# ---------------------------------------------------------------------------------------------------------------
# 6. Smaller gaps.


def test_a_function_given_twice_is_refused(tmp_path, capsys):
    line = one_line_error(capsys, ["sweep", "--functions", "matyas,levy,matyas", "--out", str(tmp_path / "o")])
    assert "--functions: 'matyas' given twice" in line


def test_every_list_of_methods_comes_from_the_registry(tmp_path, capsys):
    line = one_line_error(capsys, ["run", *SMOKE, "--methods", "moe", "--out", str(tmp_path)])
    assert line.split("valid: ")[1].split("; ")[0].split(", ") == adapters.names()
    assert "; also peft:<type>" in line and "package.module:NAME" in line


def test_a_report_of_lora_alone_has_no_ratio_figure_and_no_traceback(folder, capsys):
    record(folder, "queryable").write_text("")  # damaged: LoRA is the only method left (found by the test below)
    assert cli.main(["report", str(folder), "--out", str(folder / "rep"), "--format", "md"]) == 0
    assert "is damaged" in capsys.readouterr().err
    assert not list((folder / "rep").rglob("log-ratio-*")) and list((folder / "rep").rglob("table-*.md"))


# ---------------------------------------------------------------------------------------------------------------
# 7. Random damage: never a traceback, nothing finished lost, every damaged file set aside.


def _mutate(data: bytes, kind: str, where: float, junk: bytes) -> bytes:
    if kind == "truncate":
        return data[: int(len(data) * where)]
    if kind == "junk":
        return junk
    i = int(len(data) * where)
    return data[:i] + junk + data[i + len(junk) :]


# the random-damage tests: reproducible draws, no deadline (each example runs CLI commands), module fixtures reused
DAMAGE_DRAWS = settings(
    deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow], derandomize=True
)


@pytest.mark.faults
@settings(DAMAGE_DRAWS, max_examples=25)
@given(
    target=st.sampled_from(["lora record", "queryable record", "lora model", "queryable model", "backbone"]),
    kind=st.sampled_from(["truncate", "junk", "overwrite"]),
    where=st.integers(0, 100).map(lambda p: p / 100),  # no floats(): flush-denormal is on in the test session
    junk=st.binary(min_size=1, max_size=64) | st.sampled_from([b"{}", b"[]", b"null", b'{"run_info": 1}']),
)
def test_random_damage_never_gives_a_traceback_or_loses_a_finished_record(
    finished, tmp_path, target, kind, where, junk
):
    out = Path(tempfile.mkdtemp(dir=tmp_path))
    shutil.copytree(finished, out, dirs_exist_ok=True)
    files = {
        "lora record": record(out),
        "queryable record": record(out, "queryable"),
        "lora model": Store.model_of(record(out)),
        "queryable model": Store.model_of(record(out, "queryable")),
        "backbone": sorted(Store(out).backbone_dir.glob("*.pt"))[0],
    }
    path = files[target]
    intact = {p: p.read_bytes() for p in files.values() if p != path}
    path.write_bytes(_mutate(path.read_bytes(), kind, where, junk))
    for argv in (
        ["results", str(out)],
        ["report", str(out), "--out", str(out / "rep"), "--format", "md"],
        ["verify", "--results", str(out), "--method", "queryable", "--out", str(out / "v.json")],
        ["run", *SMOKE, "--methods", "lora,queryable", "--out", str(out)],
    ):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            code = cli.main(argv)  # in this process: a traceback would be an exception raised here
        assert code in (0, 1, 2), (argv, code)
    assert code == 0  # the run recomputed whatever was damaged
    for p in intact:  # nothing finished was lost
        assert p.exists()
    for rec in Store(out).records():
        results.read_record(rec)
        if (m := Store.model_of(rec)).exists():
            adapted.read_model(m, results.read_record(rec))
    if asides(path):
        assert path.exists()  # set aside and recomputed


REAL = ["real", "--methods", "lora", "--seeds", "1", "--epochs", "1", "--train-per-task", "4", "--no-progress"]
SUITE_RUN = ["suite", "--suite", "zoo-4", "--methods", "lora", "--budget", "smoke", "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def finished_rows(tmp_path_factory) -> Path:
    """A results folder with a finished smoke suite row (lora on zoo-4, joint) and a tiny real-model record."""
    pytest.importorskip("peft")
    out = tmp_path_factory.mktemp("rows")
    assert cli.main([*SUITE_RUN, "--out", str(out)]) == 0
    assert cli.main([*REAL, "--out", str(out)]) == 0
    return out


@pytest.mark.faults
@settings(DAMAGE_DRAWS, max_examples=8)
@given(
    target=st.sampled_from(["suite record", "real record", "backbone swap"]),
    kind=st.sampled_from(["truncate", "junk", "overwrite"]),
    where=st.integers(0, 100).map(lambda p: p / 100),
    junk=st.binary(min_size=1, max_size=64) | st.sampled_from([b"{}", b"[]", b"null", b'{"per_seed": 1}']),
)
def test_random_damage_of_suite_rows_real_records_and_backbones_is_found(
    finished_rows, tmp_path, target, kind, where, junk
):
    """The same promise for the other record kinds, and for a backbone file copied over another member's (same
    shapes, other weights): `results` and `report` never raise, `suite` and `real` recompute what was damaged."""
    out = Path(tempfile.mkdtemp(dir=tmp_path))
    shutil.copytree(finished_rows, out, dirs_exist_ok=True)
    (suite_rec,) = Store(out).suite_records()
    (real_rec,) = (out / "real").rglob("lora.json")
    backbones = sorted(Store(out).backbone_dir.rglob("*.pt"))
    if target == "backbone swap":
        path = backbones[0]
        path.write_bytes(backbones[1].read_bytes())
    else:
        path = suite_rec if target == "suite record" else real_rec
        path.write_bytes(_mutate(path.read_bytes(), kind, where, junk))
    force = ["--force"] if target == "backbone swap" else []  # a finished row reads no backbone: train it again
    for argv in (
        ["results", str(out)],
        ["report", str(out), "--out", str(out / "rep"), "--format", "md", "--no-figures"],
        [*SUITE_RUN, "--out", str(out), *force],
        [*REAL, "--out", str(out)],
    ):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            code = cli.main(argv)
        assert code in (0, 1, 2), (argv, code)
        if argv[0] in ("suite", "real"):
            assert code == 0, (argv, err.getvalue()[-500:])  # recomputed whatever was damaged
    results.read_record(suite_rec)
    from qlbench.experiments import real

    real.check_record(store.read_json(real_rec), real_rec)
    if target == "backbone swap":
        assert asides(path), "a backbone copied over another member's was used"
