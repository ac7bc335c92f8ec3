"""`qlbench run` (one function) and `qlbench sweep` (several, stacked functions x seeds; in this process or, with
`--executor ray`, as Ray tasks): plan, train, print the method table, exit 0 when every cell trained (diverged seeds
included), 1 when a cell failed."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time

from qlbench import adapters, instances, protocols, ray_executor, text, zoo
from qlbench.commands import UsageError, options, split_list, usage_errors
from qlbench.engine import cache
from qlbench.experiments import experiment, grid, planning, runner
from qlbench.records import results
from qlbench.records.store import DamagedFile, Store


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "run",
        help="pretrain, adapt with every method over seeds, print a mean ± std table",
        description="Pretrain a backbone on the source function, adapt it to the shifted "
        "target with each method over several seeds (stacked), write one JSON "
        "record per method and print a mean ± std table.",
    )
    options.add(p, "--function", function=dict(required=True))
    p.add_argument(
        "--instruction",
        metavar="TEXT",
        help="the instruction sentence instruct-queryable routes with, instead of the function card's",
    )
    add_experiment_options(p)
    p.set_defaults(func=lambda args: run(args, [args.function]))

    p = subparsers.add_parser(
        "sweep",
        help="run several functions (default: all nine) stacked functions x seeds",
        description="Like `run`, for several functions at once: every method trains one "
        "stack of all functions x seeds. Finished cells are skipped, so a sweep "
        "resumes.",
    )
    options.add(p, "--functions")
    add_experiment_options(p)
    p.add_argument(
        "--executor",
        default="local",
        choices=EXECUTORS,
        help="local: this process (default); ray: one Ray task per method stack, on a local Ray runtime or the "
        f"cluster at --ray-address (needs {INSTALL_RAY})",
    )
    p.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="attach to this Ray cluster (host:port, or auto for the one `ray start` runs here) instead of starting "
        "a local runtime; --executor ray only",
    )
    p.add_argument(
        "--group-size",
        type=int,
        metavar="N",
        help="functions per Ray task (default: all of a method's, the local executor's stack); smaller stacks fit one "
        "device but change float32 results at rounding level; --executor ray only",
    )
    p.add_argument(
        "--ray-retries",
        type=int,
        metavar="N",
        help="times Ray re-runs a task whose worker or node died (default 1; a task that raises is never retried); "
        "--executor ray only",
    )
    p.set_defaults(
        func=lambda args: run(args, None if args.functions == "all" else split_list(args.functions, "--functions"))
    )


EXECUTORS = ("local", "ray")
INSTALL_RAY = "pip install 'qlbench[ray]'"
RAY_OPTIONS = ("ray_address", "group_size", "ray_retries")


def check_executor(args) -> str:
    """The executor, after its options are checked (UsageError naming the problem and the valid choices)."""
    executor = getattr(args, "executor", "local")
    valid = f"valid executors: {', '.join(EXECUTORS)}"
    if executor == "ray" and args.methods_at_once not in (1, "auto"):
        raise UsageError("--methods-at-once only applies to --executor local (Ray runs each method stack as a task)")
    if executor != "ray":
        for name in RAY_OPTIONS:
            if getattr(args, name, None) is not None:
                raise UsageError(f"--{name.replace('_', '-')} only applies to --executor ray; {valid}")
        return executor
    if args.group_size is not None and args.group_size < 1:
        raise UsageError(f"--group-size must be >= 1 (functions per Ray task), got {args.group_size}")
    if args.ray_retries is not None and args.ray_retries < 0:
        raise UsageError(f"--ray-retries must be >= 0, got {args.ray_retries}")
    try:
        ray_executor.require()
    except ValueError:
        raise UsageError(f"--executor ray needs Ray, which is not installed: {INSTALL_RAY}; {valid}") from None
    return executor


def add_experiment_options(p: argparse.ArgumentParser) -> None:
    methods_help = "; ".join(f"{n}: {m.summary}" for n, m in adapters.REGISTRY.items())
    methods = dict(help=f"comma-separated (default: {','.join(adapters.DEFAULT_METHODS)}). {methods_help}")
    options.add(p, "--arch", "--methods", "--methods-at-once", "--snapshot-every", methods=methods)
    options.add(p, "--protocol")
    options.add_training_options(p)
    options.add_output_options(p)


def under_protocol(args, functions: list[str]) -> protocols.Benchmark | None:
    """--protocol NAME: the benchmark protocol, with its settings put into `args` (UsageError, one line, for an
    option that contradicts it, a seed count beyond its seeds or a function outside its functions); None without."""
    if args.protocol is None:
        return None
    with usage_errors():
        bench = protocols.get(args.protocol)
    if not bench.backbones:
        raise UsageError(f"protocol {bench.name} ships no backbones to run on")
    given = getattr(args, "given", set())
    for attr, value in bench.run_settings().items():
        flag = "--" + attr.replace("_", "-")
        if flag in given and getattr(args, attr) != value:
            raise UsageError(
                f"{flag} {getattr(args, attr)!r} contradicts protocol {bench.name} ({value!r}); leave it out"
            )
        setattr(args, attr, value)
    if args.seeds is not None and not 1 <= args.seeds <= len(bench.seeds):
        raise UsageError(f"--seeds {args.seeds}: protocol {bench.name} has seeds {bench.seeds[0]}-{bench.seeds[-1]}")
    args.seeds = args.seeds or len(bench.seeds)
    if outside := [f for f in functions if f not in bench.functions]:
        raise UsageError(f"function {outside[0]!r} is not in protocol {bench.name}: {', '.join(bench.functions)}")
    return bench


def install_backbones(bench: protocols.Benchmark, plan, log) -> None:
    """Put the protocol's shipped backbones (instances.py) into the plan's backbone cache (engine.cache.install),
    so that nothing is pretrained; a backbone already cached there that is another network is said in one line."""
    members = [(f, s) for f in plan.functions for s in plan.seeds]
    sources = sorted({(zoo.card_name(f), s) for f, s in members})  # a task variant runs on its card's backbones
    try:
        shipped = instances.load(bench.instances, bench.backbones, sources)
    except DamagedFile as err:
        raise UsageError(str(err)) from None
    others = cache.install(plan.backbones, members, plan.store, shipped, {"protocol": bench.name})
    if others:
        log(
            f"qlbench: {len(others)} backbone(s) in {plan.store.backbone_dir} (e.g. {others[0][0]} seed "
            f"{others[0][1]}) are other networks than protocol {bench.name}'s (pretrained by other code or on another "
            "machine); set aside, the protocol's are used"
        )
    if plan.pretrain_needed(members):  # a shipped file the cache would not read (another card version)
        raise UsageError(f"protocol {bench.name}'s backbones do not load here; nothing was trained")


def run(args, functions: list[str] | None) -> int:
    """`run` and `sweep`: `functions` None is sweep's "all": every card, or under --protocol its functions."""
    from qlbench import report  # imported here: seaborn and matplotlib would slow qlbench --help and bad input

    if args.methods is not None and not split_list(args.methods, "--methods"):
        raise UsageError("--methods is empty; give a comma-separated list, or leave it out for the default set")
    if functions is None:
        with usage_errors():
            functions = protocols.get(args.protocol).functions if args.protocol else zoo.names()
        functions = list(functions)
    bench = under_protocol(args, functions)
    executor = check_executor(args)
    # on Ray the largest node's CPUs bound the threads (ray_executor.check)
    protocol = options.protocol_of(args)
    execution = options.execution_of(args, check_threads=executor == "local")
    overrides = options.overrides_of(args)
    instruction = getattr(args, "instruction", None)
    if instruction is not None:
        if not instruction.strip():
            raise UsageError("--instruction is empty; give a sentence, or leave it out for the function card's")
        try:
            instruction.encode("utf-8")  # undecodable bytes arrive as lone surrogates, which nothing downstream encodes
        except UnicodeEncodeError:
            raise UsageError("--instruction is not valid UTF-8 text; give the sentence in UTF-8") from None
        if args.methods is not None and "instruct-queryable" not in split_list(args.methods, "--methods"):
            raise UsageError("--instruction only changes instruct-queryable, which is not in --methods")
        overrides["instruction"] = instruction
    methods = split_list(args.methods, "--methods") if args.methods else None
    rates = grid_rates(args, bench)
    settings = [protocol] if rates is None else [dataclasses.replace(protocol, lr=lr) for lr in rates]
    log = lambda message: print(message, file=sys.stderr, flush=True)
    t0 = time.perf_counter()  # the wall time printed includes starting (or reaching) Ray
    runs = []
    # a learning-rate grid gives every method the same trials, method by method, so that a grid stopped part way has
    # whole methods: here each method's rates as one stack (experiments/grid.py), on Ray one rate after another
    if rates is not None and len(rates) > 1 and executor == "local":  # each method's whole grid as one stack
        kwargs = [dict(functions=functions, methods=methods, protocol=one, overrides=overrides) for one in settings]
        runs = _train_grid(args, kwargs, execution, bench, log)  # every rate's plan checked before any work
    else:
        groups = [methods] if rates is None else [[m] for m in (methods or adapters.DEFAULT_METHODS)]
        if len(groups) > 1:  # every method checked before the first trains
            with usage_errors():
                experiment.plan(functions, methods, protocol=settings[0], overrides=overrides, execution=execution)
        with contextlib.ExitStack() as ray:  # a Ray runtime started here lives until the last plan has run
            for group in groups:
                for one in settings:
                    kwargs = dict(functions=functions, methods=group, protocol=one, overrides=overrides)
                    plan, cluster = _planned(args, kwargs, execution, executor, bench, log, ray)
                    if cluster is None:
                        paths = runner.run(plan, progress=not args.no_progress, log=log)
                    else:
                        retries = ray_executor.RETRIES if args.ray_retries is None else args.ray_retries
                        paths = ray_executor.run(
                            plan, group_size=args.group_size, retries=retries, progress=not args.no_progress, log=log
                        )
                    runs.append((plan, paths))
    by_lr = {}  # one table per rate, every method in it
    for plan, paths in runs:
        by_lr.setdefault(plan.budget.adapt.lr, (plan, []))[1].extend(paths)
    failed_any = False
    for plan, paths in by_lr.values():
        frame = results.load([p for p in paths if p.exists()], on_damaged=log)
        if not len(frame):
            log(f"qlbench {args.command}: no cell has a record yet (another process is training them); run again later")
            return 1
        print()
        if rates is not None:
            print(f"adaptation learning rate {plan.budget.adapt.lr:g} (grid of protocol {bench.name}):\n")
        print(text.markdown(report.method_table(frame)))
        if note := report.collapse_note(frame):
            print(f"\n{note}")
        failed = frame[frame["cell_status"] == "failed"].drop_duplicates("record")
        for row in failed.itertuples():
            log(f"qlbench {args.command}: {row.function}/{row.method} failed: {row.message}")
        failed_any |= bool(len(failed))
    plan = runs[-1][0]
    print(f"\nwall time {time.perf_counter() - t0:.1f} s; records in {plan.store.root / 'records' / plan.arch}")
    if left := snapshots_left(plan.store, plan.arch):
        log(f"qlbench {args.command}: {left}")
    return 1 if failed_any else 0


def grid_rates(args, bench: protocols.Benchmark | None) -> list[float] | None:
    """The adaptation learning rates a run under a benchmark with a grid trains (its grid, or the one --lr names;
    UsageError for a rate outside it); None without a grid."""
    if bench is None:
        return None
    if not bench.lrs:
        if args.lr is not None:
            raise UsageError(f"--lr contradicts protocol {bench.name} (its budget's rate); leave it out")
        return None
    if args.lr is None:
        return list(bench.lrs)
    if args.lr not in bench.lrs:
        raise UsageError(
            f"--lr {args.lr:g} is not in protocol {bench.name}'s grid: {', '.join(f'{x:g}' for x in bench.lrs)}"
        )
    return [args.lr]


def _planned(args, kwargs: dict, execution, executor: str, bench, log, ray: contextlib.ExitStack):
    """One plan of `run`, checked (every choice before Ray starts), its header printed; (plan, the Ray cluster it
    runs on or None: this process). A Ray runtime this process starts is entered in `ray`, and later plans reuse it."""
    cluster = None
    with usage_errors():
        # the device is resolved by the cluster's GPUs once it runs
        plan = experiment.plan(
            **kwargs, execution=dataclasses.replace(execution, cuda=None if executor == "local" else True)
        )
        if executor == "ray":
            cluster = ray.enter_context(ray_executor.connect(args.ray_address))
            plan = experiment.plan(**kwargs, execution=dataclasses.replace(execution, cuda=cluster.gpus > 0))
            ray_executor.check(plan, cluster)
    for caveat in planning.caveats(plan):
        log(f"qlbench {args.command}: warning: {caveat}")
    if bench is not None:
        install_backbones(bench, plan, log)
        subset = len(plan.functions) < len(bench.functions) or len(plan.seeds) < len(bench.seeds)
        print(
            f"qlbench {args.command}: under protocol {bench.name}, on its shipped backbones"
            + (f" (a subset: {len(plan.functions)} of its {len(bench.functions)} functions, "
               f"{len(plan.seeds)} of its {len(bench.seeds)} seeds)" if subset else ""),
            flush=True,
        )  # fmt: skip
    b = plan.budget
    where = f"; executor ray ({cluster.cpus} CPU(s) on the largest node, {cluster.gpus} GPU(s))" if cluster else ""
    print(
        f"qlbench {args.command}: {', '.join(plan.functions)} on {plan.arch}"
        f"{'' if plan.backbone_init == 'default' else f' ({plan.backbone_init} init)'}, budget {b.name} ("
        f"{f'backbones of protocol {bench.name}' if bench else f'pretrain {b.pretrain.epochs} epochs'}, adapt "
        f"{b.adapt.epochs} epochs at lr {b.adapt.lr:g}), seeds {plan.seeds}, methods "
        f"{', '.join(plan.methods)}, device {plan.device}{', compiled' if plan.compile else ''}{where}",
        flush=True,
    )
    return plan, cluster


def _train_grid(args, kwargs: list[dict], execution, bench: protocols.Benchmark, log):
    """A run over a benchmark's learning-rate grid in this process (experiments/grid.py): a plan per rate, each
    checked before any work, every method's grid one stack where its optimiser allows; [(plan, record paths)]."""
    with usage_errors():
        plans = [experiment.plan(**kw, execution=execution) for kw in kwargs]
    plan = plans[0]
    for caveat in planning.caveats(plan):
        log(f"qlbench {args.command}: warning: {caveat}")
    install_backbones(bench, plan, log)
    rates = ", ".join(f"{p.budget.adapt.lr:g}" for p in plans)
    print(
        f"qlbench {args.command}: under protocol {bench.name}, on its shipped backbones: "
        f"{', '.join(plan.functions)} on {plan.arch}, budget {plan.budget.name} (adapt {plan.budget.adapt.epochs} "
        f"epochs at each rate of its grid: {rates}; a method's rates in one stack where its optimiser allows), "
        f"seeds {plan.seeds}, methods "
        f"{', '.join(plan.methods)}, device {plan.device}{', compiled' if plan.compile else ''}",
        flush=True,
    )
    runner.run(grid.Grid(plans), progress=not args.no_progress, log=log)
    return [(p, [path for path in experiment.record_paths(p) if path.exists()]) for p in plans]


def snapshots_left(store: Store, arch: str) -> str | None:
    """What the results folder still holds of snapshots on `arch` once a run is over, or None: a run removes its own
    stacks' as their records are written, so these are stacks of other configurations stopped mid-stage (or one of
    this run that failed, or one another process is training). A run of their configuration resumes from them; until
    then they only take space (a Transformer full-soap stack of 5: about 1.2 GB)."""
    sizes = []
    for path in store.snapshots(arch):
        with contextlib.suppress(FileNotFoundError):  # removed meanwhile by the process that trains it
            sizes.append(path.stat().st_size)
    if not sizes:
        return None
    return (
        f"{len(sizes)} snapshot(s) of stacks stopped mid-stage remain in {store.snapshot_dir(arch)} "
        f"({sum(sizes) / 1e6:.1f} MB): a run of the same configuration resumes from them; delete them to free the space"
    )
