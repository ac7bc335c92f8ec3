"""The runner (qlbench/experiments/runner.py) on a toy workload: which units are finished, what it trains, what it
leaves to another process; and its failure and cost wrappers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from qlbench.experiments import runner
from qlbench.records import store
from qlbench.settings import Execution, Protocol


@dataclass
class Toy:
    """A workload of named units; a unit's record is {"hash", "status"} JSON; train writes "ok" records."""

    out_dir: Path
    names: list[str]
    config: dict = field(default_factory=lambda: {"lr": 1})
    force: bool = False
    noun = "toy"
    trained: list = field(default_factory=list)
    broken: set = field(default_factory=set)  # units whose extra file is missing (intact() says False)

    def units(self):
        return list(self.names)

    def unit_path(self, unit):
        return self.out_dir / f"{unit}.json"

    def unit_config(self, unit):
        return self.config | {"unit": unit}

    def unit_cards(self, unit):
        return {}  # made from no card

    def read(self, path):
        try:
            rec = json.loads(path.read_text())
        except ValueError:
            raise store.DamagedFile(f"{path} is damaged (not JSON)") from None
        return runner.Found(rec["hash"], rec["status"], rec)

    def intact(self, record, rec, log):
        return record.stem not in self.broken

    def train(self, units, progress, log):
        self.trained += units
        for u in units:
            self.write(u, "ok")

    def write(self, unit, status, config=None):
        h = store.stable_hash(config or self.unit_config(unit))
        self.unit_path(unit).write_text(json.dumps({"hash": h, "status": status}))


def test_only_units_without_a_finished_intact_record_of_their_config_train(tmp_path):
    toy = Toy(tmp_path, ["ok", "failed", "incomplete", "other-config", "damaged", "broken", "new"])
    toy.write("ok", "ok")
    toy.write("failed", "failed")
    toy.write("incomplete", "incomplete")
    toy.write("other-config", "ok", config={"lr": 2, "unit": "other-config"})
    toy.unit_path("damaged").write_text("{not json")
    toy.write("broken", "ok")
    toy.broken.add("broken")
    said = []
    paths = runner.run(toy, log=said.append)
    assert toy.trained == ["failed", "incomplete", "other-config", "damaged", "broken", "new"]
    assert paths == [toy.unit_path(u) for u in toy.names]
    assert said[0].startswith(f"{tmp_path / 'damaged.json'} is damaged (not JSON); moved to damaged.json.damaged-1")
    assert said[0].endswith("the toy is recomputed")
    assert said[-1] == "1 toy(s) already have a finished record of the same config: skipped (--force re-runs them)"
    toy.trained.clear()
    toy.broken.clear()
    runner.run(toy, log=said.append)
    assert toy.trained == []  # everything finished now
    toy.force = True
    runner.run(toy, log=said.append)
    assert toy.trained == toy.names


def test_a_unit_another_process_holds_is_left_to_it(tmp_path):
    toy = Toy(tmp_path, ["a", "b"])
    said = []
    with store.claim([toy.unit_path("a")]):
        paths = runner.run(toy, log=said.append)
    assert toy.trained == ["b"] and said == [
        "1 toy(s) are being trained by another process: left to it",
        "1 toy(s) have no record yet (another process is training them): left out here",
    ]
    assert paths == [toy.unit_path("b")]  # only records that exist: a caller never reads one that does not


@pytest.mark.parametrize(
    "argv",
    [
        ["suite", "--suite", "zoo-4", "--methods", "lora,task-code"],
        ["pareto", "--function", "matyas", "--methods", "lora", "--grid", "r=2,4"],
        ["ablate", "--function", "matyas"],
        ["ablate", "--suite", "zoo-4"],
        ["run", "--function", "matyas", "--methods", "lora,mean"],
        ["sweep", "--functions", "matyas,levy", "--methods", "lora"],
    ],
)
def test_a_second_command_on_the_same_out_leaves_every_unit_to_the_first(tmp_path, capsys, monkeypatch, argv):
    """Another process holds every unit's lock (a first `suite`, `pareto` or `ablate` on the same --out, still
    training): the second trains nothing, reads no record that does not exist and ends in one line that says so, exit
    1 (not an empty table at exit 0), no traceback."""
    from qlbench import cli

    held = []
    real_claim = store.claim

    def everything_taken(paths):  # every lock already held elsewhere: claim yields nothing
        held.extend(paths)
        return real_claim([])

    monkeypatch.setattr(runner, "claim", everything_taken)
    code = cli.main([*argv, "--budget", "smoke", "--out", str(tmp_path), "--no-progress"])
    out, err = capsys.readouterr()
    assert held and "Traceback" not in err and "Error" not in err, err
    assert "being trained by another process" in err
    assert code == 1 and "has a record yet (another process is training them); run again later" in err, err
    assert "|" not in out  # no table


def test_attempt_records_a_failure_and_goes_on_and_cost_is_an_extra():
    said, failed = [], []

    def boom():
        raise RuntimeError("planted")

    assert runner.attempt("lora", boom, lambda m, s: failed.append((m, s >= 0)), said.append) is None
    assert failed == [("RuntimeError: planted", True)] and said == ["lora: failed: RuntimeError: planted"]
    assert runner.attempt("lora", lambda: 3, lambda m, s: failed.append(m), said.append) == 3 and len(failed) == 1
    assert runner.cost("lora", boom, said.append) is None
    assert said[-1] == "lora: cost not measured: RuntimeError: planted"
    assert runner.cost("lora", lambda: {"bytes": 1}, said.append) == {"bytes": 1}


def test_failures_recorded_says_whether_the_block_failed_and_lets_an_interrupt_through():
    said, failed = [], []
    with runner.failures_recorded("lora", lambda m, s: failed.append(m), said.append) as outcome:
        raise ValueError("planted")
    assert outcome.failed and failed == ["ValueError: planted"] and said == ["lora: failed: ValueError: planted"]
    with runner.failures_recorded("lora", lambda m, s: failed.append(m), said.append) as outcome:
        pass
    assert not outcome.failed and len(failed) == 1
    with pytest.raises(KeyboardInterrupt):  # a stopped run is stopped, not recorded as a failed unit
        with runner.failures_recorded("lora", lambda m, s: failed.append(m), said.append):
            raise KeyboardInterrupt
    assert len(failed) == 1


def test_ablate_tabulates_its_variants_when_the_reference_is_left_to_another_process(tmp_path, capsys, monkeypatch):
    """Only the card's variant is held elsewhere: the others train and are tabulated without a comparison."""
    from qlbench import cli
    from qlbench.experiments import ablation

    plans = ablation.plans(
        function="matyas", protocol=Protocol(arch="deep-narrow", budget="smoke"), execution=Execution(out_dir=tmp_path)
    )
    held = {plans[ablation.REFERENCE].unit_path(u) for u in plans[ablation.REFERENCE].units()}
    real_claim = store.claim
    monkeypatch.setattr(runner, "claim", lambda paths: real_claim([p for p in paths if p not in held]))
    argv = ["ablate", "--function", "matyas", "--budget", "smoke", "--out", str(tmp_path), "--no-progress"]
    assert cli.main([*argv, "--threads", "1"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "left to it" in err and "generic" in out
