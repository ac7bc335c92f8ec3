"""The Ray executor: a plan's cells as Ray tasks, on a local Ray runtime or on a cluster (`qlbench sweep --executor
ray [--ray-address ADDR]`). Ray is an optional extra (`pip install 'qlbench[ray]'`), imported only inside functions
here, so `import qlbench` never needs it.

    driver                                   tasks (Ray workers, any node)
    runner.claimed: unfinished cells
    one pretraining task  ---------------->  engine.pretrain: train the missing backbones, cache them in the store
    one task per unit of work  ----------->  reload the unit's members from the cache, experiment.train_method:
                                             adapt the stack, commit one record per cell (atomic writers)
    collect: a task that raised or whose worker died -> `failed` records for its cells (the next run retries them)

A unit of work is one method's stack over a group of (function, seed) members: by default all of the method's
unfinished functions, the very stack the local executor trains (so the numbers are identical); `group_size`
splits it into groups of that many functions, so a task fits one device (float32 numbers then move at rounding
level: docs/design.md, "Determinism"). A task asks Ray for one GPU when the plan's device is CUDA, else for its CPU
threads. The results folder must be one every node sees (a shared file system): tasks read the backbone cache and
write their records there, and the driver checks that it sees them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qlbench import adapters, engine, zoo
from qlbench.experiments import experiment, runner
from qlbench.progress import bar as progress_bar  # `progress` is the functions' on/off argument

INSTALL = "pip install 'qlbench[ray]'"
RETRIES = 1  # times Ray re-runs a task whose worker or node died (an exception raised by a task is never retried)


def _ray():
    try:
        import ray
    except ImportError:
        raise ValueError(f"Ray is not installed: {INSTALL}") from None
    return ray


def require() -> None:
    """ValueError (one line, how to install it) when Ray cannot be imported."""
    _ray()


@dataclass(frozen=True)
class Cluster:
    """What the tasks can ask for: the CPUs of the largest alive node and the GPUs of the whole cluster."""

    cpus: int
    gpus: int


def _cluster() -> Cluster:
    nodes = [n["Resources"] for n in _ray().nodes() if n.get("Alive")]
    return Cluster(int(max((n.get("CPU", 0) for n in nodes), default=0)), int(sum(n.get("GPU", 0) for n in nodes)))


@contextlib.contextmanager
def connect(address: str | None = None, *, num_cpus: int | None = None):
    """Yield the Cluster of a Ray runtime: the one this process already runs (a notebook, a test), else a cluster
    at `address` (`auto`: the one `ray start` set up on this machine), else a new local runtime (on `num_cpus`,
    default all). A runtime started here is shut down on exit. ValueError (one line) when Ray is missing or the
    address cannot be reached."""
    ray = _ray()
    started = False
    if not ray.is_initialized():
        try:
            ray.init(
                address=address,
                num_cpus=num_cpus if address is None else None,
                include_dashboard=False,
                logging_level=logging.WARNING,
            )
        except Exception as err:  # ConnectionError, ValueError, RuntimeError ... from ray.init
            where = f"the Ray cluster at {address}" if address else "a local Ray runtime"
            raise ValueError(f"cannot start or reach {where}: {_first_line(err)}") from None
        started = True
    try:
        yield _cluster()
    finally:
        if started:
            ray.shutdown()


@dataclass(frozen=True)
class Unit:
    """One Ray task: `method` adapted on the stack of `functions` x the plan's seeds."""

    method: str
    functions: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.method} on {', '.join(self.functions)}"


def units(p: experiment.Plan, todo: dict[str, list[str]], group_size: int | None = None) -> list[Unit]:
    """The units of work: each method's unfinished functions, in groups of `group_size` (None: one group)."""
    out = []
    for m in p.methods:
        fs = todo[m]
        size = group_size or max(len(fs), 1)
        out += [Unit(m, tuple(fs[i : i + size])) for i in range(0, len(fs), size)]
    return out


def resources(p: experiment.Plan, threads: int | None, cluster: Cluster) -> tuple[dict, int]:
    """(Ray resource request, intra-op threads) of a task: one GPU when the plan's device is CUDA, else `threads`
    CPUs (None: every CPU of the largest node). ValueError when no node can ever run it."""
    if p.device.type == "cuda":
        if cluster.gpus < 1:
            raise ValueError(f"device {p.device} but the Ray cluster has no GPU; valid: a cluster with GPUs, or cpu")
        n = threads or 1
        return {"num_gpus": 1, "num_cpus": n}, n
    n = threads or cluster.cpus
    if not 1 <= n <= cluster.cpus:
        raise ValueError(f"threads {n} exceed the largest Ray node's {cluster.cpus} CPU(s); valid: 1..{cluster.cpus}")
    return {"num_gpus": 0, "num_cpus": n}, n


def check(p: experiment.Plan, cluster: Cluster) -> None:
    """ValueError (one line) when the plan's device or threads ask for more than the cluster has."""
    resources(p, p.threads, cluster)


def run(
    p: experiment.Plan,
    *,
    group_size: int | None = None,
    retries: int = RETRIES,
    progress: bool = True,
    log=print,
) -> list[Path]:
    """Run every unfinished cell of the plan as Ray tasks (connecting as `connect` does when Ray is not running
    yet); returns the record paths of all cells, as `runner.run`. A unit whose task fails (an exception, a
    dead worker or node) is logged in one line and written as failed records; the other units go on."""
    if group_size is not None and not (isinstance(group_size, int) and group_size >= 1):
        raise ValueError(f"group size must be an integer >= 1, got {group_size!r}")
    if not (isinstance(retries, int) and retries >= 0):
        raise ValueError(f"retries must be an integer >= 0, got {retries!r}")
    ray = _ray()
    with connect() as cluster, runner.claimed(p, log) as mine:
        todo = experiment.by_method(p, mine)
        work = units(p, todo, group_size)
        if not work:
            return experiment.record_paths(p)
        union = [f for f in p.functions if any(f in fs for fs in todo.values())]
        # the local executor's thread count (by the whole sweep's members) unless the stacks are split
        members = lambda unit: len(p.seeds) * (len(union) if group_size is None else len(unit.functions))
        plans = [resources(p, experiment.threads(p, members(u)), cluster) for u in work]
        pre_resources = resources(p, experiment.threads(p, len(union) * len(p.seeds)), cluster)
        reporter = ray.remote(num_cpus=0)(_Progress).remote() if progress else None
        try:
            if not _pretrain(ray, p, union, pre_resources, retries, reporter, progress, log):
                return experiment.record_paths(p)
            _adapt(ray, p, work, plans, retries, reporter, progress, log)
        finally:
            if reporter is not None:
                ray.kill(reporter)
    return experiment.record_paths(p)


def _pretrain(ray, p, functions, task_resources: tuple[dict, int], retries, reporter, progress, log) -> bool:
    """Pretrain (or check the cache of) every member once, in one task of `task_resources` (`resources`: the Ray
    request, the intra-op threads); False when it failed (every pending cell is then written as failed)."""
    request, threads = task_resources
    members = [(f, s) for f in functions for s in p.seeds]
    needed = p.pretrain_needed(members)
    total = engine.steps(p.budget.pretrain, zoo.SOURCE_TRAIN) if needed else 0
    task = ray.remote(_pretrain_task).options(**request, max_retries=retries, name=f"qlbench pretrain {p.arch}")
    t0 = time.perf_counter()
    outcome = {}
    keep = lambda key, result: outcome.update(result=result)
    desc = f"pretrain {p.arch} x{len(members)}"
    with progress_bar(total=total, desc=desc, unit="step", disable=not progress, leave=False) as bar:
        ref = task.remote(p, members, threads, reporter, "pretrain")
        _wait(ray, {ref: "pretrain"}, {"pretrain": total}, reporter, bar, keep)
    if isinstance(outcome["result"], ray.exceptions.RayError):
        message = f"pretraining failed: {_describe(outcome['result'])}"
        log(f"{p.arch}: {message}")
        for m, fs in experiment.by_method(p, runner.pending(p, lambda _: None)).items():
            experiment.write_failed(p, m, fs, message, time.perf_counter() - t0)
        return False
    for message in outcome["result"]:
        log(message)
    return True


def _adapt(ray, p, work, plans, retries, reporter, progress, log) -> None:
    """One task per unit; each outcome is handled as its task ends."""
    steps = engine.steps(p.budget.adapt, zoo.TARGET_TRAIN)
    totals = {i: steps if adapters.get(u.method).trains else 0 for i, u in enumerate(work)}
    task = ray.remote(_adapt_task)
    started = {}

    def done(i: int, outcome) -> None:
        unit = work[i]
        if isinstance(outcome, ray.exceptions.RayError):
            message = _describe(outcome)
            log(f"{unit}: failed: {message}")
            experiment.write_failed(p, unit.method, list(unit.functions), message, time.perf_counter() - started[i])
            return
        host, messages = outcome
        for message in messages:
            log(message)
        if missing := [f for f in unit.functions if not p.record_path(f, unit.method).exists()]:
            message = (
                f"records not found: the task ran on {host} but its records are not in {p.store.root} as this "
                "machine sees it; the results folder must be on a file system every node shares"
            )
            log(f"{unit}: failed: {message}")
            experiment.write_failed(p, unit.method, missing, message, 0.0)

    desc = f"adapt {len(work)} task(s) x{len(p.seeds)} seeds"
    with progress_bar(total=sum(totals.values()), desc=desc, unit="step", disable=not progress) as bar:
        refs = {}
        for i, (unit, (request, threads)) in enumerate(zip(work, plans)):
            options = dict(**request, max_retries=retries, name=f"qlbench adapt {unit}")
            refs[task.options(**options).remote(p, unit, threads, reporter, i)] = i
            started[i] = time.perf_counter()
        _wait(ray, refs, totals, reporter, bar, done)


def _wait(ray, refs: dict, totals: dict, reporter, bar, done) -> None:
    """Wait for every task (ref -> key), moving the bar as tasks report steps (to the key's total when its task
    ends), and call done(key, result or the task's RayError) as each ends. Ctrl-C cancels the tasks still running,
    then propagates."""
    done_steps = dict.fromkeys(totals, 0)
    left = list(refs)

    def advance(key, n):
        n = min(n, totals[key] - done_steps[key])
        done_steps[key] += n
        bar.update(n)

    try:
        while left:
            ready, left = ray.wait(left, num_returns=len(left), timeout=0.5)
            if reporter is not None:
                for key, n in ray.get(reporter.take.remote()).items():
                    advance(key, n)
            for ref in ready:
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayError as err:
                    result = err
                advance(refs[ref], totals[refs[ref]])
                done(refs[ref], result)
    except KeyboardInterrupt:
        for ref in left:
            ray.cancel(ref, force=True)
        raise


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def _describe(err) -> str:
    """One line for a failed task: the exception it raised (as the local executor records it), or Ray's error
    (a worker or node that died, a cancelled task)."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {_first_line(cause)}"
    return f"{type(err).__name__}: {_first_line(err)}"


# ---------------------------------------------------------------------------------------------------------------
# What runs in the Ray workers.


class _Progress:
    """A Ray actor (no CPU) that tasks send their training steps to; the driver takes the counts."""

    def __init__(self):
        self.steps: dict = {}

    def add(self, key, n: int) -> None:
        self.steps[key] = self.steps.get(key, 0) + n

    def take(self) -> dict:
        out, self.steps = self.steps, {}
        return out


class _Reporter:
    """engine's progress callback inside a task: steps sent to the _Progress actor at most every `every` s."""

    def __init__(self, actor, key, every: float = 0.5):
        self.actor, self.key, self.every = actor, key, every
        self.pending, self.sent = 0, time.monotonic()

    def __call__(self, n: int) -> None:
        self.pending += n
        if time.monotonic() - self.sent >= self.every:
            self.flush()

    def flush(self) -> None:
        if self.actor is not None and self.pending:
            self.actor.add.remote(self.key, self.pending)
        self.pending, self.sent = 0, time.monotonic()


def _task_plan(p: experiment.Plan) -> experiment.Plan:
    """Ray shows a task only its own GPU (CUDA_VISIBLE_DEVICES): use it whatever index the driver named."""
    return dataclasses.replace(p, device=torch.device("cuda")) if p.device.type == "cuda" else p


def _pretrain_task(p: experiment.Plan, members: list, threads: int, actor, key) -> list[str]:
    """Load the cached backbones of `members`, train and cache the missing ones (one stack); returns log lines."""
    p, messages, report = _task_plan(p), [], _Reporter(actor, key)
    with engine.num_threads(threads):
        p.pretrain(members, progress=report, log=messages.append)
    report.flush()
    return messages


def _adapt_task(p: experiment.Plan, unit: Unit, threads: int, actor, key) -> tuple[str, list[str]]:
    """Adapt one unit from the cached backbones and commit its records; returns (host, log lines)."""
    p, messages, report = _task_plan(p), [], _Reporter(actor, key)
    members = [(f, s) for f in unit.functions for s in p.seeds]
    if p.pretrain_needed(members):
        raise FileNotFoundError(
            f"the pretrained backbones are not in {p.store.backbone_dir} on {socket.gethostname()}: the results "
            "folder must be on a file system every node shares"
        )
    with engine.num_threads(threads):
        pre = p.pretrain(members)
        trains = adapters.get(unit.method).trains
        experiment.train_method(p, unit.method, pre, report if trains else None, messages.append)
    report.flush()
    return socket.gethostname(), messages
