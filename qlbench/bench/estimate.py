"""The paper-table estimate of `qlbench bench`: the wall time of the full paper table of an arch, predicted from
the rates the run measured, in one process and with as many tasks at once as fit on the machine."""

from __future__ import annotations

import statistics

from qlbench import engine, zoo
from qlbench.bench.models import PRETRAINING


def paper_estimate(report: dict, arch: str = "deep-narrow", compiled: bool = False) -> dict | None:
    """Wall time of the full paper table of `arch` (nine functions x five seeds = 45 members per method) predicted from
    the measured rates at the largest E of the run (a method timed only narrower, at its widest: its `measured_at`):
    per method, the adaptation steps (5,000 epochs of the 400-sample target at batch 64 per member) at the stacked
    rate plus its evaluations (every 10 epochs and at 0) at the measured evaluation time, scaled linearly from E to
    45 members. With `compiled` (the paper budget compiles its training step on this device,
    engine.compile_by_default) a method's compiled rate at that E is used where the run measured one, plus its
    measured compile warm-up; on CUDA the captured step's rate at the widest stack the run captured
    (`training_rate`; `captured_at`), and its evaluation time at that stack where measured (captured, as a captured
    stage evaluates; never compiled). Where a method's step was also captured with TF32 matmuls, its `tf32_total_s`
    is the total at that rate (evaluation as measured, in float32), and `tf32_total_s` of the table the sum when
    every method has one: what TF32 would save, not what qlbench runs. Likewise `floor_s`: the training steps at
    the captured step's roofline floor (`roofline_ms`: no evaluation, no warm-up), the least these kernels can take
    on this device (fused kernels move fewer bytes and may go below it; their matmul FLOPs stay). The backbones'
    pretraining (once per arch for the 45 members, cached and shared by every method) is the `pretraining` row where
    the run timed it: 300 epochs of the 2,400 source samples per member, evaluated at its start and end on the
    source's 3,000 samples. None when the run has no throughput row of `arch`."""

    rows = [r for r in report["throughput"] if r["arch"] == arch]
    if not rows:
        return None
    E = max(r["members"] for r in rows)
    budget = engine.BUDGETS[arch]["paper"]
    members = 9 * budget.seeds
    # per method: steps per member, evaluations and their size against the timed one (the target's 1,200 samples)
    adaptation = (engine.steps(budget.adapt, zoo.TARGET_TRAIN), budget.adapt.epochs // budget.eval_every + 1, 1.0)
    pretraining = (engine.steps(budget.pretrain, zoo.SOURCE_TRAIN), 2, zoo.SOURCE_SIZE / zoo.TARGET_SIZE)
    comp = {r["method"]: r for r in report.get("compile", []) if r["arch"] == arch and r["members"] == E}
    # captured (CUDA): each method's widest measured stack, which may be wider than E (`tasks` adds the paper's 45
    # on CUDA, where a step's time barely grows with its members: linear scaling from E = 5 overstated it)
    cap: dict[str, dict] = {}
    for r in sorted(report.get("capture", []), key=lambda r: r["members"]):
        if r["arch"] == arch:
            cap[r["method"]] = r
    # each method's widest throughput row: full-soap's and pretraining's Transformers are timed at E = 5 alone (45
    # copies of the model with their optimizer states), and are scaled from there rather than left out
    widest: dict[str, dict] = {}
    for r in rows:
        if r["method"] not in widest or r["members"] > widest[r["method"]]["members"]:
            widest[r["method"]] = r
    methods = {}
    for r in widest.values():
        c = cap.get(r["method"])
        steps, evaluations, size = pretraining if r["method"] == PRETRAINING else adaptation
        rate, warmup, mode = training_rate(r, comp.get(r["method"]), c, compiled)
        train = members * steps / rate + warmup
        # an evaluation at the widest captured stack where the run timed one (CUDA), else at the row's E, linear in
        # members
        at = c if c is not None and "eval_s" in c else dict(eval_s=r["eval_s"], members=r["members"])
        evaluation = evaluations * size * at["eval_s"] * members / at["members"]
        methods[r["method"]] = dict(
            train_s=train, eval_s=evaluation, total_s=train + evaluation, mode=mode, warmup_s=warmup
        )
        if r["members"] != E:  # scaled from a narrower stack than the run's widest
            methods[r["method"]]["measured_at"] = r["members"]
        if c is not None and "roofline_ms" in c:  # the same steps at the captured step's roofline floor
            methods[r["method"]]["floor_s"] = members * steps * c["roofline_ms"] / 1e3 / c["members"]
        if c is not None and "captured_tf32_ms" in c:  # what TF32 matmuls would give (measured captured, eager forward)
            tf32 = members * steps * c["captured_tf32_ms"] / 1e3 / c["members"] + c["captured_tf32_warmup_s"]
            methods[r["method"]]["tf32_total_s"] = tf32 + evaluation
    out = dict(
        arch=arch, measured_at=E, members=members, methods=methods, total_s=sum(m["total_s"] for m in methods.values())
    )
    for key in ("tf32_total_s", "floor_s"):  # a table's total where every method has one
        if methods and all(key in m for m in methods.values()):
            out[key] = sum(m[key] for m in methods.values())
    if together := at_once(report, arch, methods):
        out["at_once"] = together
    if cap:
        out["captured_at"] = max(r["members"] for r in cap.values())
        if all("eval_s" in r for r in cap.values()):
            out["evaluated_at"] = out["captured_at"]
    threads = max(r["threads"] for r in rows if r["members"] == E)
    workers = (report.get("meta", {}).get("cpu_count") or 1) // threads
    if workers > 1:  # what `sweep --executor ray --threads <threads>` would run at once on this machine
        out["parallel"] = dict(workers=workers, threads=threads, total_s=list_schedule(methods, workers))
        measured = {
            r["method"]: r["together_vs_alone"]
            for r in report.get("side_by_side", [])
            if r["arch"] == arch and r["members"] == E and r["workers"] == workers and r["method"] in methods
        }
        if measured:  # each task slowed by its measured side-by-side ratio (the mean of those measured elsewhere)
            mean = statistics.mean(measured.values())
            slowed = {m: dict(total_s=v["total_s"] / measured.get(m, mean)) for m, v in methods.items()}
            out["parallel"] |= dict(measured_total_s=list_schedule(slowed, workers), together_vs_alone=measured)
    return out


def at_once(report: dict, arch: str, methods: dict[str, dict]) -> dict | None:
    """The table's total with the adapted methods of the run's `at_once` row trained as it trained them, its `width`
    at a time (`--methods-at-once`): their training steps, as the one-at-a-time estimate counts them (`train_s`
    without the warm-up), divided by the row's speed-up (a round at once against the same round one method after
    another, side by side in one run), so that the two totals differ by that ratio alone and not by how each
    timing was taken (on a data-centre GPU the row's 40-step chunks held full-soap's eigenbases' refreshes, which the
    capture rows' 4-step chunks mostly missed); their warm-ups (recordings, compilation) and evaluations counted one
    after another (an upper bound: they overlap too), the other methods (the pretraining, which comes first) as they
    are. None without such a row."""
    rows = [r for r in report.get("at_once", []) if r["arch"] == arch]
    inside = [m for m in rows[-1]["methods"] if m in methods] if rows else []
    if len(inside) < 2:
        return None
    r = rows[-1]
    train = sum(methods[m]["train_s"] - methods[m]["warmup_s"] for m in inside) / r["at_once_speedup"]
    one_by_one = sum(methods[m]["warmup_s"] + methods[m]["eval_s"] for m in inside)
    rest = sum(v["total_s"] for m, v in methods.items() if m not in inside)
    return dict(methods=inside, width=r["width"], speedup=r["at_once_speedup"], total_s=train + one_by_one + rest)


def training_rate(row: dict, comp: dict | None, cap: dict | None, compiled: bool) -> tuple[float, float, str]:
    """(model-steps/s, warm-up s, mode) of a method's paper-budget training step: captured (CUDA, `capture` rows;
    compiled too where the paper budget compiles and the run measured it), else compiled where the paper budget
    compiles (`compile` rows), else the eager stacked rate."""
    if cap is not None:
        if compiled and "compiled_captured_ms" in cap:
            rate = cap["members"] * 1e3 / cap["compiled_captured_ms"]
            # the compilation is timed in the compiled variant's warm-up (built and warmed first); the compiled +
            # captured variant reuses it, so its own warm-up is the recording's alone. A run pays both
            warmup = cap.get("compiled_warmup_s", 0.0) + cap["compiled_captured_warmup_s"]
            return rate, warmup, "compiled + captured"
        return cap["captured_rate"], cap["captured_warmup_s"], "captured"
    if compiled and comp is not None:
        return comp["compiled"], comp["warmup_s"], "compiled"
    return row["stacked"], 0.0, "eager"


def list_schedule(methods: dict[str, dict], workers: int) -> float:
    """Makespan of the methods' tasks (total_s each) on `workers`, each task taken in the given order by the first
    worker to be free, as Ray runs a sweep's tasks in submission order; tasks assumed to keep their rates."""
    free = [0.0] * workers
    for m in methods.values():
        i = free.index(min(free))
        free[i] += m["total_s"]
    return max(free)


def protocol_estimate(report: dict, benchmark, methods: list[str] | None = None) -> dict:
    """The one-process, one-thread training time of a benchmark protocol's board (`protocols.Benchmark`: its
    functions x seeds, at every rate of its learning-rate grid), predicted from a `qlbench bench` report's step
    times (compare.step_times: µs per member-step at the report's narrowest stack, one thread where the report was
    run so): per method, members x adaptation steps x µs. Evaluation and start-up are left out, so it is a floor of
    a run at the report's stack width; a wider stack (a sweep stacks every task and seed) runs faster per member.
    Returns {methods: {name: seconds}, missing: [methods without a step time], total_s}."""
    from qlbench.compare import step_times  # the leaderboard's reading of a bench report

    times = step_times(report, benchmark.arch)
    budget = engine.budget(benchmark.budget, benchmark.arch)
    members = len(benchmark.functions) * len(benchmark.seeds) * max(1, len(benchmark.lrs))
    steps = engine.steps(budget.adapt, zoo.TARGET_TRAIN)
    wanted = list(times) if methods is None else methods
    seconds = {m: members * steps * times[m] / 1e6 for m in wanted if m in times and m != PRETRAINING}
    missing = [m for m in wanted if m not in times]
    return dict(methods=seconds, missing=missing, total_s=sum(seconds.values()))
