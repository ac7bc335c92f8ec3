"""The Ray executor (`qlbench sweep --executor ray`) on one local Ray runtime (2 CPUs) shared by this module: a smoke
sweep gives records identical to the local executor's; a task that raises or whose worker dies leaves the other
cells' records intact, is reported per cell with exit code 1, and a rerun completes only the missing cells.

Faults are planted from here, not from the library: every Ray worker of this runtime starts with a setup hook that
wraps `experiment.train_method` and fails a stack holding (method, function) when the file
`<faults>/<method>-<function>` exists ("raise": the task raises; "exit": the worker process dies)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from qlbench import cli
from qlbench.records import results
from qlbench.records.store import Store

from helpers import one_line_error

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'qlbench[ray]'): Ray executor untested")

pytestmark = pytest.mark.xdist_group("ray")  # one Ray runtime per module: its tests share one xdist worker
SWEEP = ["sweep", "--functions", "matyas,levy", "--budget", "smoke", "--seeds", "2", "--no-progress"]
RAY = ["--executor", "ray", "--ray-retries", "0"]


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """The module's Ray runtime; yields the folder where a test drops fault markers. Its workers run at this
    process's priority: Ray's default (nice 15) starves them beside the other xdist worker's tests."""
    folder = str(tmp_path_factory.mktemp("faults"))

    def install():  # runs in every Ray worker at start-up (pickled by value: a local function)
        import os

        from qlbench.experiments import experiment

        train_method = experiment.train_method

        def faulty(p, method, pre, *args, **kwargs):
            for function in dict.fromkeys(f for f, _ in pre.members):
                marker = os.path.join(folder, f"{method}-{function}")
                if os.path.exists(marker):
                    with open(marker) as f:
                        if f.read() == "exit":
                            os._exit(1)
                    raise RuntimeError(f"planted failure in {method} on {function}")
            return train_method(p, method, pre, *args, **kwargs)

        experiment.train_method = faulty

    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_worker_niceness", "0")  # read by the raylet that ray.init starts
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            logging_level=logging.WARNING,
            runtime_env={"worker_process_setup_hook": install},
        )
        yield Path(folder)
        ray.shutdown()


@pytest.fixture
def plant(faults):
    """plant(method, function, 'raise' | 'exit'); every marker is removed after the test."""
    planted = []

    def put(method: str, function: str, mode: str) -> Path:
        marker = faults / f"{method}-{function}"
        marker.write_text(mode)
        planted.append(marker)
        return marker

    yield put
    for marker in planted:
        marker.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The local executor's records of the smoke sweep (lora, queryable), the reference for the Ray executor."""
    out = tmp_path_factory.mktemp("local")
    assert cli.main([*SWEEP, "--methods", "lora,queryable", "--out", str(out)]) == 0
    return out


def measured(record: Path, ignore=("wall_time_s",)) -> dict:
    """Everything a record measured: train_info without its timings (wall time, the cost's latencies) and the other
    `ignore`d fields, and the config hash. The cost's bytes (adapter file, peak memory) are compared."""
    rec = results.read_record(record)
    info = {k: v for k, v in rec["train_info"].items() if k not in ignore}
    if "cost" in info:
        info["cost"] = {k: v for k, v in info["cost"].items() if k != "latency_s_per_sample"}
    return {"config_hash": rec["run_info"]["config_hash"], **info}


def assert_same_cells(ours: Path, reference: Path, method: str, ignore=("wall_time_s",)) -> None:
    """The method's records and adapter weights in `ours` equal those in `reference`, bit for bit."""
    cells = Store(reference).records(method=method)
    assert len(cells) == 2
    for record in cells:
        mine = ours / record.relative_to(reference)
        assert measured(mine, ignore) == measured(record, ignore), mine
        a, b = torch.load(Store.model_of(mine)), torch.load(Store.model_of(record))
        assert a["members"] == b["members"] and a["state"].keys() == b["state"].keys()
        for name in a["state"]:
            assert torch.equal(a["state"][name], b["state"][name]), (mine, name)


def statuses(out: Path) -> dict[tuple[str, str], str]:
    return {Store(out).cell_of(r)[1:3]: results.read_record(r)["train_info"]["status"] for r in Store(out).records()}


def stamps(out: Path) -> dict[Path, tuple[bytes, int]]:
    """Bytes and modification time of every record and weights file."""
    files = [f for r in Store(out).records() for f in (r, Store.model_of(r)) if f.exists()]
    return {f: (f.read_bytes(), f.stat().st_mtime_ns) for f in files}


def test_a_ray_sweep_equals_the_local_executor(faults, local, tmp_path, capsys):
    assert cli.main([*SWEEP, "--methods", "lora,queryable", *RAY, "--out", str(tmp_path)]) == 0
    assert "executor ray (2 CPU(s) on the largest node" in capsys.readouterr().out
    for method in ("lora", "queryable"):
        assert_same_cells(tmp_path, local, method)
    (record,) = Store(tmp_path).records(function="levy", method="queryable")
    assert results.read_record(record)["train_info"]["stacked_members"] == 4  # the local executor's stack


@pytest.mark.slow  # about a minute (a Ray cluster's start and eight stacks): CI's `make test-slow`
def test_another_group_size_gives_the_same_numbers(faults, local, tmp_path):
    """--group-size 1 trains each function's stack apart (2 members instead of the local executor's 4): the per-seed
    results and weights must not change (engine.MIN_STACK)."""
    assert cli.main([*SWEEP, "--methods", "lora,queryable", *RAY, "--group-size", "1", "--out", str(tmp_path)]) == 0
    for method in ("lora", "queryable"):
        assert_same_cells(tmp_path, local, method, ignore=("wall_time_s", "stacked_members"))


def test_a_task_that_raises_fails_its_cells_only_and_a_rerun_completes_them(faults, plant, tmp_path, capsys):
    plant("lora", "levy", "raise")
    argv = [*SWEEP, "--methods", "lora,mean", *RAY, "--group-size", "1", "--out", str(tmp_path)]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    failed = [line for line in err.splitlines() if line.startswith("qlbench sweep: ")]
    assert failed == ["qlbench sweep: levy/lora failed: RuntimeError: planted failure in lora on levy"], err
    assert statuses(tmp_path) == {
        ("matyas", "lora"): "ok",
        ("levy", "lora"): "failed",
        ("matyas", "mean"): "ok",
        ("levy", "mean"): "ok",
    }
    (record,) = Store(tmp_path).records(function="matyas", method="lora")
    assert results.read_record(record)["train_info"]["stacked_members"] == 2  # --group-size 1: one function a task
    before = stamps(tmp_path)

    plant("lora", "levy", "raise").unlink()
    assert cli.main(argv) == 0
    assert "3 cell(s) already have a finished record" in capsys.readouterr().err
    assert set(statuses(tmp_path).values()) == {"ok"}
    after = stamps(tmp_path)
    changed = {f.name for f in after if before.get(f) != after[f]}
    (redone,) = Store(tmp_path).records(function="levy", method="lora")
    assert changed == {redone.name, Store.model_of(redone).name}  # only the failed cell was run again


def test_a_killed_worker_fails_its_cells_only_and_a_rerun_completes_them(faults, plant, local, tmp_path, capsys):
    plant("queryable", "matyas", "exit")  # the queryable stack holds matyas and levy: both cells fail
    argv = [*SWEEP, "--methods", "lora,queryable", *RAY, "--out", str(tmp_path)]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    failed = sorted(line for line in err.splitlines() if line.startswith("qlbench sweep: "))
    assert [line.split(" failed: ")[0] for line in failed] == [
        "qlbench sweep: levy/queryable",
        "qlbench sweep: matyas/queryable",
    ], err
    assert all("WorkerCrashedError" in line for line in failed), err
    assert statuses(tmp_path)[("levy", "lora")] == "ok"
    assert_same_cells(tmp_path, local, "lora")  # the other task's cells: intact and identical
    before = stamps(tmp_path)

    os.unlink(faults / "queryable-matyas")
    assert cli.main(argv) == 0
    assert "2 cell(s) already have a finished record" in capsys.readouterr().err
    assert_same_cells(tmp_path, local, "queryable")  # resumed: now every cell equals the local executor's
    assert {f: s for f, s in stamps(tmp_path).items() if f in before and "/lora/" in str(f)} == {
        f: s for f, s in before.items() if "/lora/" in str(f)
    }


def test_more_threads_than_a_node_has_is_one_line_before_any_work(faults, tmp_path, capsys):
    line = one_line_error(capsys, [*SWEEP, *RAY, "--threads", "3", "--out", str(tmp_path)])
    assert "threads 3 exceed the largest Ray node's 2 CPU(s); valid: 1..2" in line
    assert not Store(tmp_path).records() and not Store(tmp_path).backbone_dir.exists()


def test_a_ray_sweep_keeps_the_backbone_init(faults, local, tmp_path):
    """--backbone-init reaches the Ray tasks' pretraining and adaptation: a kaiming Ray sweep equals the local
    executor's kaiming sweep, and differs from the default-init records (a task that dropped the option would
    pretrain, or look up, default backbones)."""
    kaiming = [*SWEEP, "--methods", "lora", "--backbone-init", "kaiming"]
    assert cli.main([*kaiming, "--out", str(tmp_path / "local")]) == 0
    assert cli.main([*kaiming, *RAY, "--out", str(tmp_path / "ray")]) == 0
    assert_same_cells(tmp_path / "ray", tmp_path / "local", "lora")
    default = {Store(local).cell_of(r)[1]: measured(r) for r in Store(local).records(method="lora")}
    for record in Store(tmp_path / "ray").records(method="lora"):
        theirs = default[Store(tmp_path / "ray").cell_of(record)[1]]
        assert measured(record)["per_seed"][0]["test_curve"] != theirs["per_seed"][0]["test_curve"]


@pytest.mark.slow  # one zoo-v2 task at the protocol's budget, trained twice and a Ray runtime: minutes
def test_the_zoo_v2_board_on_ray_equals_the_local_executor(faults, tmp_path):
    """`make leaderboard-snapshot BOARD_EXECUTOR=ray`: lora's whole learning-rate grid on one zoo-v2 task gives, as
    Ray tasks, the records and weights the local executor gives. The stacks differ: this process trains the four
    rates in one stack (8 members: 4 rates x 2 seeds), Ray one rate per task (2 members), so only the records'
    `stacked_members` differ (docs/commands.md)."""
    argv = ["sweep", "--protocol", "zoo-v2", "--functions", "matyas", "--methods", "lora", "--threads", "1"]
    argv += ["--seeds", "2", "--no-progress"]  # two of the protocol's five seeds: the same grid, in less time
    assert cli.main([*argv, "--out", str(tmp_path / "local")]) == 0
    assert cli.main([*argv, *RAY, "--out", str(tmp_path / "ray")]) == 0
    cells = Store(tmp_path / "local").records(method="lora")
    assert len(cells) == 4  # one record per rate of the grid
    for record in cells:
        mine = tmp_path / "ray" / record.relative_to(tmp_path / "local")
        differ = ("wall_time_s", "stacked_members")  # timings, and the stack sizes by design
        assert measured(mine, differ) == measured(record, differ), mine
        assert [measured(r)["stacked_members"] for r in (mine, record)] == [2, 8]
        a, b = torch.load(Store.model_of(mine)), torch.load(Store.model_of(record))
        assert all(torch.equal(a["state"][k], b["state"][k]) for k in b["state"]), mine
