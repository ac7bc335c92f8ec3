"""The behaviour script: the same smoke-budget commands before and after a refactor, and a comparison of their output.

    python .ci/behaviour.py run OUT          # every command below, records and reports under OUT (about 10 minutes)
    python .ci/behaviour.py compare A B      # records equal field by field, reports equal line by line

A refactor that must not change behaviour (docs/design.md) runs `run` on the commit before it and on the commit
after it, then `compare`. Records must be equal except for the fields that name when, where and how fast they were
made (VOLATILE); reports must be equal except for their timing columns and provenance lines. Exit 1 on the first
differences (up to 20 printed), 0 when the two trees agree.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

Q = [sys.executable, "-c", "from qlbench.cli import entry; entry()"]
SMOKE = ["--budget", "smoke", "--threads", "1", "--no-progress"]
EVERY_RUN_METHOD = (
    "full-soap,full-adamw,lora,lora-matched,dora,hyra,replora,doran,vb-lora,share-lora,lora-per-task,task-lora,poly,"
    "moe-lora,lily,queryable,instruct-queryable,frozen,mean,peft:lora,peft:vera,peft:loha"
)


# the real-model runs at one seed and one epoch, two rows each
TINY_REAL = ["--methods", "lora,instruct-queryable", "--seeds", "1", "--epochs", "1", "--threads", "1", "--no-progress"]


def commands(out: Path) -> list[list[str]]:
    r = str(out / "results")
    return [
        ["run", "--function", "matyas", "--arch", "deep-narrow", "--methods", EVERY_RUN_METHOD, *SMOKE, "--out", r],
        ["run", "--function", "levy", "--arch", "transformer", "--methods", EVERY_RUN_METHOD, *SMOKE, "--out", r],
        [
            "run",
            "--function",
            "ackley",
            "--backbone-init",
            "kaiming",
            "--methods",
            "lora,queryable",
            *SMOKE,
            "--out",
            r,
        ],
        ["sweep", "--functions", "matyas,dropwave", "--methods", "lora,instruct-queryable", *SMOKE, "--out", r],
        [
            "suite",
            "--suite",
            "zoo-4",
            "--schedule",
            "joint",
            "--methods",
            "lora,text-lora,instruct-queryable",
            *SMOKE,
            "--out",
            r,
        ],
        ["suite", "--suite", "zoo-4", "--schedule", "sequential", "--methods", "lora,task-lora", *SMOKE, "--out", r],
        ["ablate", "--function", "matyas", *SMOKE, "--out", r],
        [
            "pareto",
            "--function",
            "matyas",
            "--methods",
            "lora",
            "--grid",
            "r=2,4",
            *SMOKE,
            "--out",
            str(out / "pareto"),
        ],
        ["real", *TINY_REAL, "--train-per-task", "16", "--out", str(out / "real")],
        ["real-lm", *TINY_REAL, "--out", str(out / "real-lm")],
        ["report", r, "--format", "md,csv", "--no-figures", "--out", str(out / "report")],
        ["results", r],
    ]


def run(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    for i, cmd in enumerate(commands(out)):
        done = subprocess.run([*Q, *cmd], capture_output=True, text=True)
        (out / f"{i:02d}-{cmd[0]}.out").write_text(done.stdout)
        print(f"{cmd[0]:8s} rc={done.returncode}", flush=True)
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            return 1
    return 0


# record fields that say when, where and how fast, not what was computed
VOLATILE = re.compile(
    r"(created_at|commit|commits|dirty|wall_time_s|latency_s_per_sample|peak_train_bytes|platform|"
    r"backbone_commits|elapsed_s|seconds|time_s|us_per_step)$"
)
# report columns and lines that carry timings, dates or provenance (a Pareto front: its L is against latency)
TIMING = re.compile(
    r"(wall time|µs|s/step|latency|front|seconds|eval s|× frozen|s/member|created_at|records from|commit|provenance|"
    r"generated)",
    re.I,
)
# what a refactor may rename without changing behaviour: a module's path in a legend (real.py moved from qlbench/ to
# qlbench/experiments/)
RENAMED = (("qlbench/experiments/", "qlbench/"), ("qlbench/records/", "qlbench/"), ("qlbench/metrics/", "qlbench/"))
ORDERLESS = {"target_modules"}  # peft writes a set of module names: its order is the process's hash seed's


def _mask(value, key: str = ""):
    if VOLATILE.search(key):
        return "<volatile>"
    if key in ORDERLESS and isinstance(value, list):
        return sorted(value)
    if isinstance(value, dict):
        return {k: _mask(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask(v) for v in value]
    return value


def _table_line(line: str) -> str:
    """A report line with its timing cells masked (a column whose header names a timing is masked by position)."""
    return "<timing>" if TIMING.search(line) else line


def _text(path: Path, root: Path) -> list[str]:
    text = path.read_text(errors="replace").replace(str(root), "<root>")
    for new, old in RENAMED:
        text = text.replace(new, old)
    lines = text.splitlines()
    timed: list[int] = []
    out = []
    if path.suffix == ".csv":
        return _csv(lines)
    for line in lines:
        cells = line.split("|")
        if len(cells) > 2 and any(TIMING.search(c) for c in cells):
            timed = [i for i, c in enumerate(cells) if TIMING.search(c)]
            out.append(line)
            continue
        if timed and len(cells) > max(timed):
            cells = ["<timing>" if i in timed else c for i, c in enumerate(cells)]
            out.append("|".join(cells))
            continue
        if len(cells) <= 2:
            timed = []
        out.append(_table_line(line))
    return out


def _csv(lines: list[str]) -> list[str]:
    """CSV rows with the timing columns (by header) masked."""
    import csv

    rows = list(csv.reader(lines))
    if not rows:
        return []
    timed = {i for i, h in enumerate(rows[0]) if TIMING.search(h)}
    return [",".join("<timing>" if i in timed else c for i, c in enumerate(r)) for r in rows]


def compare(a: Path, b: Path) -> int:
    diffs: list[str] = []
    files_a = {p.relative_to(a) for p in a.rglob("*") if p.is_file()}
    files_b = {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    for p in sorted(files_a ^ files_b):
        diffs.append(f"only in {'A' if p in files_a else 'B'}: {p}")
    for p in sorted(files_a & files_b):
        if p.suffix == ".json":
            x, y = (_mask(json.loads((root / p).read_text())) for root in (a, b))
            if x != y:
                diffs.append(f"record differs: {p}: {_first_difference(x, y)}")
        elif p.suffix in {".md", ".out", ".csv", ".txt"}:
            x, y = _text(a / p, a), _text(b / p, b)
            if x != y:
                line = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                diffs.append(f"text differs: {p} line {line + 1}")
        elif p.suffix in {".pt", ".gz", ".png", ".svg", ".pdf"}:
            continue  # snapshots, backbones, compressed tables and figures: their records and reports are compared
    for d in diffs[:20]:
        print(d)
    print(f"{len(files_a & files_b)} files in both; {len(diffs)} difference(s)")
    return 1 if diffs else 0


def _first_difference(x, y, path: str = "") -> str:
    if isinstance(x, dict) and isinstance(y, dict):
        for k in sorted(set(x) | set(y)):
            if x.get(k) != y.get(k):
                return _first_difference(x.get(k), y.get(k), f"{path}.{k}")
    if isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        for i, (u, v) in enumerate(zip(x, y)):
            if u != v:
                return _first_difference(u, v, f"{path}[{i}]")
    return f"{path}: {str(x)[:60]} != {str(y)[:60]}"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "run":
        sys.exit(run(Path(sys.argv[2])))
    if len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    sys.exit(__doc__)
