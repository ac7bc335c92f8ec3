"""Suite and real-model records are held to what their readers use (issue 45, cause 3): a suite record whose
matrices do not fit its card and schedule, or a real record without a status or a score, is damaged, reported in one
line and set aside, never a traceback from `report`, `results` or `suite`, and never read as a measurement."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from qlbench import cli
from qlbench.records import results, schema
from qlbench.records.store import Store

pytestmark = pytest.mark.xdist_group("record_shapes")  # its module fixture trains once: its tests, one worker

SUITE = ["--suite", "zoo-4", "--schedule", "sequential", "--budget", "smoke", "--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A results folder with the sequential zoo-4 rows of lora and instruct-queryable (routed: it records usage)."""
    out = tmp_path_factory.mktemp("suite")
    assert cli.main(["suite", *SUITE, "--methods", "lora,instruct-queryable", "--out", str(out)]) == 0
    return out


def routed(out: Path) -> Path:
    (path,) = Store(out).suite_records(method="instruct-queryable")
    return path


def damage(rec: dict, how: str) -> dict:
    rec = copy.deepcopy(rec)
    s = rec["train_info"]["per_seed"][0]
    if how == "no initial_task_mse":
        del s["initial_task_mse"]
    elif how == "ragged stage_task_mse":
        s["stage_task_mse"][1] = s["stage_task_mse"][1][:2]
    elif how == "empty stage_task_mse":
        s["stage_task_mse"] = []
    elif how == "fewer tasks than the card":
        s["stage_task_mse"] = [row[:3] for row in s["stage_task_mse"]]
        s["initial_task_mse"] = s["initial_task_mse"][:3]
    elif how == "one stage of four":
        s["stage_task_mse"] = s["stage_task_mse"][:1]
    elif how == "all-null MSEs marked ok":
        s["stage_task_mse"] = [[None] * len(row) for row in s["stage_task_mse"]]
    elif how == "junk usage":
        s["usage"] = "junk"
    return rec


DAMAGE = ["no initial_task_mse", "ragged stage_task_mse", "empty stage_task_mse", "fewer tasks than the card",
          "one stage of four", "all-null MSEs marked ok", "junk usage"]  # fmt: skip


@pytest.mark.parametrize("how", DAMAGE)
def test_the_schema_names_what_is_wrong_with_a_suite_record(finished, how):
    rec = json.loads(routed(finished).read_text())
    assert schema.problem(rec) is None  # the record as written is whole
    found = schema.problem(damage(rec, how))
    assert found is not None and "train_info.per_seed[0]" in found, found


@pytest.mark.parametrize("how", ["ragged stage_task_mse", "all-null MSEs marked ok", "junk usage"])
def test_report_results_and_suite_set_a_damaged_suite_record_aside(finished, tmp_path, capsys, how):
    out = tmp_path / "r"
    shutil.copytree(finished, out)
    path = routed(out)
    path.write_text(json.dumps(damage(json.loads(path.read_text()), how)))
    capsys.readouterr()
    for argv in (["results", str(out)], ["report", str(out), "--no-figures"]):
        cli.main(argv)
        err = capsys.readouterr().err
        assert "is damaged" in err and "Traceback" not in err, (argv, err)
    assert cli.main(["suite", *SUITE, "--methods", "lora,instruct-queryable", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"{path} is damaged" in err and "Traceback" not in err
    assert results.read_record(path)["train_info"]["status"] == "ok"  # recomputed whole
    assert len(list(path.parent.glob(f"{path.name}.damaged-*"))) == 1


def test_a_real_record_without_status_or_score_is_damaged(tmp_path):
    from qlbench.experiments import real

    good = {"seed": 0, "status": "ok", "test_mse": 0.1, "test_mse_per_task": dict.fromkeys(real.TASKS, 0.1),
            "train_mse": 0.1, "trainable_params": 10}  # fmt: skip
    rec = {"method": "lora", "config_hash": "x", "per_seed": [good]}
    path = tmp_path / "lora.json"
    assert real.check_record(rec, path) is rec
    for broken, words in (
        ({k: v for k, v in good.items() if k != "status"}, "status None"),
        ({k: v for k, v in good.items() if k != "test_mse"}, "test_mse = None"),
        (good | {"test_mse_per_task": {"mammal": 0.1}}, "does not hold the tasks"),
        (good | {"status": "diverged", "test_mse": None, "trainable_params": "many"}, "trainable_params"),
    ):
        with pytest.raises(ValueError, match=words):
            real.check_record(rec | {"per_seed": [broken]}, path)
    diverged = good | {"status": "diverged", "test_mse": None, "test_mse_per_task": dict.fromkeys(real.TASKS)}
    assert real.check_record(rec | {"per_seed": [diverged]}, path)  # a diverged seed's scores may be null


def test_report_of_a_folder_whose_every_record_is_damaged_says_so(finished, tmp_path, capsys):
    out = tmp_path / "r"
    shutil.copytree(finished, out)
    for path in Store(out).suite_records():
        path.write_text(json.dumps(damage(json.loads(path.read_text()), "junk usage")))
    capsys.readouterr()
    assert cli.main(["report", str(out), "--no-figures"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("no readable records: the 2 found are damaged (a run recomputes them)"), err
    assert sum("is damaged" in line for line in err) == 2
