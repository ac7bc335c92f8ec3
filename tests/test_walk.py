"""The walk from `qlbench run` to `optimizer.step()` that docs/design.md writes down, kept true: a real run (smoke
budget, LoRA, one seed) is stopped at its first adaptation step and the Python stack between the command's `run`
and the optimiser is read; it must be the documented calls, no more, over the documented files."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import torch

import qlbench
from qlbench.cli import main
from qlbench.commands import run as run_command

ROOT = Path(qlbench.__file__).parent
DESIGN = ROOT.parent / "docs" / "design.md"

# (file under qlbench/, the function's qualified name, how docs/design.md's walk names the call)
WALK = [
    ("commands/run.py", "run", "run(args)"),
    ("experiments/runner.py", "run", "runner.run(plan)"),
    ("experiments/experiment.py", "Plan.train", "Plan.train(units)"),
    ("experiments/experiment.py", "train_method", "train_method(plan, method, stack)"),
    ("engine/loop.py", "adapt", "engine.adapt("),
    ("engine/loop.py", "fit", "fit(model, [one Stage])"),
    ("engine/loop.py", "_train", "_train:"),
    ("engine/step.py", "Step.__call__", "Step.__call__:"),
]
MAX_CALLS, MAX_FILES = 8, 5  # from the command's run to optimizer.step, the step's own call counted


def where(frame) -> str | None:
    """file:qualname of a frame of qlbench or of these tests; None for a library's plumbing between two calls (a
    context manager used as a decorator, torch's optimizer-step hook wrapper)."""
    path = Path(frame.filename)
    for root in (ROOT, Path(__file__).parent):
        if root in path.parents:
            return f"{path.relative_to(root)}:{frame.frame.f_code.co_qualname}"
    return None


def adaptation_walk(tmp_path, monkeypatch) -> list[str]:
    """The frames from commands/run.py:run down to the caller of AdamW.step, at the first step of adaptation (the
    first ones pretrain the backbone)."""
    walks = []
    step = torch.optim.AdamW.step

    def spy(self, *args, **kwargs):
        frames = [w for f in inspect.stack()[1:] if (w := where(f))][::-1]  # outermost first
        start = frames.index("commands/run.py:run")
        walks.append(frames[start:])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    argv = ["run", "--function", "matyas", "--budget", "smoke", "--methods", "lora", "--seeds", "1"]
    assert main([*argv, "--compile", "off", "--threads", "1", "--out", str(tmp_path), "--no-progress"]) == 0
    return next(w for w in walks if "experiments/experiment.py:train_method" in w)


def test_the_documented_walk_is_the_stack_at_the_optimizer_step(tmp_path, monkeypatch):
    walk = adaptation_walk(tmp_path, monkeypatch)
    assert walk == [f"{file}:{name}" for file, name, _ in WALK]
    assert len(walk) <= MAX_CALLS and len({w.split(":")[0] for w in walk}) <= MAX_FILES


def test_design_md_names_the_walk_in_order():
    block = DESIGN.read_text().split("**From a command to the optimizer step.**")[1].split("\n\n")[1]
    positions = [block.find(doc) for _, _, doc in WALK] + [block.find("optimizer.step")]
    assert -1 not in positions and positions == sorted(positions), positions
    numbered = re.findall(r"^\s+(\d) ", block, flags=re.M)
    assert numbered == [str(i) for i in range(1, len(WALK) + 1)]  # 1..8: seven calls in WALK and the step itself
    files = re.findall(r"^\s+(?:\d )?((?:commands|experiments|engine)/\w+\.py)", block, flags=re.M)
    assert files == list(dict.fromkeys(file for file, _, _ in WALK))


def test_a_helper_put_between_two_documented_calls_fails_the_walk(tmp_path, monkeypatch):
    """Planted: the command reaches the runner through one more function; the walk test must see it."""
    direct = run_command.runner.run

    def detour(plan, **kwargs):
        return direct(plan, **kwargs)

    monkeypatch.setattr(run_command.runner, "run", detour)
    walk = adaptation_walk(tmp_path, monkeypatch)
    assert walk != [f"{file}:{name}" for file, name, _ in WALK] and any("detour" in w for w in walk)
