"""One provenance per snapshot: every table of a report states the commit(s) its records were written from, and warns
when they are not one clean commit's (several commits, a dirty tree, no git info); the Makefile's snapshot targets
refuse a dirty tree. Records are written by the project's own `record.make_record` (its `git_info` stubbed), read
back by the loaders, and reported by `report.write_report`, `qlbench report`, the real-model and Pareto writers."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import torch

from qlbench import cli, report
from qlbench.experiments import experiment, pareto
from qlbench.records import record, results, store
from qlbench.report import pareto as pareto_report
from qlbench.report import real as real_report
from qlbench.settings import Execution, Protocol

# seaborn 0.13's heatmap calls Colormap.set_bad, which matplotlib >= 3.11 marks pending deprecation (not ours)
pytestmark = pytest.mark.filterwarnings("ignore:The set_bad function:PendingDeprecationWarning")

A = "1f2e3d4c5b6a" + "0" * 28  # two full commit hashes, told apart by their first 12 digits
B = "9a8b7c6d5e4f" + "1" * 28
CLEAN_A, CLEAN_B, DIRTY_A = {"commit": A, "dirty": False}, {"commit": B, "dirty": False}, {"commit": A, "dirty": True}
NO_GIT = None  # a record written before run_info.git existed: no git key at all
OUTSIDE = {"commit": None, "dirty": None}  # a record written outside a git checkout (record.git_info)
CELLS = [("matyas", "lora"), ("matyas", "queryable"), ("levy", "lora"), ("levy", "queryable")]


def seed_entry(seed: int, v: float) -> dict:
    return {
        "seed": seed, "status": "ok", "diverged_epoch": None, "best_train_mse": v, "best_train_epoch": 1,
        "best_test_mse": 2 * v, "best_test_epoch": 1, "test_at_best_train": 2 * v, "train_curve": [4 * v, v],
        "test_curve": [8 * v, 2 * v],
    }  # fmt: skip


def write_cell(out: Path, function: str, method: str, git: dict | None, monkeypatch, seeds: int = 3) -> Path:
    """One finished smoke cell's record, as runner.run writes it, from the checkout `git` (None: no git key)."""
    p = experiment.plan(
        functions=[function],
        methods=[method],
        protocol=Protocol(arch="deep-narrow", seeds=seeds, budget="smoke"),
        execution=Execution(device="cpu", out_dir=out),
    )
    with monkeypatch.context() as m:
        m.setattr(record, "git_info", lambda: dict(git or OUTSIDE))
        per_seed = [seed_entry(s, 1.0 + 0.1 * s + (method == "queryable") * 0.05 * s) for s in p.seeds]
        rec = record.make_record(
            record.RunInfo(p.cell_config(function, method), p.seeds, torch.device("cpu")),
            record.TrainInfo("ok", trainable_params=100, total_params=1000, eval_epochs=[0, 1], per_seed=per_seed),
        )
    if git is NO_GIT:
        del rec["run_info"]["git"]
    path = p.record_path(function, method)
    store.write_json(rec, path)
    return path


def folder(tmp_path, monkeypatch, gits: list) -> Path:
    """A results folder whose i-th cell of CELLS (in that order) was written from gits[i]."""
    out = tmp_path / "results"
    for (function, method), git in zip(CELLS, gits):
        write_cell(out, function, method, git, monkeypatch)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The loaders' columns and the provenance line


def test_the_loader_reads_each_records_commit_and_dirty_flag(tmp_path, monkeypatch):
    out = folder(tmp_path, monkeypatch, [CLEAN_A, DIRTY_A, NO_GIT, OUTSIDE])
    frame = results.load(out)
    by = frame.drop_duplicates("record").set_index(["function", "method"])
    assert by.loc[("matyas", "lora"), ["commit", "dirty"]].tolist() == [A, False]
    assert by.loc[("matyas", "queryable"), ["commit", "dirty"]].tolist() == [A, True]
    for cell in (("levy", "lora"), ("levy", "queryable")):  # no git key, or git outside a checkout: missing
        assert by.loc[cell, ["commit", "dirty"]].isna().all()


def test_one_clean_commit_is_one_line_without_a_warning(tmp_path, monkeypatch):
    frame = results.load(folder(tmp_path, monkeypatch, [CLEAN_A] * 4))
    assert results.provenance(frame) == f"Provenance: every record from commit {A[:12]} (clean tree)."


def test_two_commits_are_named_with_their_record_counts_and_warned(tmp_path, monkeypatch):
    """Three records of A and one of B (three seeds each): counted per record, not per seed row, both named, most
    records first, whatever commit the first record has."""
    frame = results.load(folder(tmp_path, monkeypatch, [CLEAN_B, CLEAN_A, CLEAN_A, CLEAN_A]))
    assert len(frame) == 12  # rows are per (cell, seed)
    line, warning = results.provenance(frame).split("\n\n")
    assert line == f"Provenance: 2 commits ({A[:12]}: 3 records, {B[:12]}: 1 record)."
    assert warning.startswith("**Warning: not one snapshot** (records from 2 commits)")
    # the same records in another order say the same
    again = results.provenance(frame.iloc[::-1].reset_index(drop=True))
    assert again == results.provenance(frame)


def test_a_dirty_record_is_counted_and_warned(tmp_path, monkeypatch):
    frame = results.load(folder(tmp_path, monkeypatch, [CLEAN_A, CLEAN_A, CLEAN_A, DIRTY_A]))
    line, warning = results.provenance(frame).split("\n\n")
    assert line == f"Provenance: every record from commit {A[:12]}; 1 record from a dirty tree."
    assert warning.startswith("**Warning: not one snapshot** (records from a dirty tree)")
    assert "(clean tree)" not in results.provenance(frame)


def test_a_record_without_git_is_an_unknown_commit(tmp_path, monkeypatch):
    frame = results.load(folder(tmp_path, monkeypatch, [CLEAN_A, CLEAN_A, NO_GIT, OUTSIDE]))
    line, warning = results.provenance(frame).split("\n\n")
    assert line == f"Provenance: 2 commits ({A[:12]}: 2 records, unknown commit: 2 records)."
    assert "an unknown commit" in warning and "Warning: not one snapshot" in warning
    unknown = results.provenance(frame[frame["commit"].isna()])
    assert unknown.startswith("Provenance: every record from an unknown commit.\n\n**Warning: not one snapshot**")
    assert results.provenance(frame.drop(columns=list(results.GIT_COLUMNS))).startswith(
        "Provenance: every record from an unknown commit."
    )  # a frame without the columns at all (older callers' frames)


def test_suite_rows_count_once_per_record_path():
    """suite_stats.load names its records in `path`: a record's seeds are one record."""
    rows = [{"path": "a.json", "seed": s, "commit": A, "dirty": False} for s in range(3)]
    rows += [{"path": "b.json", "seed": s, "commit": B, "dirty": True} for s in range(3)]
    line, _ = results.provenance(pd.DataFrame(rows)).split("\n\n")
    assert line == f"Provenance: 2 commits ({A[:12]}: 1 record, {B[:12]}: 1 record); 1 record from a dirty tree."


# ---------------------------------------------------------------------------------------------------------------
# Every table of a report states it


def test_every_table_of_a_slice_states_its_records_provenance(tmp_path, monkeypatch):
    """Two slices (quick budget: one clean commit; smoke: mixed): each slice's Markdown and each of its table files
    carry their own records' provenance, never the other slice's."""
    out = folder(tmp_path, monkeypatch, [CLEAN_A, CLEAN_B, CLEAN_A, DIRTY_A])
    frame = results.load(out)
    clean = frame[frame["commit"] == A].assign(budget="quick", dirty=False)
    both = pd.concat([frame, clean], ignore_index=True)
    written = report.write_report(both, None, tmp_path / "report", formats=("md",), figures=False)
    md = written["markdown"]
    quick, smoke = md.split("## deep-narrow, budget smoke")  # slices in (arch, budget) order
    assert f"Provenance: every record from commit {A[:12]} (clean tree)." in quick and "Warning" not in quick
    assert f"Provenance: 2 commits ({A[:12]}: 3 records, {B[:12]}: 1 record); 1 record from a dirty tree." in smoke
    assert smoke.count("**Warning: not one snapshot**") == 1  # once per slice in report.md
    tables = sorted((tmp_path / "report" / "deep-narrow" / "smoke").glob("*.md"))
    assert len(tables) >= 6  # the two paper tables, four statistics tables and the cost table
    for path in tables:
        assert "1 record from a dirty tree" in path.read_text() and "Warning: not one snapshot" in path.read_text()
    for path in (tmp_path / "report" / "deep-narrow" / "quick").glob("*.md"):
        assert path.read_text().rstrip().endswith(f"every record from commit {A[:12]} (clean tree).")
    assert written["provenance"] == results.provenance(both)


def test_the_report_command_prints_each_sections_provenance(tmp_path, monkeypatch, capsys):
    out = folder(tmp_path, monkeypatch, [CLEAN_A, CLEAN_A, CLEAN_B, CLEAN_A])
    assert cli.main(["report", str(out), "--no-figures", "--format", "md,csv"]) == 0
    printed = capsys.readouterr().out.splitlines()
    expect = f"cell records: Provenance: 2 commits ({A[:12]}: 3 records, {B[:12]}: 1 record)."
    assert expect in printed
    assert any(line.startswith("cell records: **Warning: not one snapshot**") for line in printed)
    table = pd.read_csv(out / "report" / "deep-narrow" / "smoke" / "table-best-train.csv")
    assert "commit" not in table  # provenance lives in the Markdown; the CSV tables keep their columns


def test_the_real_model_table_states_its_provenance(tmp_path):
    def rec(method, git, base):
        per_seed = [
            {"seed": s, "status": "ok", "test_mse": base + 0.01 * s, "trainable_params": 10,
             "test_mse_per_task": {t: base + 0.01 * s for t in real_report.TASKS}}
            for s in range(3)
        ]  # fmt: skip
        record = {"method": method, "config": {}, "config_hash": "x", "per_seed": per_seed}
        store.write_json(record | ({"git": git} if git else {}), tmp_path / "run" / f"{method}.json")
        return tmp_path / "run" / f"{method}.json"

    paths = [rec("lora", CLEAN_A, 0.5), rec("instruct-queryable", CLEAN_A, 0.2)]
    written = real_report.write(paths, tmp_path / "one")
    assert written["markdown"].rstrip().endswith(f"Provenance: every record from commit {A[:12]} (clean tree).")
    paths.append(rec("head-only", NO_GIT, 0.8))
    written = real_report.write(paths, tmp_path / "mixed")
    assert f"2 commits ({A[:12]}: 2 records, unknown commit: 1 record)" in written["markdown"]
    assert "Warning: not one snapshot" in (tmp_path / "mixed" / "real.md").read_text()
    assert not {"record", "commit", "dirty"} & set(pd.read_csv(tmp_path / "mixed" / "real.csv"))


def test_the_pareto_table_states_its_provenance(tmp_path, monkeypatch):
    paths = [
        write_cell(tmp_path / "r", "matyas", "lora", CLEAN_A, monkeypatch),
        write_cell(tmp_path / "r", "matyas", "queryable", DIRTY_A, monkeypatch),
    ]
    frame = pareto.load(paths)
    written = pareto_report.write(frame, tmp_path / "pareto", "Pareto, matyas", "test MSE")
    assert f"every record from commit {A[:12]}; 1 record from a dirty tree." in written["markdown"]
    assert "Warning: not one snapshot" in (tmp_path / "pareto" / "pareto.md").read_text()
    assert not {"record", "commit", "dirty"} & set(pd.read_csv(tmp_path / "pareto" / "pareto.csv"))


# ---------------------------------------------------------------------------------------------------------------
# The Makefile's guard


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("git") is None, reason="needs make and git")
def test_snapshot_targets_refuse_a_dirty_tree(tmp_path):
    """check-clean, run for real in a scratch repository holding the Makefile: a clean tree and untracked files
    pass, a modified or a staged tracked file fails with the one message, ALLOW_DIRTY=1 lets it through; every
    snapshot target has it as a prerequisite."""
    makefile = Path(__file__).resolve().parent.parent / "Makefile"
    shutil.copy(makefile, tmp_path / "Makefile")
    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, capture_output=True, text=True, check=True)
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "add", "Makefile")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "m")
    make = lambda *a: subprocess.run(["make", "-s", *a], cwd=tmp_path, capture_output=True, text=True)
    message = "snapshot targets need a clean tree: commit or stash first (records must name one commit)"
    (tmp_path / "untracked.txt").write_text("x")
    assert make("check-clean").returncode == 0
    with open(tmp_path / "Makefile", "a") as f:
        f.write("\n# edited\n")
    dirty = make("check-clean")
    assert dirty.returncode != 0 and message in dirty.stderr
    assert make("check-clean", "ALLOW_DIRTY=1").returncode == 0
    git("add", "Makefile")  # staged only
    assert message in make("check-clean").stderr
    database = make("-pn", "check-clean").stdout  # the rules as make parsed them
    rules = [line for line in database.splitlines() if re.match(r"[a-z-]+-snapshot:", line)]
    named = {rule.split(":", 1)[0] for rule in rules}
    assert {"results-snapshot", "pareto-snapshot", "real-snapshot", "diag-snapshot", "suites-snapshot"} <= named
    for rule in rules:  # every snapshot target, however many the Makefile grows
        assert rule.split(":", 1)[1].split()[0] == "check-clean", rule  # first: checked before any command
