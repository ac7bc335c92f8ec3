"""qlbench.inputs: one parser per kind of typed input (lists, grids), and every command using it."""

from __future__ import annotations

import pytest

from qlbench import inputs

from helpers import one_line_error


def test_a_list_is_stripped_and_refuses_empty_and_repeated_items():
    assert inputs.items(" lora , dora ") == ["lora", "dora"]
    assert inputs.items("") == [] and inputs.items("   ") == [] and inputs.items(" , ") == []  # no item at all
    for text, problem in {
        "a,,b": "an empty item",
        "a,": "an empty item",
        ",a": "an empty item",
        "a, b,a": "'a' given twice",
    }.items():
        with pytest.raises(ValueError, match=problem):
            inputs.items(text, "--methods")


def test_a_grid_refuses_what_it_cannot_mean():
    axes = ("r", "M", "k")
    assert inputs.grid("r=4,8  k=1", axes) == {"r": (4, 8), "k": (1,)}
    bad = {
        "": "is empty",
        "r=4 r=8": "axis r given twice",
        "q=4": "bad item 'q=4'; write AXIS=V1,V2 with AXIS one of: r, M, k",
        "r=": "give one or more integers >= 1",
        "r=4,,8": "an empty item",
        "r=4,4": "'4' given twice",
        "r=four": "values must be integers",
        "r=0": "integers >= 1",
    }
    for text, problem in bad.items():
        with pytest.raises(ValueError, match=problem):
            inputs.grid(text, axes)


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["sweep", "--functions", "matyas,,levy"], "--functions: an empty item"),
        (["run", "--function", "matyas", "--methods", "lora,lora"], "--methods: 'lora' given twice"),
        (["pareto", "--function", "ackley", "--grid", "r=4 r=8"], "--grid: axis r given twice"),
        (["pareto", "--function", "ackley", "--grid", ""], "--grid is empty"),
        (["pareto", "--function", "ackley", "--methods", "lora,lora"], "'lora' given twice"),
        (["signal", "--function", "matyas", "--backbone-init", "kaiming,kaiming"], "'kaiming' given twice"),
        (["bench", "--archs", "deep-narrow,"], "--archs: an empty item"),
    ],
)
def test_every_command_refuses_a_bad_list_in_one_line_before_any_work(argv, problem, capsys, tmp_path):
    out = tmp_path / "out"
    line = one_line_error(capsys, [*argv, "--out", str(out)])
    assert problem in line
    assert not out.exists()


def test_a_folder_or_file_to_read_is_named_with_what_is_wrong(tmp_path):
    afile, folder, gone = tmp_path / "a.json", tmp_path / "results", tmp_path / "link"
    afile.write_text("{}")
    folder.mkdir()
    gone.symlink_to(tmp_path / "nowhere")
    assert inputs.folder(folder, "results folder") == folder and inputs.file(afile, "card") == afile
    for path, problem in (
        (afile, "is a file, not a folder"),
        (tmp_path / "x", "does not exist"),
        (gone, "is a symbolic link to nothing"),
    ):
        with pytest.raises(ValueError, match=f"results folder {path} {problem}"):
            inputs.folder(path, "results folder")
    with pytest.raises(ValueError, match=f"card {folder} is a folder, not a file"):
        inputs.file(folder, "card")


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["verify", "--results", "{file}", "--function", "matyas"], "results folder {file} is a file, not a folder"),
        (["verify", "--peft", "{file}"], "--peft adapter folder {file} is a file, not a folder"),
        (["compare", "{file}"], "results folder {file} is a file, not a folder"),
        (["diagnose", "{file}", "--function", "matyas"], "results folder {file} is a file, not a folder"),
        (["results", "{file}"], "results folder {file} is a file, not a folder"),
        (["report", "{missing}"], "results folder {missing} does not exist"),
    ],
)
def test_every_command_names_what_is_wrong_with_a_path_it_reads(argv, problem, capsys, tmp_path):
    """A file where a folder is read is called a file (verify said "does not exist", verify --peft named the report's
    folder), in one line, exit 2."""
    paths = {"file": str(tmp_path / "records.json"), "missing": str(tmp_path / "nothing")}
    (tmp_path / "records.json").write_text("{}")
    line = one_line_error(capsys, [a.format(**paths) for a in argv])
    assert problem.format(**paths) in line
