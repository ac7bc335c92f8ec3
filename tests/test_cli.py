"""The command line: bad input gives one line and exit code 2; a smoke run prints the table and writes records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qlbench import cli

from helpers import fail_adapting, one_line_error, settings


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["run", "--function", "nope"], ["'nope'", "dropwave", "styblinski-tang"]),
        (["run", "--function", "dropwave", "--arch", "cnn"], ["'cnn'", "deep-narrow", "transformer"]),
        (["run", "--function", "dropwave", "--methods", "lora,bogus"], ["'bogus'", "queryable", "mean"]),
        (["run", "--function", "dropwave", "--budget", "huge"], ["'huge'", "paper", "quick", "smoke"]),
        (["run", "--function", "dropwave", "--seeds", "0"], ["seeds", ">= 1"]),
        (["run", "--function", "dropwave", "--seeds", "two"], ["--seeds", "'two'"]),
        (["run", "--function", "dropwave", "--hp", "top_k=9"], ["top_k", "n_atoms=8"]),
        (["run", "--function", "dropwave", "--hp", "rank=4"], ["rank", "valid:", "top_k"]),
        (["run", "--function", "dropwave", "--hp", "r"], ["key=value"]),
        (["run", "--function", "dropwave", "--device", "tpu"], ["'tpu'", "auto", "cpu"]),
        (["run", "--function", "dropwave", "--dtype", "half"], ["'half'", "float32", "float64"]),
        (["run"], ["--function"]),
        (["sweep", "--functions", "dropwave,nope"], ["'nope'", "levy"]),
        (["run", "--function", "dropwave", "--threads", "0"], ["threads", "from 1 to", "cores present"]),
        (["run", "--function", "dropwave", "--compile", "maybe"], ["'maybe'", "auto", "on", "off"]),
        (["run", "--function", "dropwave", "--capture", "maybe"], ["capture setting 'maybe'", "auto, on, off"]),
        (["run", "--function", "dropwave", "--device", "cpu", "--capture", "on"], ["needs a CUDA device", "auto, off"]),
        (["suite", "--suite", "zoo-4", "--device", "cpu", "--capture", "on"], ["needs a CUDA device", "auto, off"]),
        (["run", "--function", "dropwave", "--eps", "0"], ["eps", "finite number > 0", "0.0"]),
        (["run", "--function", "dropwave", "--eps", "nan"], ["eps", "finite number > 0", "nan"]),
        (["sweep", "--functions", "matyas", "--eps", "tiny"], ["--eps", "'tiny'"]),
        (["frobnicate"], ["frobnicate", "run"]),
        (["sweep", "--executor", "foo"], ["--executor", "'foo'", "'local'", "'ray'"]),
        (["sweep", "--ray-address", "auto"], ["--ray-address only applies to --executor ray", "local, ray"]),
        (["sweep", "--group-size", "2"], ["--group-size only applies to --executor ray", "local, ray"]),
        (["sweep", "--executor", "local", "--ray-retries", "0"], ["--ray-retries only applies", "local, ray"]),
        (["sweep", "--executor", "ray", "--group-size", "0"], ["--group-size must be >= 1"]),
        (["sweep", "--executor", "ray", "--ray-retries", "-1"], ["--ray-retries must be >= 0"]),
        (["run", "--function", "dropwave", "--executor", "ray"], ["unrecognized arguments: --executor ray"]),
        (["run", "--function", "dropwave", "--noise", "loud"], ["unknown label noise 'loud'", "relative, absolute"]),
        (["run", "--function", "matyas", "--hp", "r=" + "-" * 5000 + "1"], ["--hp r", "at most 200"]),
        (["pareto", "--function", "matyas", "--schedule", "sequential"], ["--schedule applies to --suite only"]),
        (["ablate", "--function", "matyas", "--schedule", "joint"], ["--schedule applies to --suite only"]),
        (["run", "--function", "matyas", "--out", "x" * 300], ["--out", "a name of 300 bytes", "at most 255"]),
        (["verify", "--out", "d/" + "y" * 256], ["--out", "a name of 256 bytes"]),
        (["report", "r/" * 2100], ["a path of 4,200 bytes", "at most 4,095"]),
        (["pareto", "--function", "matyas", "--schedule", "joint"], ["--schedule applies to --suite only"]),
        (["real", "--seeds", "100000000000"], ["--seeds must be an integer from 1 to 100"]),
        (["real", "--methods", "lora,lora"], ["given twice"]),
        (["real", "--train-per-task", "100000000"], ["train_per_task must be at most 10,000"]),
        (["suites", "--card", ""], ["--card", "empty path"]),
        (["suite", "--suite", "zoo-4", "--methods", ""], ["no method given"]),
        (["suite", "--suite", "zoo-4", "--hp", "instruction_source=generic"], ["'generic'", "valid: card, random"]),
        (["run", "--function", "matyas", "--instruction", "bad \udcff"], ["not valid UTF-8"]),
        *(
            (argv + ["--out", ""], ["--out", "empty path"])
            for argv in (
                ["run", "--function", "matyas"],
                ["suite", "--suite", "zoo-4"],
                ["pareto", "--function", "matyas"],
                ["ablate", "--function", "matyas"],
                ["real"],
                ["real-lm"],
                ["signal", "--function", "matyas"],
                ["diagnose", "results", "--function", "matyas"],
                ["report", "results"],
                ["bench"],
            )
        ),  # fmt: skip
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, expect):
    """(Never run unbounded: a thread count above the cores is refused before any work, tested on that path.)"""
    line = one_line_error(capsys, argv)
    for word in expect:
        assert word in line, line


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--function", "matyas", "--budget", "smoke"],
        ["sweep", "--functions", "matyas", "--budget", "smoke"],
        ["suite", "--suite", "zoo-4", "--budget", "smoke"],
        ["signal", "--function", "matyas"],
        ["bench", "--quick"],
        ["real"],
        ["pareto", "--function", "matyas", "--budget", "smoke"],
    ],
    ids=["run", "sweep", "suite", "signal", "bench", "real", "pareto"],
)
def test_more_threads_than_cores_are_refused_before_any_work(capsys, tmp_path, argv):
    out = tmp_path / "out"
    line = one_line_error(capsys, [*argv, "--threads", "999", "--out", str(out)])
    assert "threads must be an integer from 1 to" in line and "999" in line, line
    assert not out.exists()


def test_functions_lists_the_zoo(capsys):
    assert cli.main(["functions"]) == 0
    out = capsys.readouterr().out
    assert "dropwave" in out and "[-5.12, 5.12] x [-5.12, 5.12]" in out and "-1 at (0, 0)" in out
    zoo_lines = out.split("\n\n")[0].strip().splitlines()
    assert len(zoo_lines) == 10  # header + nine functions
    snr_rows = [line for line in out.splitlines() if line.startswith("| ") and "signal / noise" not in line]
    assert [r.split("|")[1].strip() for r in snr_rows] == [line.split()[0] for line in zoo_lines[1:]]
    # the default (relative) noise's row, and the legacy absolute noise's ratio in the last column
    assert "| dropwave        | 0.0194         | 4.69e-05       | 414            |" in out
    assert out.split("| dropwave ")[1].splitlines()[0].rstrip().endswith("| 7.8                      |")


def test_smoke_run_prints_the_table_and_writes_records(capsys, tmp_path):
    code = cli.main(
        [
            "run",
            "--function",
            "matyas",
            "--arch",
            "deep-narrow",
            "--budget",
            "smoke",
            "--methods",
            "lora,queryable,frozen,mean",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    for header in (
        "trainable",
        "× LoRA",
        "best train MSE",
        "best test MSE (test-selected)",
        "test MSE @ best-train epoch",
        "diverged",
    ):
        assert header in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert set(rows) >= {"lora", "queryable", "frozen", "mean"}
    assert "16,384" in rows["lora"] and "17,760" in rows["queryable"] and "1.084" in rows["queryable"]
    assert " ± " in rows["lora"]
    cells = tmp_path / "records" / "deep-narrow" / "matyas"
    assert sorted(p.name for p in cells.iterdir()) == ["frozen", "lora", "mean", "queryable"]
    assert [p.suffix for p in sorted((cells / "lora").iterdir())] == [".json", ".pt"]  # the model beside its record


def test_console_script_error_has_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "qlbench.cli", "run", "--function", "nope"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("qlbench run: error: unknown function 'nope'")
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_a_reader_that_leaves_ends_the_command_without_a_traceback():
    """`qlbench functions | head -1`: the pipe closes before the command has written (here before it starts), its
    writes fail with EPIPE; the command stops with status 1 and nothing on stderr, the interpreter's exit included
    (stdout buffered, as by default: its flush is what fails)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    argv = [sys.executable, "-m", "qlbench.cli", "functions"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    proc.stdout.close()  # the reader gone before the first write
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and err == "", err


def test_smoke_sweep_stacks_functions_times_seeds(capsys, tmp_path):
    """`sweep` trains one stack per method over every (function, seed) and writes a record per function."""
    code = cli.main(
        [
            "sweep",
            "--functions",
            "matyas,levy",
            "--arch",
            "deep-narrow",
            "--budget",
            "smoke",
            "--methods",
            "lora,mean",
            "--seeds",
            "2",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "matyas, levy on deep-narrow" in out
    rows = {tuple(c.strip() for c in line.split("|")[1:3]) for line in out.splitlines() if line.startswith("| ")}
    assert {(f, m) for f in ("matyas", "levy") for m in ("lora", "mean")} <= rows, out
    for function in ("matyas", "levy"):
        folder = tmp_path / "records" / "deep-narrow" / function
        assert sorted(p.name for p in folder.iterdir()) == ["lora", "mean"]
        (record,) = (folder / "lora").glob("smoke-*.json")
        info = json.loads(record.read_text())["train_info"]
        assert info["status"] == "ok" and info["stacked_members"] == 4  # 2 functions x 2 seeds in one stack


@pytest.mark.parametrize(
    "hp, word",
    [
        ("targets=('nosuch',)", "nosuch"),
        ("n_blocks=64", "n_blocks=64 exceeds"),
        ("top_k=True", "top_k"),
        ("alpha=big", "alpha must be a finite number > 0, got 'big'"),
        ("alpha=inf", "alpha must be a finite number > 0, got inf"),
        ("targets=('o',)", "none of them"),
    ],
)
def test_a_config_that_cannot_be_built_is_one_line_before_any_work(capsys, tmp_path, hp, word):
    line = one_line_error(
        capsys,
        [
            "run",
            "--function",
            "matyas",
            "--arch",
            "transformer",
            "--budget",
            "smoke",
            "--methods",
            "lora,queryable",
            "--hp",
            hp,
            "--out",
            str(tmp_path),
        ],
    )
    assert word in line
    assert not any(tmp_path.iterdir())  # nothing trained, nothing written


@pytest.mark.parametrize("methods", ["lora,mean", "lora"])
def test_a_failed_cell_is_one_line_per_cell_and_exit_1(capsys, tmp_path, monkeypatch, methods):
    fail_adapting(monkeypatch, "lora")
    code = cli.main(
        [
            "sweep",
            "--functions",
            "matyas,levy",
            "--budget",
            "smoke",
            "--methods",
            methods,
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 1 and "Traceback" not in err
    failed = [line for line in err.splitlines() if line.startswith("qlbench sweep: ") and "failed" in line]
    assert sorted(failed) == [
        f"qlbench sweep: {f}/lora failed: RuntimeError: planted failure" for f in ("levy", "matyas")
    ]
    rows = [line for line in out.splitlines() if line.startswith("| ") and "lora" in line]
    assert len(rows) == 2 and all("failed" in row for row in rows)  # a failed cell stays a row of the table


def test_executor_ray_without_ray_is_one_line_before_any_work(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as on a machine without Ray
    line = one_line_error(capsys, ["sweep", "--functions", "matyas", "--executor", "ray", "--out", str(tmp_path)])
    assert line == (
        "qlbench sweep: error: --executor ray needs Ray, which is not installed: pip install 'qlbench[ray]'; "
        "valid executors: local, ray"
    )
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("dtype, warned", [("float32", True), ("float64", False)])
def test_tiny_eps_in_float32_is_warned_before_work(capsys, tmp_path, dtype, warned):
    """eps 1e-30 is valid, but in float32 it diverges (g^2 underflows): one warning line on stderr that names
    the fix; in float64 none. Only `mean` runs, so nothing trains."""
    argv = ["run", "--function", "matyas", "--budget", "smoke", "--methods", "mean", "--seeds", "1"]
    code = cli.main(argv + ["--dtype", dtype, "--eps", "1e-30", "--out", str(tmp_path), "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0
    lines = [line for line in captured.err.splitlines() if "warning" in line]
    if warned:
        assert len(lines) == 1 and "eps 1e-30 in float32" in lines[0] and "--dtype float64" in lines[0], captured.err
    else:
        assert lines == [], captured.err


# --- the shared options (qlbench.commands.options) ---------------------------------------------------------------

TRAINS = ("run", "sweep", "suite", "pareto", "ablate")
OWN = {  # (command, option) whose settings are not the shared option's, and why (options.add(..., name=dict(...)))
    ("pareto", "--out"): "the grid's records, kept apart from the method tables' (default ./pareto-results)",
    ("pareto", "--methods"): "the methods that have a size grid (default queryable)",
    ("real", "--seeds"): "the real model has no budget: its own default, 3",
    ("real-lm", "--seeds"): "the causal-LM experiment has no budget: its own default, 3",
    ("real", "--methods"): "the real experiment's rows",
    ("real-lm", "--methods"): "the causal-LM experiment's rows",
    ("real", "--epochs"): "its own default, 10",
    ("real-lm", "--epochs"): "its own default, 20",
    ("signal", "--backbone-init"): "a list of inits, compared side by side",
    ("verify", "--out"): "the JSON report file",
    ("verify", "--budget"): "selects a record",
    ("verify", "--arch"): "selects a record",
    ("verify", "--function"): "selects a record",
    ("diagnose", "--budget"): "selects a record",
    ("diagnose", "--arch"): "selects a record",
    ("diagnose", "--backbone-init"): "selects a record",
    ("diagnose", "--out"): "the figure folder",
    ("report", "--arch"): "selects records",
    ("report", "--budget"): "selects records",
    ("report", "--backbone-init"): "selects records",
    ("report", "--out"): "the report folder",
    ("report", "--metric"): "the test table's metric",
    ("compare", "--metric"): "the metric compared with the baselines",
    ("compare", "--protocol"): "the protocol whose baselines are compared with (default zoo-v1)",
    ("compare", "--out"): "the folder of the leaderboard or validity page (none: print only)",
    ("items", "--metric"): "the metric the tasks are analysed on",
    ("items", "--out"): "the folder of the item-analysis page (none: print only)",
    ("items", "--methods"): "the panel of methods analysed (default: every method of each task)",
    ("items", "--seeds"): "the seeds analysed (default: every seed)",
    ("bench", "--compile"): "whether the torch.compile variants are measured (auto: not with --quick)",
    ("bench", "--out"): "the bench folder",
    ("bench", "--methods"): "every registered method by default",
    ("run", "--methods"): "the registry's methods and their summaries",
    ("sweep", "--methods"): "the registry's methods and their summaries",
    ("suite", "--methods"): "a suite's rows and variants",
    ("suite", "--schedule"): "required with a suite: default joint",
    ("diagnose", "--method"): "the routed methods a route map is drawn for",
    ("verify", "--method"): "the methods whose bounds are checked",
}


def subparsers() -> dict:
    import argparse

    (sub,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]
    for name in subparsers():
        assert f" {name}" in description.replace("\n", " "), (name, description)
    assert "pareto" in description and "real" in description


def test_every_shared_option_has_one_default_and_one_help():
    """A command that trains has every training and output option; any command that has an option of the same name
    has the shared one (its default and help), unless OWN says why not."""
    from qlbench.commands import options

    shared = options.TRAINING | options.OUTPUT
    for name, parser in subparsers().items():
        actions = {s: a for a in parser._actions for s in a.option_strings}
        if name in TRAINS:
            assert set(shared) <= set(actions), (name, sorted(set(shared) - set(actions)))
        for flag, option in options.SHARED.items():
            if flag not in actions or (name, flag) in OWN:
                continue
            spec = option.settings
            declared = spec.get("default", False if spec.get("action") == "store_true" else None)
            assert (actions[flag].default, actions[flag].help) == (declared, spec["help"]), (name, flag)


def declarations() -> dict[str, list[str]]:
    """option -> the command modules whose text declares it (`add_argument("--x"`), options.py left out."""
    import ast

    from qlbench import commands

    found: dict[str, list[str]] = {}
    for path in sorted(Path(commands.__file__).parent.glob("*.py")):
        if path.name == "options.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant) and str(first.value).startswith("--"):
                    found.setdefault(first.value, []).append(path.stem)
    return found


# options two commands declare that mean different things there (not one idea under one name)
HOMONYMS = {
    "--grid": "pareto's size grid; diagnose's route-map grid points",
    "--peft": "methods: list peft's tuners (a switch); verify: a saved peft adapter's folder",
}


def test_each_shared_option_is_declared_once():
    """No command module declares a shared option itself, and no option is declared by two command modules unless it
    names two different things (HOMONYMS): each shared option has one declaration, in options.py."""
    from qlbench.commands import options

    found = declarations()
    assert {f: m for f, m in found.items() if f in options.SHARED} == {}
    assert {f: m for f, m in found.items() if len(set(m)) > 1 and f not in HOMONYMS} == {}
    for flag in ("--arch", "--methods", "--function", "--out", "--budget", "--seeds"):
        assert flag in options.SHARED


def test_the_declaration_count_finds_a_planted_declaration(tmp_path, monkeypatch):
    from qlbench import commands

    (tmp_path / "planted.py").write_text('def register(p):\n    p.add_argument("--arch", default="x")\n')
    monkeypatch.setattr(commands, "__file__", str(tmp_path / "__init__.py"))
    assert declarations() == {"--arch": ["planted"]}


def test_the_library_plans_share_the_command_line_defaults():
    """A shared option's default is its settings object's field default (the CLI and the library cannot drift);
    --methods-at-once is auto on the command line (one method at a time off CUDA: the library's 1)."""
    import dataclasses

    from qlbench.commands import options
    from qlbench.settings import Execution, Protocol

    defaults = {
        target: {f.name: f.default for f in dataclasses.fields(cls)}
        for target, cls in (("protocol", Protocol), ("execution", Execution))
    }
    for flag, option in options.SHARED.items():
        if option.target and "default" in option.settings and flag != "--methods-at-once":
            default = option.settings["default"]
            expected = defaults[option.target][option.field]
            assert (Path(default) if option.field == "out_dir" else default) == expected, flag
    assert {f.name for c in (Protocol, Execution) for f in dataclasses.fields(c)} >= {
        o.field for o in options.SHARED.values() if o.target
    }


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["suite", "--suite", "zoo-4", "--compile", "on"], ["compile 'on'", "eager", "valid: auto, off"]),
        (["suite", "--suite", "zoo-4", "--noise", "absolute"], ["label noise 'absolute'", "valid: relative"]),
        (["suite", "--suite", "zoo-4", "--noise", "loud"], ["unknown label noise 'loud'"]),
        (["pareto", "--function", "matyas", "--hp", "r=4"], ["r is set by the queryable grid", "narrow the grid"]),
        (["pareto", "--function", "matyas", "--methods", "lora", "--hp", "top_k=2"], ["top_k", "valid: alpha"]),
        (["pareto", "--suite", "zoo-4", "--compile", "on"], ["compile 'on'", "valid: auto, off"]),
        (["pareto", "--function", "matyas", "--dtype", "half"], ["'half'", "float64"]),
        (["ablate", "--function", "matyas", "--hp", "tau_lang=0.5"], ["tau_lang is what", "varied:"]),
        (["ablate", "--suite", "zoo-4", "--hp", "instruction_source=card"], ["instruction_source is what"]),
        (["ablate", "--function", "matyas", "--noise", "loud"], ["unknown label noise 'loud'"]),
        (["verify", "--device", "tpu"], ["'tpu'", "auto"]),
    ],
)
def test_shared_options_a_command_cannot_honour_are_one_line_exit_2(capsys, tmp_path, argv, expect):
    line = one_line_error(capsys, [*argv, "--out", str(tmp_path / "out")] if argv[0] != "verify" else argv)
    for word in expect:
        assert word in line, line
    assert not (tmp_path / "out").exists()


def test_the_shared_options_reach_the_plans_of_pareto_and_ablate(tmp_path):
    from qlbench.experiments import ablation, pareto

    common = dict(arch="deep-narrow", budget="smoke", out_dir=tmp_path, dtype="float64", eps=1e-30, compile="off")
    grid = pareto.parse_grid("r=4 M=4 k=1")
    ((point, p),), _ = pareto.plans(
        "queryable",
        grid,
        **settings(function="matyas", overrides={"t_attn": 2.0}, **common, noise="absolute", force=True),
    )
    assert (p.dtype, p.eps, p.noise, p.force, p.compile) == ("float64", 1e-30, "absolute", True, False)
    assert p.capture is False  # --capture auto: on CUDA only
    assert (p.configs["queryable"].t_attn, p.configs["queryable"].n_atoms) == (2.0, 4)
    ((_, s),), _ = pareto.plans("lora", grid, **settings(suite="zoo-4", overrides={"t_attn": 2.0}, **common))
    assert (s.dtype, s.eps) == ("float64", 1e-30)  # t_attn: not lora's, left out as a sweep's --hp
    plans = ablation.plans(**settings(function="matyas", overrides={"t_attn": 2.0}, **common, backbone_init="kaiming"))
    assert {(q.backbone_init, q.dtype, q.configs["instruct-queryable"].t_attn) for q in plans.values()} == {
        ("kaiming", "float64", 2.0)
    }
    assert plans["no-instruction"].configs["instruct-queryable"].tau_lang == 0.0


def test_a_command_ends_with_the_engines_teardown(capsys, monkeypatch):
    """main() ends every command with engine.runtime.release (before the interpreter's own teardown, which crashed
    `bench --compile on` on CUDA after its report was written), also when the command fails; release collects
    garbage, then stops Inductor's compile workers, once a process has loaded them (a stand-in module here), and
    does nothing in a process that used neither CUDA nor Inductor."""
    import gc
    import sys
    import types

    from qlbench.engine import runtime

    calls = []
    real = runtime.release
    monkeypatch.setattr(runtime, "release", lambda: calls.append("release"))
    assert cli.main(["functions"]) == 0
    assert cli.main(["run", "--function", "nope"]) == 2
    assert calls == ["release", "release"]
    capsys.readouterr()

    calls.clear()
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect"))
    monkeypatch.delitem(sys.modules, "torch._inductor.async_compile", raising=False)
    real()
    assert calls == []  # neither CUDA nor Inductor in this process's view
    workers = types.SimpleNamespace(shutdown_compile_workers=lambda: calls.append("shutdown"))
    monkeypatch.setitem(sys.modules, "torch._inductor.async_compile", workers)
    real()
    assert calls == ["collect", "shutdown"]


def test_a_cuda_process_leaves_flushed_and_without_the_interpreters_teardown():
    """The console script (`cli.entry`) after CUDA (stood in for by `used_cuda`): it leaves through os._exit, so no
    atexit handler runs (the teardown that crashed `bench --compile on` on an H200), and its whole output reaches
    the pipe first (a pipe's stdout is buffered: without the flush the table would be lost) with main's status."""
    code = (
        "import atexit, sys; from qlbench import cli; cli.used_cuda = lambda: True; "
        "atexit.register(lambda: print('teardown ran', file=sys.stderr)); cli.entry()"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a pipe's stdout buffered, as by default
    argv = [sys.executable, "-c", code, "functions"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| styblinski-tang "), proc.stdout[-300:]  # the last row
    assert "teardown ran" not in proc.stderr


@pytest.mark.parametrize(
    "returned, raised, status, printed",
    [
        (0, None, 0, ""),
        (2, None, 2, ""),
        (None, SystemExit(None), 0, ""),  # argparse's --help and --version
        (None, SystemExit(2), 2, ""),  # argparse's malformed command line
        (None, SystemExit("stopped"), 1, "stopped"),
        (None, ZeroDivisionError("planted"), 1, "ZeroDivisionError: planted"),  # an error's traceback, printed
    ],
)
def test_the_console_script_exits_with_mains_status(monkeypatch, capsys, returned, raised, status, printed):
    """After CUDA, `entry` gives os._exit the status the interpreter would have exited with, having printed what it
    would have printed; without CUDA it leaves the exit to the interpreter (sys.exit, or main's exception itself)."""

    def ends():
        if raised is not None:
            raise raised
        return returned

    exits = []
    monkeypatch.setattr(cli, "main", ends)
    monkeypatch.setattr(cli.os, "_exit", exits.append)
    monkeypatch.setattr(cli, "used_cuda", lambda: True)
    cli.entry()
    assert exits == [status]
    assert printed in capsys.readouterr().err

    monkeypatch.setattr(cli, "used_cuda", lambda: False)
    with pytest.raises(BaseException) as left:
        cli.entry()
    assert exits == [status]  # os._exit not called again
    if raised is None:
        assert left.type is SystemExit and left.value.code == returned
    else:
        assert left.value is raised


def test_a_table_prints_where_the_output_encoding_is_ascii():
    """PYTHONIOENCODING=ascii: × prints as x (and ± as +/-), exit 0, no UnicodeEncodeError (the leaderboard's header
    has ×)."""
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    code = "from qlbench.cli import entry; entry()"
    out = subprocess.run(
        [sys.executable, "-c", code, "compare", "--leaderboard"], env=env, capture_output=True, timeout=300
    )
    assert out.returncode == 0, out.stderr.decode("ascii", "replace")[-500:]
    assert out.stdout.isascii() and b"Traceback" not in out.stderr
    assert b"| x LoRA |" in out.stdout and b"Demsar" in out.stdout


@pytest.mark.faults  # two smoke runs as processes of their own: `make test-faults`
@pytest.mark.parametrize("stream", ["stderr on a full device", "stdout closed"])
def test_a_run_whose_output_cannot_be_written_still_finishes(tmp_path, stream):
    """Progress and log lines to a stderr that fails (/dev/full), or a table for a stdout that is closed: the run
    finishes, exit 0, its record written; no line it could not write stops it."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    argv = ["run", "--function", "matyas", "--budget", "smoke", "--methods", "lora", "--seeds", "1", "--threads", "1"]
    code = "from qlbench.cli import entry; entry()"
    cmd = [sys.executable, "-c", code, *argv, "--out", str(tmp_path)]
    with open("/dev/full", "w") as full:
        if stream == "stdout closed":
            out = subprocess.run(cmd, stderr=subprocess.PIPE, preexec_fn=lambda: os.close(1), timeout=600)
        else:
            out = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=full, timeout=600)
    assert out.returncode == 0, out.stderr
    assert len(list((tmp_path / "records/deep-narrow/matyas/lora").glob("*.json"))) == 1


# options that name a file or folder: every command reads them through commands.path_arg (one parser per kind)
PATH_OPTIONS = {"out", "folder", "results", "card", "baselines", "figure", "peft"}


def hand_parsing(sources: dict[str, str]) -> list[str]:
    """'module:line' wherever a command parses a parsed option's text itself: args.X.split(...) (or rsplit,
    partition), int(args.X), float(args.X), rather than through the shared parsers (commands/__init__.py, inputs)."""
    import ast

    def from_args(node) -> bool:
        while isinstance(node, ast.Attribute | ast.Subscript):
            node = node.value
        return isinstance(node, ast.Name) and node.id == "args"

    found = []
    for module, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            splits = isinstance(f, ast.Attribute) and f.attr in ("split", "rsplit", "partition", "rpartition")
            casts = isinstance(f, ast.Name) and f.id in ("int", "float") and node.args and from_args(node.args[0])
            if (splits and from_args(f.value)) or casts:
                found.append(f"{module}:{node.lineno}")
    return found


def test_every_command_parses_paths_and_lists_through_the_shared_parsers():
    from qlbench import commands

    for name, parser in subparsers().items():
        for action in parser._actions:
            if action.dest in PATH_OPTIONS and action.nargs != 0:
                assert action.type is commands.path_arg, (name, action.dest)
    folder = Path(commands.__file__).parent
    sources = {p.stem: p.read_text() for p in folder.glob("*.py") if p.name not in ("__init__.py", "options.py")}
    assert hand_parsing(sources) == []


def test_the_hand_parsing_check_finds_planted_parsing():
    planted = "def run(args):\n    a = args.methods.split(',')\n    b = int(args.seed)\n    c = 'x,y'.split(',')\n"
    assert hand_parsing({"planted": planted}) == ["planted:2", "planted:3"]


@pytest.mark.parametrize(
    "argv, phrase",
    [
        (["suites", ""], "the suite name is empty; give one of: shifts-ackley"),
        (["verify", "--budget", ""], "argument --budget: empty; give one of: paper, quick, smoke"),
        (["diagnose", "/tmp", "--function", "matyas", "--budget", " "], "argument --budget: empty"),
        (["run", "--function", "matyas", "--budget", ""], "argument --budget: empty"),
    ],
)
def test_an_empty_name_is_refused_not_taken_as_unset(argv, phrase, capsys):
    assert phrase in one_line_error(capsys, argv)
