"""`qlbench suites`: the multi-task suites (one line each), one suite's tasks in full, or a check of a card file."""

from __future__ import annotations

from pathlib import Path

from qlbench import instructions, parametric, suites, text
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
    if any(t.shift):
        parts.append(f"shifted ({t.shift[0]:g}, {t.shift[1]:g})")
    if t.steepness != 1:
        parts.append(f"x{t.steepness:g} steep")
    if t.rotation_deg:
        parts.append(f"rotated {t.rotation_deg:g} deg")
    if any(t.offset):
        parts.append(f"moved ({t.offset[0]:g}, {t.offset[1]:g}) of the box")
    if t.flip:
        parts.append("upside down")
    return ", ".join(parts)


SHOWN = 8  # a suite of more tasks shows the first few of each split, and its cosine structure in summary


def shown(s: suites.Suite) -> list[int]:
    """The tasks `show` lists: all of a small suite; else the first 4 trained and 2 of each held-out split."""
    if len(s.tasks) <= SHOWN:
        return list(range(len(s.tasks)))
    picks = {"train": 4, "interpolation": 2, "extrapolation": 2, "": 4}
    out = []
    for i, t in enumerate(s.tasks):
        if sum(s.tasks[j].split == t.split for j in out) < picks[t.split]:
            out.append(i)
    return out


def show(s: suites.Suite) -> None:
    box = " x ".join(f"[{lo:g}, {hi:g}]" for lo, hi in s.bounds)
    print(f"{s.name}: {s.description}\ninput box {box}; backbone source: {_place(s.source)}\n")
    if s.train_per_task != suites.CARD_DEFAULTS["train_per_task"] or s.stages is not None:
        print(
            f"{len(s.tasks)} tasks, {len(s.tasks) - len(s.held_out)} trained and {len(s.held_out)} held out; "
            f"{s.train_per_task} training and {s.test_per_task} test samples per task; sequential schedule: "
            f"{len(s.schedule_stages('sequential'))} stages\n"
        )
    picked = shown(s)
    if len(picked) < len(s.tasks):
        print(f"The first tasks of each split ({len(picked)} of {len(s.tasks)}):\n")
    rows = []
    for t in (s.tasks[i] for i in picked):
        mu, sd = s.standardisation(t)
        rows.append(
            dict(
                task=t.name + (f" ({t.split})" if t.split else ""),
                surface=_place(t),
                mean=mu,
                std=sd,
                instruction=t.instruction,
            )
        )
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
    print("\nHow alike the frozen encoder finds the instructions (cosine of their embeddings e(c); 1 = the same):\n")
    if len(picked) < len(s.tasks):
        print(cosine_summary(s, e))
    else:
        cos = (e @ e.T).tolist()
        rows = [
            {"task": t.name, **{u.name: f"{cos[i][j]:.3f}" for j, u in enumerate(s.tasks)}}
            for i, t in enumerate(s.tasks)
        ]
        print(text.table(rows, [Column("task", "task"), *(Column(t.name, t.name) for t in s.tasks)]))
    print()
    print("Paraphrases (evaluation only):")
    for t in (s.tasks[i] for i in picked):
        for p in t.paraphrases:
            print(f"  {t.name}: {p}")


def cosine_summary(s: suites.Suite, e) -> str:
    """For a parametric suite: the sentences' cosine against the tasks' distance in parameter space (binned, with
    Spearman's rank correlation over every pair), and each held-out task's cosine to its nearest training task by
    parameters."""
    from scipy.stats import spearmanr

    p = [parametric.params(t) for t in s.tasks]
    cos = e @ e.T  # (T, T)
    pairs = [(i, j) for i in range(len(p)) for j in range(i + 1, len(p))]
    dist = [parametric.distance(p[i], p[j]) for i, j in pairs]
    sim = [cos[i, j].item() for i, j in pairs]
    rho = spearmanr(dist, sim).statistic
    edges = [0.0, 0.25, 0.5, 0.75, 1.0, 1.5, float("inf")]
    rows = []
    for lo, hi in zip(edges, edges[1:]):
        inside = [c for d, c in zip(dist, sim) if lo <= d < hi]
        if inside:
            rows.append(dict(bin=f"[{lo:g}, {hi:g})", pairs=len(inside), mean=sum(inside) / len(inside)))
    out = text.table(
        rows,
        [
            Column("parameter distance", "bin"),
            Column("pairs", "pairs"),
            Column("mean cosine", "mean", lambda v: f"{v:.3f}"),
        ],
    )
    out += f"\n\nSpearman correlation of cosine with parameter distance over {len(pairs)} pairs: {rho:.3f}"
    trained = [i for i in range(len(p)) if i not in s.held_out]
    rows = []
    for h in s.held_out:
        near = min(trained, key=lambda i: parametric.distance(p[h], p[i]))
        best = max(trained, key=lambda i: cos[h, i].item())
        rows.append(
            dict(
                task=s.tasks[h].name,
                near=s.tasks[near].name,
                d=parametric.distance(p[h], p[near]),
                c=cos[h, near].item(),
                best=s.tasks[best].name,
                cb=cos[h, best].item(),
            )
        )
    out += (
        "\n\nEach held-out task's nearest training task by parameters, and the training sentence nearest its own:\n\n"
    )
    f3 = lambda v: f"{v:.3f}"
    out += text.table(
        rows,
        [
            Column("held-out task", "task"),
            Column("nearest by parameters", "near"),
            Column("distance", "d", f3),
            Column("cosine", "c", f3),
            Column("nearest by sentence", "best"),
            Column("cosine ", "cb", f3),
        ],
    )
    return out


def run(args) -> int:
    if args.card:
        path = Path(args.card)
        if not path.is_file():
            raise UsageError(f"no suite card at {path}")
        with usage_errors():
            show(suites.parse(path.stem, path.read_text(encoding="utf-8")))
        return 0
    if args.name is not None and not args.name.strip():
        raise UsageError(f"the suite name is empty; give one of: {', '.join(suites.names())}, or none to list them")
    with usage_errors():
        if args.name:
            show(suites.get(args.name))
            return 0
        rows = [
            dict(
                suite=n,
                tasks=", ".join(s.task_names)
                if len(s.tasks) <= SHOWN
                else f"{len(s.tasks)}: {len(s.tasks) - len(s.held_out)} trained, {len(s.held_out)} held out",
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
