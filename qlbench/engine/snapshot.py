"""Snapshots of a stage in training, so that a run stopped mid-stage (killed, out of time) goes on from its last
snapshot instead of the stage's first epoch.

At the paper budget a stage is 5,000 epochs: hours on the CPU, and on a GPU longer than a 10-minute call. Without a
snapshot a stopped stage starts again from epoch 0 (finished records are kept either way).

`Snapshots` names one stage's file and the key of everything its numbers depend on. `engine.fit` saves, at an
evaluation epoch at least `every_s` seconds after the last save, the stage's whole training state: the trainable
parameters, the optimiser's state, each member's data-order generator, and the history so far (curves, divergence,
gradient diagnostics). A later `fit` of the same key restores it before its first step and trains the epochs left:
on the CPU the numbers are bit for bit those of a run never stopped (tests/test_snapshot.py). What a snapshot leaves
out is rebuilt the same: the frozen backbone (from the pretraining cache), the data, the method's structure.

A snapshot whose key differs, or a damaged file, is reported and set aside, and the stage starts from epoch 0. The
file is written atomically (`store.save_torch`) and removed once the stage's records are written (`clear`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from qlbench.records.store import DamagedFile, load_torch, save_torch, set_aside

FORMAT = 1  # the layout of a snapshot's dict; a file of another format is set aside
EVERY_S = 60.0  # seconds between snapshots: what a stopped stage loses at most, beyond its last evaluation period
COST_SHARE = 0.05  # at most this share of the training time goes to writing snapshots (a slow save spaces them out)


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters training changes, by name: what a snapshot keeps of the model."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def gap(every_s: float, save_s: float) -> float:
    """Seconds from a save that took `save_s` to the next: `every_s`, or more where the save is slow, so that saves
    take at most COST_SHARE of the time; 0 (every evaluation) stays 0."""
    return max(every_s, save_s / COST_SHARE) if every_s else 0.0


@dataclass
class Snapshots:
    """One stage's snapshot file (`path`) and the key of what its numbers depend on (`key`: a stack's cells'
    config hashes, members, device and execution settings). `every_s`: seconds at least between saves, more where a
    save is slow (COST_SHARE); 0: at every evaluation. `log` says what was resumed or set aside."""

    path: Path
    key: str
    every_s: float = EVERY_S
    log: Callable[[str], None] = print
    saved_at: float = field(default=0.0, init=False)  # perf_counter of the last save (or of the stage's start)
    gap_s: float = field(default=0.0, init=False)  # the least time before the next save (every_s, or more)

    def start(self) -> None:
        """The stage starts (or resumes) now: the first save comes `every_s` later."""
        self.saved_at, self.gap_s = time.perf_counter(), self.every_s

    def due(self) -> bool:
        return time.perf_counter() - self.saved_at >= self.gap_s

    def load(self, device) -> dict | None:
        """The saved state (tensors on `device`), or None when there is none of this key: a damaged file, one of
        another format or key is reported and set aside."""
        path = Path(self.path)
        if not path.exists():
            return None
        try:
            snap = load_torch(path, map_location=device)
            if not isinstance(snap, dict) or snap.get("format") != FORMAT:
                raise DamagedFile(f"{path} is not a snapshot of format {FORMAT}")
        except DamagedFile as err:
            return self.reject(str(err))
        if snap.get("key") != self.key:
            return self.reject("it is a snapshot of another configuration")
        return snap

    def reject(self, why: str) -> None:
        """Say why the snapshot cannot be resumed from, and set it aside: the stage starts from its first epoch."""
        aside = set_aside(Path(self.path))
        self.log(f"{self.path} cannot be resumed from: {why}; {aside}, the stage starts from its first epoch")

    def save(self, state: dict) -> None:
        """Write `state` (with the format and key) atomically, and space the next save so that writing snapshots
        takes at most COST_SHARE of the time."""
        t0 = time.perf_counter()
        save_torch({"format": FORMAT, "key": self.key} | state, Path(self.path))
        self.saved_at = time.perf_counter()
        self.gap_s = gap(self.every_s, self.saved_at - t0)

    def clear(self) -> None:
        """Remove the snapshot: its stage's records are written."""
        Path(self.path).unlink(missing_ok=True)
