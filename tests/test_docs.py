"""The documentation holds together: the README stays a user's manual of at most README_MAX_LINES lines, every
relative Markdown link in README.md and docs/ resolves, no text file of the repository names a repository file
that is not in it (a docstring pointing at a page that moved, a module that became a package), and the README names
only options the commands' parsers have (`readme_option_problems`), as docs/gpu/gpu-check.sh's command lines do
(`gpu_check_problems`)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 350

# `[text](target)` and `![alt](target)`, with an optional "title" after the target.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL_SCHEMES = ("http://", "https://", "mailto:")

# A repository path: one of the repository's top-level folders, then a file name with an extension the repository
# holds. The look-behind makes the match start at the beginning of a path, so a path under a folder that is not
# one of these roots never matches part-way: `results/...` (the user's output folder, created at run time, never a
# repository file), `<out>/records/...`, `/shared/...`. Placeholder characters are matched so that the whole token
# can be skipped below.
ROOTS = ("qlbench", "tests", "docs", "functions", "notebooks", "figures")
EXTENSIONS = ("py", "md", "toml", "ipynb", "png", "pdf", "json", "csv.gz", "csv", "tex")  # csv.gz before csv
PATH_TOKEN = re.compile(
    rf"(?<![\w./<>*{{}}$-])((?:{'|'.join(ROOTS)})/[\w./<>*{{}},$-]*\.(?:{'|'.join(map(re.escape, EXTENSIONS))}))(?!\w)"
)
# Placeholders and patterns, not paths: `functions/<name>.toml`, `docs/results/diagnostics/*/x.md`,
# `figures/route-map-{a,b}.png`, `$(DIAG)/...`.
PLACEHOLDER = re.compile(r"[<>*{}$]")
# Documents of the project's shared reference folder, outside this repository. A bare mention (no folder) is
# dangling unless a file of that name sits next to the mentioning file (a relative link inside docs/).
OUTSIDE_NAMES = ("methods.md", "DESIGN.md", "function-zoo.md", "queryable-lora-paper.tex")
BARE_NAME = re.compile(rf"(?<![\w./-])({'|'.join(re.escape(n) for n in OUTSIDE_NAMES)})(?![\w-])")

# The text files scanned for references: sources and documentation. Data files (csv, tex, json) and binaries are
# left out; a notebook contributes its cells' sources, not their outputs.
TEXT_SUFFIXES = {".py", ".md", ".toml", ".ipynb"}
TEXT_NAMES = {"Makefile", ".ci/run"}
# This file names made-up paths on purpose (the planted trees below, the outside names above).
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()


def repository_files(root: Path) -> list[str]:
    """The repository's files, relative to `root`: tracked and untracked-but-not-ignored ones that exist on disk (a
    file deleted in the working tree but still in the index is gone). Skips the test outside a git checkout."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    run = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    if run.returncode != 0:
        pytest.skip("not a git checkout")
    return sorted({f for f in run.stdout.split("\0") if f and (root / f).is_file()})


def is_text_file(name: str) -> bool:
    return Path(name).suffix in TEXT_SUFFIXES or name in TEXT_NAMES


def text_of(path: Path) -> str:
    """A file's text as a reader sees it; for a notebook, its cells' sources only (outputs are generated)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".ipynb":
        cells = json.loads(text).get("cells", [])
        text = "\n".join("".join(c.get("source", [])) for c in cells)
    return text


def missing_references(root: Path, files: list[str]) -> list[str]:
    """'file: reference' for every repository path or bare outside-document name that a text file among `files`
    mentions and that is not among `files`."""
    known = set(files)
    missing = []
    for name in files:
        if not is_text_file(name):
            continue
        text = text_of(root / name)
        for token in dict.fromkeys(m.group(1) for m in PATH_TOKEN.finditer(text)):
            if not PLACEHOLDER.search(token) and token not in known:
                missing.append(f"{name}: {token}")
        for bare in dict.fromkeys(m.group(1) for m in BARE_NAME.finditer(text)):
            if (Path(name).parent / bare).as_posix().removeprefix("./") not in known:
                missing.append(f"{name}: {bare}")
    return missing


def broken_links(md: Path) -> list[str]:
    """The relative link targets of a Markdown file that resolve to nothing (anchors stripped; web and mail links,
    and links to an anchor of the same page, skipped)."""
    broken = []
    for target in LINK.findall(md.read_text(encoding="utf-8")):
        if target.startswith(EXTERNAL_SCHEMES) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (md.parent / path).exists():
            broken.append(target)
    return broken


def markdown_pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


# --- the repository ---------------------------------------------------------------------------------------------


def test_readme_is_a_manual_of_at_most_350_lines():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = {str(md.relative_to(ROOT)): b for md in markdown_pages(ROOT) if (b := broken_links(md))}
    assert not broken, f"links to nothing: {broken}"


def test_no_text_file_refers_to_a_repository_file_that_is_not_there():
    missing = [m for m in missing_references(ROOT, repository_files(ROOT)) if not m.startswith(f"{THIS_FILE}: ")]
    assert not missing, "references to files not in the repository:\n" + "\n".join(missing)


# --- the checkers themselves, on planted files -------------------------------------------------------------------


def plant(root: Path, files: dict[str, str]) -> list[str]:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return sorted(files)


def test_the_reference_scanner_finds_a_planted_missing_path_and_nothing_else(tmp_path):
    notebook = {
        "cells": [
            {"cell_type": "markdown", "source": ["See qlbench/zoo.py and ", "docs/lost.png", "."]},
            {"cell_type": "code", "source": ["x = 1"], "outputs": [{"text": "docs/only-in-output.md"}]},
        ]
    }
    files = plant(
        tmp_path,
        {
            "qlbench/zoo.py": '"""Cards in functions/<name>.toml; figures/route-map-{a,b}.png; docs/x/*/t.md."""',
            "qlbench/adapters/lora.py": '"""The form: methods.md. See qlbench/gone.py and qlbench/zoo.py."""',
            "docs/page.md": "Writes results/bench/bench.json and <out>/records/a.json; see [m](methods.md).",
            "docs/methods.md": "The forms. Also in docs/methods.md and qlbench/zoo.py.",
            "notebooks/n.ipynb": json.dumps(notebook),
            "figures/f.png": "not text",
            "Makefile": "# see tests/absent.py\n",
        },
    )
    assert missing_references(tmp_path, files) == [
        "Makefile: tests/absent.py",
        "notebooks/n.ipynb: docs/lost.png",
        "qlbench/adapters/lora.py: qlbench/gone.py",
        "qlbench/adapters/lora.py: methods.md",
    ]


def test_the_reference_scanner_passes_a_clean_tree(tmp_path):
    files = plant(tmp_path, {"qlbench/a.py": '"""See qlbench/b.py, tests/t.py::test_x."""', "qlbench/b.py": ""})
    files += plant(tmp_path, {"tests/t.py": "", "README.md": "Run `qlbench/a.py`; the report in results/report.md."})
    assert missing_references(tmp_path, files) == []


def test_the_link_checker_finds_a_broken_link_and_skips_web_links_and_anchors(tmp_path):
    plant(tmp_path, {"docs/a.md": "", "figures/f.png": ""})
    page = tmp_path / "docs" / "index.md"
    page.write_text(
        "[a](a.md#part) ![f](../figures/f.png) [dir](../docs/) [web](https://example.org/x.md) [mail](mailto:a@b.c) "
        '[here](#top) [t](a.md "title") [gone](gone.md) ![lost](../figures/lost.png)',
        encoding="utf-8",
    )
    assert broken_links(page) == ["gone.md", "../figures/lost.png"]


# --- the README's command-line text against the parsers ----------------------------------------------------------

OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
STATED_DEFAULT = re.compile(r"`(--[a-z][a-z0-9-]*)[^`]*`\s+\((?:[^()]*?, )?default `?(?:\./)?([\w.+-]+)")


def parsers() -> dict:
    """Every subcommand -> its parser, as `qlbench` builds them."""
    import argparse

    from qlbench import cli

    (sub,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def options_of(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


def defaults_of(parser) -> dict[str, object]:
    return {s: a.default for a in parser._actions for s in a.option_strings}


def readme_option_problems(text: str, commands: dict[str, set[str]], defaults: dict[str, object]) -> list[str]:
    """What the README's command-line text says that the parsers do not: an option a command lacks (in a command's
    bullet, in "`X` also takes", in an example `qlbench X ...` line), "the training options" for a command without
    all of them, "the options of `X`" for a command without all of X's, a **Training options** paragraph that does
    not name exactly the shared options (qlbench.commands.options) or states another default than `defaults`
    (run's). `commands`: command -> its options."""
    from qlbench.commands import options

    shared = set(options.TRAINING) | set(options.OUTPUT)
    problems = []
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    training = [p for p in paragraphs if p.startswith("**Training options**")]
    if len(training) != 1:
        problems.append(f"{len(training)} **Training options** paragraphs; want one")
    for para in training:
        named = set(OPTION.findall(para))
        if named != shared:
            problems.append(f"Training options: names {sorted(named - shared)}, leaves out {sorted(shared - named)}")
        for flag, stated in STATED_DEFAULT.findall(para):
            default = defaults.get(flag)
            if not (stated == str(default) or (isinstance(default, float) and float(stated) == default)):
                problems.append(f"Training options: {flag} default {stated}, the parser's is {default!r}")
    for bullet in (" ".join(b.split()) for b in re.findall(r"(?m)^- \*\*`.*(?:\n  .*)*", text)):
        names = re.findall(r"\*\*`([a-z]+)", bullet)
        if unknown := [n for n in names if n not in commands]:
            problems.append(f"README describes no such command {unknown}")
            continue
        rest = bullet
        for m in re.finditer(r"`([a-z]+)` also takes (.*?)(?:;|\.(?: |$))", bullet):  # options of that one alone
            name, part = m.groups()
            rest = rest.replace(part, "")
            problems += [
                f"{name}: README names {o}, which it lacks" for o in OPTION.findall(part) if o not in commands[name]
            ]
        for o in OPTION.findall(rest):
            if not any(o in commands[n] for n in names):
                problems.append(f"{'/'.join(names)}: README names {o}, which it lacks")
        if "the training options" in bullet:
            problems += [f"{n}: README says it takes the training options, it lacks {sorted(shared - commands[n])}"
                         for n in names if shared - commands[n]]  # fmt: skip
        for of in re.findall(r"the options of `([a-z]+)`", bullet):
            problems += [f"{n}: README says it takes the options of {of}, it lacks {sorted(commands[of] - commands[n])}"
                         for n in names if commands[of] - commands[n]]  # fmt: skip
    for name, args in re.findall(r"(?m)^ {4}qlbench ([a-z]+)(.*)$", text):
        if name not in commands:
            problems.append(f"example: no such command {name}")
            continue
        problems += [f"example qlbench {name}: no option {o}" for o in OPTION.findall(args.split("#")[0])
                     if o not in commands[name]]  # fmt: skip
    return problems


def readme_problems(text: str, drop: tuple[str, str] | None = None) -> list[str]:
    """readme_option_problems against the real parsers (less option drop[1] of command drop[0], to plant a bug)."""
    commands = {name: options_of(p) for name, p in parsers().items()}
    if drop:
        commands[drop[0]] = commands[drop[0]] - {drop[1]}
    return readme_option_problems(text, commands, defaults_of(parsers()["run"]))


def command_manual() -> str:
    """The README's command-line text and docs/commands.md (each command's own options), as one text."""
    return "\n\n".join((ROOT / p).read_text(encoding="utf-8") for p in ("README.md", "docs/commands.md"))


def test_the_readme_names_only_options_the_commands_have():
    assert readme_problems(command_manual()) == []


@pytest.mark.parametrize(
    "old, new, problem",
    [
        ("k=1,2']`\n  and the training options", "k=1,2']`\n  and the options of `run`",
         "pareto: README says it takes the options of run, it lacks ['--instruction', '--methods-at-once', "
         "'--protocol', '--snapshot-every']"),
        ("instruct-queryable] [--device D]`", "instruct-queryable] [--device D] [--compile C]`",
         "verify: README names --compile, which it lacks"),
        ("`--budget paper|quick|smoke` (default quick)", "`--budget paper|quick|smoke` (default smoke)",
         "Training options: --budget default smoke, the parser's is 'quick'"),
        (", `--force` (re-run finished cells)", "", "Training options: names [], leaves out ['--force']"),
        ("    qlbench bench    ", "    qlbench bench --hp r=4  ", "example qlbench bench: no option --hp"),
        ("`sweep` also takes", "`run` also takes", "run: README names --executor, which it lacks"),
    ],
)  # fmt: skip
def test_the_readme_option_check_finds_a_planted_mistake(old, new, problem):
    text = command_manual()
    assert old in text
    assert problem in readme_problems(text.replace(old, new, 1))


def test_the_readme_option_check_finds_a_command_that_lost_a_shared_option():
    problems = readme_problems(command_manual(), drop=("suite", "--compile"))
    assert "suite: README says it takes the training options, it lacks ['--compile']" in problems
    assert "suite: README names --compile, which it lacks" in problems  # its bullet's `--compile auto|off`


def gpu_check_commands(script: str) -> list[str]:
    """docs/gpu/gpu-check.sh's qlbench command lines, its shell variables given the values the script gives them."""
    from qlbench import adapters

    trained = ",".join(m for m in adapters.DEFAULT_METHODS if adapters.get(m).trains)
    values = {f"${k}": v for k, v in re.findall(r'^([A-Z]+)="([^"]*)"$', script, re.M)}  # P="run ..." and the like
    values |= {"$RES": "gpu-check-results", "$OUT": "gpu-check", "$arch": "deep-narrow", "$M": trained}
    lines = []
    # each qlbench command of a part ($Q; $QX, the same with a fault handler's timed stack dump; $QT, under a time
    # limit of its own); a check or a step after it (after && or ;) is not one
    for part in re.findall(r'"(\$Q[A-Z]* [^"]+)"', script):
        for cmd in re.split(r" && |; ", part):
            if re.match(r"\$Q[A-Z]* ", cmd):
                cmd = cmd.split(" ", 1)[1]
                for var, value in values.items():
                    cmd = cmd.replace(var, value)
                lines.append(cmd)
    return lines


def gpu_check_problems(script: str) -> list[str]:
    """What in docs/gpu/gpu-check.sh's qlbench command lines the CLI would refuse: each `$Q ...` command parsed by the
    real parser (its shell variables given the values the script gives them), its methods registered and bench's
    `--only` kinds known. The script runs only on a GPU machine, where a stale option costs a GPU call."""
    from qlbench import adapters, bench, cli, zoo
    from qlbench.commands import UsageError
    from qlbench.engine.budgets import BUDGETS

    problems = []
    for line in gpu_check_commands(script):
        argv = line.split()
        try:
            args = cli.build_parser().parse_args(argv)
        except (SystemExit, UsageError):
            problems.append(f"not parsed: {line}")
            continue
        for m in (getattr(args, "methods", None) or "").split(","):
            try:
                m and adapters.get(m)  # qlbench's own, peft:<type>
            except ValueError:
                problems.append(f"unknown method {m}: {line}")
        if getattr(args, "function", None) and args.function not in zoo.names():
            problems.append(f"unknown function {args.function}: {line}")
        for k in (getattr(args, "only", None) or "").split(","):
            if k and k not in bench.KINDS:
                problems.append(f"unknown measurement kind {k}: {line}")
        if getattr(args, "budget", None) and args.budget not in BUDGETS["deep-narrow"]:
            problems.append(f"unknown budget {args.budget}: {line}")
        if getattr(args, "compile", "auto") not in ("auto", "on", "off"):
            problems.append(f"unknown --compile {args.compile}: {line}")
    return problems


def test_gpu_check_runs_only_commands_the_cli_accepts(capsys):
    script = (ROOT / "docs" / "gpu" / "gpu-check.sh").read_text()
    assert len(re.findall(r'"\$Q ', script)) >= 4  # the quick run, bench, the paper cells
    assert gpu_check_problems(script) == []
    planted = script.replace("--only throughput,capture", "--only throughput,kernels").replace("--budget quick", "-b")
    planted = planted.replace("--compile on", "--compile yes")
    capsys.readouterr()
    # one problem per planted option in each command line (a variable such as $W reaches each command that uses it)
    planted_options = ("--only throughput,kernels", " -b ", "--compile yes")
    stale = sum(o in f"{line} " for line in gpu_check_commands(planted) for o in planted_options)
    assert stale >= 4 and len(gpu_check_problems(planted)) == stale
    unknown = gpu_check_problems(script.replace('PT="peft:lora,', 'PT="peft:nope,'))
    assert [p.split(":")[0] for p in unknown] == ["unknown method peft"] and "peft:nope" in unknown[0]


# A GPU call lasts at most 600 s, with the start, the wheels' install and the transfers in it: the default parts'
# limits must leave that room, or the last part (the CUDA tests) is cut short and the call is wasted.
GPU_CALL_PARTS_S = 560


def gpu_check_default_parts(script: str) -> tuple[list[str], dict[str, int], list[str]]:
    """docs/gpu/gpu-check.sh's default parts (its PARTS line), every part's limit in seconds (its `part NAME LIMIT`
    lines), and the default parts its header comment names."""
    default = re.search(r'^PARTS=" \$\{GPU_CHECK_PARTS:-([^}]*)\} "', script, re.M).group(1).split()
    limits = {name: int(limit) for name, limit in re.findall(r"^part ([\w-]+) (\d+) ", script, re.M)}
    header = re.search(r"^# GPU_CHECK_PARTS \(default, in this order: ([^;]*);", script, re.M).group(1).split()
    return default, limits, header


def gpu_check_default_problems(script: str) -> list[str]:
    """What is wrong with the script's default call: a part it names that does not exist, limits that do not fit
    one call, or a header that names other parts than the PARTS line runs."""
    default, limits, header = gpu_check_default_parts(script)
    problems = [f"default part {name} has no `part` line" for name in default if name not in limits]
    total = sum(limits.get(name, 0) for name in default)
    if total > GPU_CALL_PARTS_S:
        problems.append(f"default parts' limits add up to {total} s, over {GPU_CALL_PARTS_S} s")
    if header != default:
        problems.append(f"header names {header}, PARTS runs {default}")
    return problems


def test_gpu_check_default_call_fits_one_gpu_call():
    script = (ROOT / "docs" / "gpu" / "gpu-check.sh").read_text()
    default, limits, _ = gpu_check_default_parts(script)
    assert "test-cuda" in default and "run-quick" in default and len(limits) >= 8
    assert gpu_check_default_problems(script) == []
    # planted: the Transformer bench in the default in place of compiled-exit (as the script once had it): over the
    # call's time, and not what its header says
    planted = script.replace("compiled-exit test-cuda} ", "bench-transformer test-cuda} ")
    assert planted != script
    problems = gpu_check_default_problems(planted)
    assert any("add up to 625 s" in p for p in problems) and any("header names" in p for p in problems)
    assert "default part nope has no `part` line" in gpu_check_default_problems(
        script.replace("compiled-exit test-cuda} ", "nope test-cuda} ")
    )
