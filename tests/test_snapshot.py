"""Snapshots (engine/snapshot.py): a stage stopped mid-way goes on from its last snapshot to the very numbers of a
run never stopped, on the CPU bit for bit; a damaged or foreign snapshot is set aside and the stage starts over;
`qlbench run` resumes a killed run's stacks and says so in the record."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from qlbench import adapters, cli, engine
from qlbench.adapters.base import adamw
from qlbench.engine import loop, snapshot
from qlbench.experiments import experiment, runner
from qlbench.records import results
from qlbench.records.store import Store

from helpers import settings

PRE = engine.Phase(epochs=2, lr=3e-3)
BUDGET = engine.Budget("test", 2, PRE, engine.Phase(epochs=7, lr=2e-3), eval_every=2)
MEMBERS = [("dropwave", 0), ("levy", 1)]
STOP_AT = 5  # the epoch whose end stops the first run: its last snapshot is epoch 4's, and epoch 5 runs again


class Stop(Exception):
    """The first run's stop (a kill, as far as the stage can tell: nothing after it runs)."""


@pytest.fixture(scope="module")
def pre():
    return engine.pretrain(engine.Backbones("deep-narrow", PRE), MEMBERS, device="cpu")


def adapt(pre, method: str, snapshots=None, stop: int | None = None) -> engine.AdaptResult:
    """`method` adapted on `pre` over BUDGET; `stop`: raise Stop as epoch `stop` ends (before its evaluation)."""
    epochs = [0]

    def progress(steps: int) -> None:
        epochs[0] += 1
        if epochs[0] == stop:
            raise Stop

    config = adapters.get(method).make_config()
    return engine.adapt(
        pre, engine.Adaptation(method, config, BUDGET), engine.Runtime("cpu"), progress=progress, snapshots=snapshots
    )


def stopped_and_resumed(pre, method: str, path: Path, logs: list) -> engine.AdaptResult:
    snapshots = engine.Snapshots(path, "key", every_s=0.0, log=logs.append)
    with pytest.raises(Stop):
        adapt(pre, method, snapshots, stop=STOP_AT)
    assert path.is_file()
    return adapt(pre, method, snapshots)


def assert_same_training(a: engine.AdaptResult, b: engine.AdaptResult) -> None:
    """Curves, divergence, gradient diagnostics and every trained parameter, bit for bit."""
    assert a.curves.epochs == b.curves.epochs and a.curves.diverged_epoch == b.curves.diverged_epoch
    for field in ("train_mse", "test_mse", "grad_layers", "grad_shared"):
        x, y = getattr(a.curves, field), getattr(b.curves, field)
        assert (x is None) == (y is None), field
        if x is not None:
            assert torch.equal(x.nan_to_num(-1.0), y.nan_to_num(-1.0)), field
    mine, theirs = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)


TRAINED = [m for m in adapters.names() if adapters.get(m).trains]
# in the default suite: AdamW (full-soap's SOAP state runs there through the captured path, below); the others, with
# the shared memory and instruction of instruct-queryable, under -m slow (CI's `make test-slow`)
QUICK = ("lora",)


@pytest.mark.parametrize("method", [m if m in QUICK else pytest.param(m, marks=pytest.mark.slow) for m in TRAINED])
def test_a_stage_stopped_mid_way_resumes_to_the_numbers_of_a_run_never_stopped(pre, method, tmp_path):
    logs = []
    resumed = stopped_and_resumed(pre, method, tmp_path / "s.pt", logs)
    assert_same_training(adapt(pre, method), resumed)
    assert resumed.curves.resumed_epoch == 4 and resumed.curves.earlier_s > 0
    assert logs == [f"resumed at epoch 4 of 7 from {tmp_path / 's.pt'}"]


@pytest.mark.parametrize("part", ["params", "optimizer", "order"])
def test_each_part_of_a_snapshot_is_needed(pre, part, tmp_path, monkeypatch):
    """Planted: a snapshot restored without its parameters, its optimiser's state or its data orders trains
    otherwise, and the check above sees it (what a snapshot holds is not more than it must)."""
    reference = adapt(pre, "lora")
    restore = loop._restore

    def partial(snap, model, optimizer, order, history):
        if part == "params":
            snap = snap | {"params": {n: p.detach().clone() for n, p in engine.snapshot.trainable(model).items()}}
        if part == "optimizer":
            optimizer = type("Ignored", (), {"load_state_dict": lambda self, state: None})()
        if part == "order":
            order = [torch.Generator() for _ in order]
        return restore(snap, model, optimizer, order, history)

    monkeypatch.setattr(loop, "_restore", partial)
    resumed = stopped_and_resumed(pre, "lora", tmp_path / "s.pt", [])
    assert not torch.equal(resumed.curves.train_mse, reference.curves.train_mse)


@pytest.mark.parametrize("why", ["is damaged", pytest.param("another configuration", marks=pytest.mark.slow)])
def test_a_damaged_or_foreign_snapshot_is_set_aside_and_the_stage_starts_over(pre, why, tmp_path):
    path = tmp_path / "s.pt"
    if why == "is damaged":
        path.write_bytes(b"not a snapshot")
    else:  # a stopped run's snapshot, looked up under another key
        with pytest.raises(Stop):
            adapt(pre, "lora", engine.Snapshots(path, "other", every_s=0.0, log=lambda m: None), stop=STOP_AT)
    logs = []
    again = adapt(pre, "lora", engine.Snapshots(path, "key", every_s=0.0, log=logs.append))
    assert len(logs) == 1 and why in logs[0] and "starts from its first epoch" in logs[0], logs
    assert again.curves.resumed_epoch is None
    assert_same_training(adapt(pre, "lora"), again)
    (aside,) = tmp_path.glob("s.pt.damaged-*")  # set aside, not overwritten (the new run snapshots anew)
    assert why != "is damaged" or aside.read_bytes() == b"not a snapshot"


@pytest.mark.slow  # a few seconds: CI's `make test-slow`
def test_a_snapshot_whose_parameters_do_not_fit_the_model_is_set_aside(pre, tmp_path):
    path = tmp_path / "s.pt"
    with pytest.raises(Stop):
        adapt(pre, "lora", engine.Snapshots(path, "key", every_s=0.0), stop=STOP_AT)
    snap = torch.load(path)
    name = next(iter(snap["params"]))
    snap["params"][name] = snap["params"][name][:, :1]
    torch.save(snap, path)
    logs = []
    again = adapt(pre, "lora", engine.Snapshots(path, "key", every_s=0.0, log=logs.append))
    assert again.curves.resumed_epoch is None and len(logs) == 1 and f"its {name} is" in logs[0], logs


@pytest.mark.slow  # a few seconds: CI's `make test-slow`
def test_snapshots_are_spaced_by_their_interval(pre, tmp_path, monkeypatch):
    """Saved at evaluation epochs only, never after the last one, and no more often than `every_s`."""
    saved = []
    monkeypatch.setattr(engine.Snapshots, "save", lambda self, state: saved.append(state["epoch"]))
    adapt(pre, "lora", engine.Snapshots(tmp_path / "s.pt", "key", every_s=0.0))
    assert saved == [2, 4, 6]
    saved.clear()
    adapt(pre, "lora", engine.Snapshots(tmp_path / "s.pt", "key", every_s=3600.0))
    assert saved == []


def test_fit_refuses_snapshots_of_several_stages(pre):
    model, data = engine.build_model(pre, "lora", adapters.get("lora").make_config(), device="cpu", dtype=torch.float32)
    stage = engine.Stage(data, BUDGET.adapt, lambda: adamw(model.parameters(), 1e-3, 0.0), [], 2)
    with pytest.raises(ValueError, match="one stage"):
        engine.fit(model, [stage, stage], snapshots=engine.Snapshots(Path("unused"), "key"))


def smoke_plan(out: Path, **kwargs) -> experiment.Plan:
    return experiment.plan(
        **settings(
            functions=["matyas"],
            methods=["lora"],
            **kwargs,
            arch="deep-narrow",
            budget="smoke",
            device="cpu",
            out_dir=out,
            snapshot_every_s=0.0,
        )
    )


def test_a_run_interrupted_after_a_snapshot_resumes_and_its_record_says_so(tmp_path, monkeypatch):
    """An interrupted `runner.run` (Ctrl-C right after the stack's snapshot at epoch 2 of 4) writes no record; the
    next run resumes the stack at epoch 2, its record's numbers are those of a run never interrupted and say
    `resumed_from_epoch`, and the snapshot is removed once the records are written."""
    (clean,) = runner.run(smoke_plan(tmp_path / "clean"), progress=False, log=lambda m: None)
    plan = smoke_plan(tmp_path / "r")
    interrupted(plan, monkeypatch)
    (snap,) = (tmp_path / "r" / "snapshots").rglob("*.pt")
    logs = []
    (path,) = runner.run(plan, progress=False, log=logs.append)
    assert any(m == f"lora: resumed at epoch 2 of 4 from {snap}" for m in logs), logs
    rec, ref = results.read_record(path), results.read_record(clean)
    assert rec["train_info"]["resumed_from_epoch"] == 2 and "resumed_from_epoch" not in ref["train_info"]
    for mine, theirs in zip(rec["train_info"]["per_seed"], ref["train_info"]["per_seed"], strict=True):
        assert mine["train_curve"] == theirs["train_curve"] and mine["test_curve"] == theirs["test_curve"]
    assert not snap.exists()


def interrupted(plan: experiment.Plan, monkeypatch) -> None:
    """Run `plan`, interrupted (Ctrl-C) right after its stack's first snapshot: no record is written."""
    save = engine.Snapshots.save

    def save_then_stop(self, state):
        save(self, state)
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(engine.Snapshots, "save", save_then_stop)
        with pytest.raises(KeyboardInterrupt):
            runner.run(plan, progress=False, log=lambda m: None)
    assert not list(Store(plan.out_dir).records())


@pytest.mark.slow  # a few seconds: CI's `make test-slow`
def test_force_starts_a_stopped_stack_from_its_first_epoch(tmp_path, monkeypatch):
    plan = smoke_plan(tmp_path, force=True)
    interrupted(plan, monkeypatch)
    logs = []
    (path,) = runner.run(plan, progress=False, log=logs.append)
    assert not any("resumed" in m for m in logs) and "resumed_from_epoch" not in results.read_record(path)["train_info"]


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_a_bad_snapshot_interval_is_refused_before_any_work(value, tmp_path, capsys):
    code = cli.main(["run", "--function", "matyas", "--budget", "smoke", "--snapshot-every", value,
                     "--out", str(tmp_path / "r")])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--snapshot-every must be a number of seconds >= 0, or off" in err[0]
    assert not (tmp_path / "r").exists()


@pytest.mark.slow  # a few seconds: CI's `make test-slow`
def test_snapshots_off_writes_none(tmp_path, monkeypatch):
    monkeypatch.setattr(engine.Snapshots, "save", lambda self, state: pytest.fail("a snapshot was saved"))
    args = ["run", "--function", "matyas", "--budget", "smoke", "--methods", "lora", "--no-progress",
            "--snapshot-every", "off", "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(args) == 0
    assert not (tmp_path / "snapshots").exists()


def test_a_run_names_the_snapshots_left_of_other_configurations(tmp_path, capsys):
    """A run removes its own stack's snapshot once its records are written; a snapshot of another configuration
    (left by a stopped run) stays untouched, and the run says how many remain, where and their size."""
    other = tmp_path / "snapshots" / "deep-narrow" / "lora-smoke-0123456789ab.pt"
    other.parent.mkdir(parents=True)
    other.write_bytes(b"x" * 2_500_000)
    args = ["run", "--function", "matyas", "--budget", "smoke", "--methods", "lora", "--no-progress",
            "--snapshot-every", "0", "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert (
        f"qlbench run: 1 snapshot(s) of stacks stopped mid-stage remain in {other.parent} (2.5 MB): a run of the same "
        "configuration resumes from them; delete them to free the space"
    ) in err.splitlines()
    assert list(other.parent.iterdir()) == [other] and other.read_bytes() == b"x" * 2_500_000
    other.unlink()
    assert cli.main(args) == 0 and "snapshot(s)" not in capsys.readouterr().err


@pytest.mark.faults  # about a minute: run by `make test-faults` (CI)
def test_a_killed_quick_run_resumes_from_its_snapshot_to_the_same_numbers(tmp_path):
    """`qlbench run` killed (SIGKILL) once its stack has saved a snapshot; run again, it resumes there, and its
    records' numbers are those of a run never killed, to the bit."""
    args = ["run", "--function", "dropwave", "--budget", "quick", "--methods", "lora", "--seeds", "1", "--threads",
            "1", "--no-progress", "--snapshot-every", "0"]  # fmt: skip
    cmd = [sys.executable, "-m", "qlbench.cli", *args]
    subprocess.run([*cmd, "--out", str(tmp_path / "clean")], check=True, capture_output=True)
    out = tmp_path / "killed"
    shutil.copytree(tmp_path / "clean" / "backbones", out / "backbones")  # the same pretraining, not trained again
    proc = subprocess.Popen([*cmd, "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not list((out / "snapshots").rglob("*.pt")) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (snap,) = (out / "snapshots").rglob("*.pt")
    again = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "lora: resumed at epoch" in again.stderr and not snap.exists()
    (mine,), (theirs,) = Store(out).records(), Store(tmp_path / "clean").records()
    a, b = json.loads(mine.read_text())["train_info"], json.loads(theirs.read_text())["train_info"]
    assert a["resumed_from_epoch"] > 0
    for x, y in zip(a["per_seed"], b["per_seed"], strict=True):
        assert x["train_curve"] == y["train_curve"] and x["test_curve"] == y["test_curve"]


@pytest.mark.parametrize("method", ["lora", "full-soap"])
def test_a_captured_stage_resumes_as_an_eager_one(pre, method, tmp_path, monkeypatch):
    """The captured step's path (engine/step.py, with CUDA graphs replaced by the CPU stand-in `ReplayByRerun` and
    the update recorded: AdamW's, or full-soap's split SOAP update, `capturable` forced as on CUDA) stopped and
    resumed from its snapshot gives the eager stage's numbers, bit for bit: the restored optimiser state is the one
    the new recordings read (tests/test_cuda.py runs the same on a GPU)."""
    from qlbench.adapters import full
    from qlbench.engine import step as step_module

    from helpers import ReplayByRerun

    soap = full.StackedSoap  # capturable: its step size a device tensor (the eager reference too: other bits)
    monkeypatch.setattr(full, "StackedSoap", lambda *a, **k: soap(*a, **(k | {"capturable": True})))
    reference = adapt(pre, method)
    monkeypatch.setattr(step_module, "RECORDER", ReplayByRerun)
    forced = lambda optimizer: hasattr(optimizer, "param_groups") or getattr(optimizer, "capturable", False)
    monkeypatch.setattr(step_module, "capturable", forced)
    config = adapters.get(method).make_config()
    snapshots = engine.Snapshots(tmp_path / "s.pt", "key", every_s=0.0, log=lambda m: None)
    captured = lambda **kw: engine.adapt(
        pre, engine.Adaptation(method, config, BUDGET), engine.Runtime("cpu", capture=True), **kw
    )
    stops = []

    def stop(steps):
        stops.append(steps)
        if len(stops) == STOP_AT:
            raise Stop

    with pytest.raises(Stop):
        captured(snapshots=snapshots, progress=stop)
    resumed = captured(snapshots=snapshots)
    assert resumed.curves.resumed_epoch == 4
    assert_same_training(reference, resumed)


@pytest.mark.parametrize(
    "saved, why",
    [
        ({"format": snapshot.FORMAT, "key": "other"}, "a snapshot of another configuration"),  # swapped
        ({"format": snapshot.FORMAT - 1, "key": "k"}, f"not a snapshot of format {snapshot.FORMAT}"),  # other version
        ({"state": torch.zeros(2)}, f"not a snapshot of format {snapshot.FORMAT}"),  # another kind of torch file
        ([1, 2, 3], f"not a snapshot of format {snapshot.FORMAT}"),
    ],
)
def test_a_swapped_or_other_version_snapshot_is_reported_and_set_aside(tmp_path, saved, why):
    """A snapshot file that another stack's (swapped in), another version's or another kind of file took the place of:
    one line naming why, the file set aside, and the stage starts from its first epoch (load gives None)."""
    path, said = tmp_path / "s.pt", []
    torch.save(saved, path)
    assert snapshot.Snapshots(path, "k", log=said.append).load("cpu") is None
    assert len(said) == 1 and why in said[0] and "moved to" in said[0] and "first epoch" in said[0], said
    assert not path.exists() and list(tmp_path.glob("s.pt.damaged-*"))
