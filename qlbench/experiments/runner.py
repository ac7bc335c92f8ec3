"""The one runner: which units of a workload are finished, which this process may train, and the run itself.

A workload is any experiment whose results are one record per unit: `experiment.Plan` (a unit is a (method, function)
cell of a single-task sweep), `multitask.SuitePlan` (a row of a suite schedule), and `real.RealPlan` and
`real_lm.LMPlan` (a method of the real-model experiments: `MethodSeeds`, one record of seeds per method). It names
its units, where each unit's record lives, the config that record must hold and how to read it, and trains a list of
units: it builds their stages, trains them with `engine.fit` and writes their records, through `attempt` (a failure
is a failed record, and the other units go on) and `cost` (a cost that cannot be measured is left out). The runner is
the one place that decides whether a unit is finished and intact (`finished`), and it plans, claims and resumes for
every workload:

    run(w)      remove the temporaries of killed writers -> pending units -> lock them (a unit another process is
                training is left to it) -> w.train(the units this process holds) -> every unit's record path

The Ray executor claims through `claimed` too, and trains the units on its workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from qlbench.inputs import Refused
from qlbench.records import record, results
from qlbench.records.store import (
    DamagedFile,
    claim,
    clean_locks,
    clean_temps,
    read_json,
    set_aside,
    stable_hash,
    write_json,
)

Log = Callable[[str], None]
T = TypeVar("T")


@dataclass
class Found:
    """What a unit's record says: the hash of the config it was made with, its status ("ok", "diverged", "failed",
    or "incomplete" for one still missing some of its work) and the record itself."""

    config_hash: str
    status: str
    rec: dict


def read_result(path: Path) -> Found:
    """A cell or suite-row record (results.read_record: DamagedFile unless it follows the record schema)."""
    rec = results.read_record(path)
    return Found(rec["run_info"]["config_hash"], rec["train_info"]["status"], rec)


class Workload(Protocol):
    """What the runner needs of an experiment."""

    out_dir: Path
    force: bool  # re-run units that already have a finished record of the same config
    noun: str  # what a unit is called in messages ("cell", "row", "method")

    def units(self) -> list[Hashable]: ...

    def unit_path(self, unit) -> Path:  # where the unit's record lives (its config's hash in the name)
        ...

    def unit_config(self, unit) -> dict:  # the config a reusable record of the unit must hold (by hash)
        ...

    def unit_cards(self, unit) -> dict[str, str]:  # the versions of the cards its data is made from ({} for none;
        ...  # zoo.card_digest, suites.cards): a record of them holds them in run_info.settings.cards

    def read(self, path: Path) -> Found:  # the unit's record, checked (store.DamagedFile otherwise)
        ...

    def intact(self, record: Path, rec: dict, log: Log) -> bool:  # the files a finished record relies on
        ...

    def train(self, units: list, progress, log: Log) -> None:  # train them, write their records (progress: a
        ...  # flag for a progress bar, or a callback, as the workload takes it)


def finished(w: Workload, unit, log: Log) -> bool:
    """Whether the unit has a finished record of its exact config whose files are intact. A damaged record is
    reported, set aside and counts as unfinished; a failed one is retried (it holds no results), an incomplete one
    completed. A finished record made from another version of a card than the installed one (its
    run_info.settings.cards; records written before records held them are not checked) is refused: inputs.Refused,
    one line, before any training; `--force` retrains it."""
    path = w.unit_path(unit)
    if not path.exists():
        return False
    try:
        found = w.read(path)
    except DamagedFile as err:
        log(f"{err}; {set_aside(path)}, the {w.noun} is recomputed")
        return False
    if found.config_hash != stable_hash(w.unit_config(unit)) or found.status in ("failed", "incomplete"):
        return False
    recorded = ((found.rec.get("run_info") or {}).get("settings") or {}).get("cards")
    if changed := record.card_changes(recorded, w.unit_cards(unit)):
        raise Refused(
            f"{path} was made from another version of {changed} than the installed one: restore the card, run "
            "again with --force to retrain (the record is replaced), or give another --out"
        )
    return w.intact(path, found.rec, log)


def pending(w: Workload, log: Log) -> list:
    """The units without a finished record (every unit with `w.force`); says how many are skipped."""
    todo = [u for u in w.units() if w.force or not finished(w, u, log)]
    if skipped := len(w.units()) - len(todo):
        log(f"{skipped} {w.noun}(s) already have a finished record of the same config: skipped (--force re-runs them)")
    return todo


def remove_stale_temps(folder: Path, log: Log) -> None:
    """Remove the temp and lock files that killed writers left in a results folder (`store.clean_temps`,
    `store.clean_locks`), and say how many."""
    if stale := clean_temps(folder):
        log(f"removed {len(stale)} temporary file(s) left by killed writers in {folder}")
    if stale := clean_locks(folder):
        log(f"removed {len(stale)} lock file(s) left by killed writers in {folder}")


@contextlib.contextmanager
def claimed(w: Workload, log: Log) -> Iterator[list]:
    """The pending units that this process may train: temporaries of killed writers in the results folder are removed
    first, and each unit's record is locked (`store.claim`) while the block runs; a unit another process is training
    is left to it and said so."""
    remove_stale_temps(w.out_dir, log)
    todo = pending(w, log)
    with claim([w.unit_path(u) for u in todo]) as held:
        mine = [u for u in todo if w.unit_path(u) in held]
        if busy := len(todo) - len(mine):
            log(f"{busy} {w.noun}(s) are being trained by another process: left to it")
        yield mine


def run(w: Workload, *, progress=True, log: Log = print) -> list[Path]:
    """Train every unfinished unit of the workload that no other process holds (every unit with `w.force`); returns
    the record path of every unit that has a record, finished before or now. A unit another process is training
    and has not yet written is left out, and said so: what the caller tabulates are records that exist."""
    with claimed(w, log) as mine:
        if mine:
            w.train(mine, progress, log)
    paths = [w.unit_path(u) for u in w.units()]
    if missing := [p for p in paths if not p.exists()]:
        log(f"{len(missing)} {w.noun}(s) have no record yet (another process is training them): left out here")
    return [p for p in paths if p.exists()]


@dataclass
class Outcome:
    """What `failures_recorded` saw: whether the unit's training raised (and was recorded as failed)."""

    failed: bool = False


@contextlib.contextmanager
def failures_recorded(label: str, failed: Callable[[str, float], None], log: Log) -> Iterator[Outcome]:
    """Run one unit's training in the `with` block: when it raises, say `label: failed: Type: message`, record it
    through `failed(message, wall seconds)` (a failed record, shown as a row and retried by the next run) and go on
    (the Outcome says so), so the other units train. An interrupt (KeyboardInterrupt, SystemExit) is not caught."""
    outcome, t0 = Outcome(), time.perf_counter()
    try:
        yield outcome
    except Exception as err:  # record the failure and go on with the other units
        message = f"{type(err).__name__}: {err}"
        log(f"{label}: failed: {message}")
        failed(message, time.perf_counter() - t0)
        outcome.failed = True


def attempt(label: str, work: Callable[[], T], failed: Callable[[str, float], None], log: Log) -> T | None:
    """`work()`'s result, or None once its failure is recorded (`failures_recorded`)."""
    result = None
    with failures_recorded(label, failed, log):
        result = work()
    return result


def cost(label: str, measure: Callable[[], T], log: Log) -> T | None:
    """A unit's cost (qlbench/cost.py), an extra beside its results: the measurement, or None said through `log` when
    it fails (the record is written without it)."""
    try:
        return measure()
    except Exception as err:  # a cost is an extra: the record is written without it
        log(f"{label}: cost not measured: {type(err).__name__}: {err}")
        return None


class SeedsConfig:
    """A frozen dataclass config with a `seeds` tuple whose other fields fix a record's numbers (qlbench real's,
    real-lm's): `key` and its `hash` name the record's folder; `check_seeds` refuses anything but integers >= 0."""

    def check_seeds(self) -> None:
        seeds = self.seeds
        if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds):
            raise ValueError(f"seeds must be integers >= 0, got {seeds!r}")

    def key(self) -> dict:
        """What a record's numbers depend on beyond its seeds (a record adds seeds of the same key)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "seeds"}

    def hash(self) -> str:
        return stable_hash(self.key())


@dataclass
class MethodSeeds:
    """A workload whose unit is a method and whose record (one file per method under its config's hash) holds one
    entry per seed: finished when it holds every seed of the config; the missing seeds are trained and added, the
    record written after each (the seeds it held before kept). `qlbench real` and `qlbench real-lm` are ones; a
    subclass gives `record_path`, `check_record`, `prepare` (what every seed shares) and `train_seed`."""

    methods: list[str]
    config: SeedsConfig
    out_dir: Path
    force: bool = False
    noun = "method"

    def record_path(self, method: str) -> Path:
        raise NotImplementedError

    def check_record(self, rec, path: Path) -> dict:
        """The record, or DamagedFile (one line) naming what is wrong with it."""
        raise NotImplementedError

    def prepare(self):
        """What every (method, seed) of a train call shares (a tokenizer, the instructions' embeddings)."""
        return None

    def train_seed(self, method: str, seed: int, shared, progress: Callable[[int], None]) -> dict:
        """One (method, seed): its per-seed record entry."""
        raise NotImplementedError

    def settings(self) -> dict:
        """Every setting beyond the config that can change a number (record.settings)."""
        return record.settings(device="cpu", compile=False, dtype="float32")

    def units(self) -> list[str]:
        return list(self.methods)

    def unit_path(self, method: str) -> Path:
        return self.record_path(method)

    def unit_config(self, method: str) -> dict:
        return self.config.key()

    def unit_cards(self, method: str) -> dict[str, str]:
        return {}  # made from no card

    def read(self, path: Path) -> Found:
        """The record's config hash and state: "ok" once it holds every seed of the config, else "incomplete"."""
        rec = self.check_record(read_json(path), path)
        complete = set(self.config.seeds) <= {s["seed"] for s in rec["per_seed"]}
        return Found(rec["config_hash"], "ok" if complete else "incomplete", rec)

    def intact(self, record: Path, rec: dict, log: Log) -> bool:
        return True  # the record is all a later run needs

    def train(self, methods: list[str], progress, log: Log) -> None:
        """Train every (method, seed) of the given methods not yet in its record. `progress`: a callback taking the
        steps done, or a flag (no bar here)."""
        progress = progress if callable(progress) else lambda n: None
        shared = self.prepare()
        for m in methods:
            path, done = self.unit_path(m), {}
            if path.exists() and not self.force:
                try:
                    done = {s["seed"]: s for s in self.read(path).rec["per_seed"]}
                except DamagedFile as err:
                    log(f"{err}; {set_aside(path)}, recomputing")
            for seed in self.config.seeds:
                if seed not in done:
                    log(f"{m} seed {seed}")
                    done[seed] = self.train_seed(m, seed, shared, progress)
                    rec = {"method": m, "config": dataclasses.asdict(self.config) | {"seeds": sorted(done)},
                           "config_hash": self.config.hash(), "per_seed": [done[s] for s in sorted(done)],
                           "git": record.git_info(), "settings": self.settings()}  # fmt: skip
                    write_json(rec, path)
