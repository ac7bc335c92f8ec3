"""The commands' training through the captured step (engine/step.py `CapturedStep`) on the CPU: CUDA graphs replaced
by a stand-in that replays by re-running the recorded body (helpers.ReplayByRerun) and `--capture on` let through
on the CPU. Every record equals the eager run's bit for bit (curves, gradient diagnostics, summaries).

What this catches without a GPU: a fault of the captured step in a command's path (a method's optimiser, a suite's
stages with their per-task decay hook, the held-out schedule, a Pareto grid), such as full-soap's missing
param_groups, which failed every full-soap cell on an H200. What it cannot catch: CUDA itself (what a recording may
contain, streams, tensors left on the wrong device); tests/test_cuda.py runs those on a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qlbench import cli, engine
from qlbench.engine import step

from helpers import ReplayByRerun


@pytest.fixture
def recorders(monkeypatch) -> list[ReplayByRerun]:
    made: list[ReplayByRerun] = []
    monkeypatch.setattr(step, "RECORDER", lambda device: made.append(ReplayByRerun(device)) or made[-1])
    monkeypatch.setattr(engine, "use_capture", lambda setting, device: setting == "on")
    return made


def records(folder: Path) -> dict[str, list]:
    """Every record's per-seed entries under `folder`, by its path inside (config hashes: capture is not hashed)."""
    out = {}
    for path in sorted(folder.rglob("*.json")):
        rec = json.loads(path.read_text())
        if "train_info" in rec:
            assert rec["train_info"]["status"] == "ok", (path, rec["train_info"]["message"])
            out[str(path.relative_to(folder))] = rec["train_info"]["per_seed"]
    return out


COMMANDS = {
    "run": ["run", "--function", "matyas", "--budget", "smoke", "--seeds", "2",
            "--methods", "full-soap,lora,dora,moe-lora,queryable,instruct-queryable"],
    # a suite's stages: the per-task decay hook (lora-per-task), routing by task index (poly) and by sentence
    # (instruct-queryable); each method's own captured step, task-lora's and text-lora's among them, is
    # tests/test_engine.py's, one task at a time
    "sequential suite": ["suite", "--suite", "zoo-4", "--schedule", "sequential", "--budget", "smoke",
                         "--methods", "lora-per-task,poly,instruct-queryable"],
    "held-out suite": ["suite", "--suite", "zoo-4", "--schedule", "held-out", "--budget", "smoke",
                       "--methods", "lora,text-lora"],
    "pareto": ["pareto", "--function", "matyas", "--budget", "smoke", "--methods", "queryable", "--grid",
               "r=2 M=2 k=1,2"],
}  # fmt: skip


# the sequential suite (a minute on 2 cores, the default suite's longest case) runs with `make test-slow`, in CI
SLOW = {"sequential suite"}


@pytest.mark.parametrize("command", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in COMMANDS])
def test_a_commands_captured_training_equals_its_eager_training(tmp_path, recorders, command):
    argv = [*COMMANDS[command], "--no-progress"]
    assert cli.main([*argv, "--capture", "off", "--out", str(tmp_path / "eager")]) == 0
    assert not recorders
    assert cli.main([*argv, "--capture", "on", "--out", str(tmp_path / "captured")]) == 0
    assert sum(r.recorded for r in recorders) >= 2  # every stage recorded its batch shapes
    eager, captured = records(tmp_path / "eager"), records(tmp_path / "captured")
    assert eager and eager.keys() == captured.keys()
    for path in eager:
        assert captured[path] == eager[path], path
