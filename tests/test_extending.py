"""Methods from outside qlbench (qlbench/adapters/outside.py, docs/extending.md): by package.module:NAME and by
entry point, end to end through `run` and `report`, and every error in one line."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from qlbench import adapters, cli

from helpers import one_line_error

EXAMPLE = Path(__file__).parents[1] / "docs/examples/qlbench-example-adapter"


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """Write small modules into a folder on sys.path: modules(name=source)."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(**sources):
        for name, source in sources.items():
            (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))

    return write


def test_each_wrong_method_spec_is_named_in_one_line(modules):
    modules(
        broken="import not_a_module_anywhere\n",
        plain="VALUE = 3\nclass Thing:\n    pass\n",
        clash="from qlbench.adapters import lora\nMETHOD = type(lora.METHOD)('lora', 's', lora.LoraConfig, "
        "lora.LoraLinear)\n",
    )
    cases = {
        "broken:METHOD": "module 'broken' does not import (ModuleNotFoundError",
        "plain:MISSING": "module 'plain' has no attribute 'MISSING'",
        "plain:VALUE": "is a int, not a qlbench Method instance",
        "plain:Thing": "is the class Thing, not a qlbench Method instance",
        "clash:METHOD": "is called 'lora', which clashes with another method of that name",
        "no-such-method": "unknown method 'no-such-method'; valid: ",
    }
    for spec, message in cases.items():
        with pytest.raises(ValueError, match=None) as err:
            adapters.get(spec)
        assert message in str(err.value) and "\n" not in str(err.value), (spec, str(err.value))


def test_the_cli_refuses_a_bad_spec_in_one_line_before_any_work(modules, capsys, tmp_path):
    modules(plain="VALUE = 3\n")
    out = tmp_path / "out"
    line = one_line_error(capsys, ["run", "--function", "matyas", "--methods", "plain:VALUE", "--out", str(out)])
    assert "not a qlbench Method instance" in line
    assert not out.exists()


def test_the_example_package_runs_by_spec_end_to_end(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    out = tmp_path / "results"
    argv = ["run", "--function", "matyas", "--arch", "deep-narrow", "--budget", "smoke", "--backbone-init", "kaiming"]
    argv += ["--methods", "lora,qlbench_example:METHOD", "--out", str(out), "--no-progress", "--threads", "1"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    (record,) = (out / "records/deep-narrow/matyas/gated-lora").glob("*.json")
    rec = json.loads(record.read_text())
    assert rec["run_info"]["config"]["method"] == "gated-lora"
    assert rec["run_info"]["config"]["method_config"] == {"r": 4}
    assert rec["run_info"]["settings"]["member_path"] == "stacked"
    assert all(s["status"] == "ok" for s in rec["train_info"]["per_seed"])
    capsys.readouterr()
    assert cli.main(["report", str(out), "--out", str(tmp_path / "report")]) == 0
    report = capsys.readouterr().out
    assert "gated-lora" in report and "lora" in report


@pytest.mark.slow
def test_the_example_package_is_compared_with_the_committed_baselines(monkeypatch, tmp_path, capsys):
    """Under protocol zoo-v1 (one function, one seed of its ten): `compare` pairs the example's record with the
    committed baselines and prints its test across functions against LoRA and its rank."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    out = tmp_path / "results"
    # on the protocol's shipped backbones: compare pairs records with the baselines only on the same networks
    argv = ["run", "--protocol", "zoo-v1", "--function", "matyas", "--seeds", "1"]
    argv += ["--methods", "qlbench_example:METHOD", "--out", str(out), "--no-progress"]
    assert cli.main([*argv, "--threads", "1"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert cli.main(["compare", str(out)]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if line.startswith("| gated-lora")]
    assert len(lines) == 1 and "of 45" in lines[0], printed  # one short row: against LoRA, best, frozen, mean
    assert cli.main(["compare", str(out), "--full"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if line.startswith("| gated-lora")]
    assert any("| lora " in line for line in lines), printed  # and every baseline pair behind --full
    assert "rank" in printed


def test_the_installed_example_answers_to_its_entry_point_name():
    """`make setup-dev` installs docs/examples/qlbench-example-adapter; its entry point names the method."""
    assert "gated-lora" in adapters.outside.entry_point_names()
    method = adapters.get("gated-lora")
    assert method.name == "gated-lora" and method.kind == "static"
    assert adapters.canonical("qlbench_example:METHOD") == "gated-lora"


@pytest.mark.slow  # a quick-budget run and a board of 45 methods: about 100 s on two cores (`make test-slow`)
def test_the_example_runs_under_the_protocol_and_takes_its_place_on_the_leaderboard(monkeypatch, tmp_path, capsys):
    """The outside researcher's path in two commands: `sweep --protocol zoo-v1` (one function, two seeds: a subset,
    said so) and `compare RESULTS --leaderboard`, which places gated-lora among the 44 baselines, names both sources
    in its provenance and says why its µs / step is blank; the record names the method's module and package."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    out = tmp_path / "results"
    argv = ["sweep", "--protocol", "zoo-v1", "--functions", "matyas", "--seeds", "2", "--methods", "gated-lora"]
    assert cli.main([*argv, "--out", str(out), "--no-progress", "--threads", "1"]) == 0, capsys.readouterr().err
    assert "a subset: 1 of its 9 functions, 2 of its 10 seeds" in capsys.readouterr().out
    (record,) = (out / "records/deep-narrow/matyas/gated-lora").glob("*.json")
    origin = json.loads(record.read_text())["run_info"]["settings"]["origin"]
    assert origin["module"] == "qlbench_example" and origin["package"] in (None, "qlbench-example-adapter")
    assert cli.main(["compare", str(out), "--leaderboard"]) == 0, capsys.readouterr().err
    page = capsys.readouterr().out
    rows = [line for line in page.splitlines() if line.startswith("| ") and "(yours)" in line]
    assert len(rows) == 1 and "gated-lora (yours)" in rows[0]
    assert len([line for line in page.splitlines() if line.startswith("| ") and "[" in line.split("|")[1]]) == 45
    provenance = next(line for line in page.splitlines() if line.startswith("Provenance:"))
    assert "baselines/zoo-v1/per-seed.csv.gz" in provenance and f"records in {out}" in provenance
    assert "No µs / step for gated-lora (yours)" in provenance
