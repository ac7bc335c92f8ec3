"""Every notebook in notebooks/ runs top to bottom without error, as a user would run it (cwd = notebooks/)."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from nbclient import NotebookClient

from qlbench import cli

NOTEBOOKS = Path(__file__).parents[1] / "notebooks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES_WRITTEN = {"01_function_zoo.ipynb": ["function_zoo.png"]}  # what each notebook must save
pytestmark = pytest.mark.xdist_group("notebooks")  # one worker: 02 and 03 read one smoke sweep


@pytest.fixture
def this_python_kernel(tmp_path, monkeypatch):
    """A `python3` kernelspec that launches this interpreter, found first on JUPYTER_PATH.

    A `python3` spec in the user's ~/.local/share/jupyter would otherwise win over the venv's, and could run a
    Python without qlbench.
    """
    write_kernel_spec(tmp_path / "jupyter" / "kernels" / "python3")  # argv[0] = sys.executable
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return "python3"


@pytest.fixture(scope="module")
def smoke_sweep(tmp_path_factory) -> Path:
    """A results folder as a user has one: a smoke sweep, which the notebooks only read."""
    out = tmp_path_factory.mktemp("results")
    argv = ["sweep", "--functions", "matyas,levy", "--budget", "smoke", "--seeds", "3", "--out", str(out)]
    methods = "lora,queryable,instruct-queryable,frozen,mean"
    assert cli.main([*argv, "--methods", methods, "--no-progress"]) == 0
    return out


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_runs(path, this_python_kernel, tmp_path, monkeypatch, request):
    figures = tmp_path / "figures"
    monkeypatch.setenv("QLBENCH_FIGURES_DIR", str(figures))  # the kernel inherits this environment
    if path.name in ("02_results.ipynb", "03_routing.ipynb"):  # the smoke sweep's folder, trained once for both
        monkeypatch.setenv("QLBENCH_RESULTS", str(request.getfixturevalue("smoke_sweep")))
    if path.name == "04_suites.ipynb":  # an empty folder: the notebook runs its own smoke suite into it
        monkeypatch.setenv("QLBENCH_RESULTS", str(tmp_path / "suite-results"))
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    NotebookClient(
        nb, kernel_name=this_python_kernel, timeout=300, resources={"metadata": {"path": str(NOTEBOOKS)}}
    ).execute()  # raises CellExecutionError on the first failing cell
    assert nb.cells[-1].outputs[0]["text"].strip() == sys.executable
    for name in FIGURES_WRITTEN.get(path.name, []):
        png = (figures / name).read_bytes()
        assert png[:8] == PNG_MAGIC and len(png) > 10_000
