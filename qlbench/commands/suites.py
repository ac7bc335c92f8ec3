"""`qlbench suites`: the multi-task suites (one line each), one suite's tasks in full, or a check of a card file."""

from __future__ import annotations

from pathlib import Path

from qlbench import instructions, suites, text
from qlbench.commands import UsageError, path_arg, usage_errors
from qlbench.text import Column


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "suites",
        help="list the multi-task suites; with a name, its tasks, instructions and paraphrases",
        description="List the multi-task suites (cards under functions/suites/, each with a -same-instruction "
        "control); with a NAME, that suite's tasks in full; with --card FILE, check a suite card of your own.",
    )
    p.add_argument("name", nargs="?", help="a suite to show in full")
    p.add_argument(
        "--card",
        type=path_arg,
        metavar="FILE",
        help="check a suite card file and show it (one line naming the field if it is wrong)",
    )
    p.set_defaults(func=run)


def _place(t: suites.SuiteTask) -> str:
    parts = [t.function, f"{t.coefficients} coefficients"]
    if t.rotation_deg:
        parts.append(f"rotated {t.rotation_deg:g} deg")
    if any(t.offset):
        parts.append(f"moved ({t.offset[0]:g}, {t.offset[1]:g}) of the box")
    if t.flip:
        parts.append("upside down")
    return ", ".join(parts)


def show(s: suites.Suite) -> None:
    box = " x ".join(f"[{lo:g}, {hi:g}]" for lo, hi in s.bounds)
    print(f"{s.name}: {s.description}\ninput box {box}; backbone source: {_place(s.source)}\n")
    rows = []
    for t in s.tasks:
        mu, sd = s.standardisation(t)
        rows.append(dict(task=t.name, surface=_place(t), mean=mu, std=sd, instruction=t.instruction))
    sig = lambda v: text.num(v, 3)
    columns = [
        Column("task", "task"),
        Column("surface", "surface"),
        Column("raw mean", "mean", sig),
        Column("raw std", "std", sig),
        Column("instruction", "instruction"),
    ]
    print(text.table(rows, columns))
    print("\nLabels are standardised by each task's raw mean and std over its box (noise std 0.05 after that).")
    e = instructions.embed(s.instructions()).double()  # (T, 384), unit rows
    cos = (e @ e.T).tolist()
    print("\nHow alike the frozen encoder finds the instructions (cosine of their embeddings e(c); 1 = the same):\n")
    rows = [
        {"task": t.name, **{u.name: f"{cos[i][j]:.3f}" for j, u in enumerate(s.tasks)}} for i, t in enumerate(s.tasks)
    ]
    print(text.table(rows, [Column("task", "task"), *(Column(t.name, t.name) for t in s.tasks)]))
    print()
    print("Paraphrases (evaluation only):")
    for t in s.tasks:
        for p in t.paraphrases:
            print(f"  {t.name}: {p}")


def run(args) -> int:
    if args.card:
        path = Path(args.card)
        if not path.is_file():
            raise UsageError(f"no suite card at {path}")
        with usage_errors():
            show(suites.parse(path.stem, path.read_text(encoding="utf-8")))
        return 0
    with usage_errors():
        if args.name:
            show(suites.get(args.name))
            return 0
        rows = [
            dict(
                suite=n,
                tasks=", ".join(s.task_names),
                source=s.source.function,
                instructions="one for all" if len(set(s.instructions())) == 1 else "one per task",
                description=s.description,
            )
            for n in suites.names()
            for s in [suites.get(n)]
        ]
    columns = [Column(c, c) for c in ("suite", "tasks", "source", "instructions", "description")]
    print(text.table(rows, columns))
    return 0
