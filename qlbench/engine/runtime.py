"""Runtime policy: device, intra-op threads, flush-denormal, torch.compile and CUDA-graph choices of a training run."""

from __future__ import annotations

import contextlib
import gc
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn as nn


def resolve_device(device: str, cuda: bool | None = None) -> torch.device:
    """'auto' -> CUDA when present, else CPU; 'cpu' and 'cuda[:i]' as given. `cuda`: whether the machines that
    train have CUDA (None: this one; the Ray executor passes whether its cluster has GPUs)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if device == "auto":
        return torch.device("cuda" if cuda else "cpu")
    if device.startswith("cuda") and not cuda:
        raise ValueError(f"device {device!r} requested but CUDA is not available; valid: auto, cpu")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"unknown device {device!r}; valid: auto, cpu, cuda")
    return torch.device(device)


def check_threads(threads) -> None:
    """A user's intra-op thread count for work on this machine: None (the default) or an integer from 1 to the cores
    present (ValueError otherwise; the commands check it before any work, a Ray sweep against its largest node).
    More threads than cores oversubscribe the machine (docs/speed.md)."""
    cores = os.cpu_count() or 1
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= cores):
        raise ValueError(f"threads must be an integer from 1 to {cores} (the cores present), got {threads!r}")


def auto_threads(arch: str, members: int, requested: int | None = None) -> int | None:
    """Intra-op threads for a stack: `requested` if given (a user's --threads), else one for the deep-narrow MLP
    below 16 members, else PyTorch's default (None).

    Its 32-wide layers at batch 64 are too small to split across cores, and a second thread stalls whenever another
    process holds a core; from about 16 members, and for the Transformer, more threads help (docs/speed.md).
    """
    if requested is not None:
        return requested
    return 1 if arch == "deep-narrow" and members < 16 else None


def _denormals_flushed() -> bool:
    """Whether this thread flushes denormals (PyTorch has no getter: a denormal times one reads back as 0)."""
    return (torch.tensor([1e-39], dtype=torch.float32) * 1.0).item() == 0.0


@contextlib.contextmanager
def flush_denormals():
    """Flush denormal floats to zero on the CPU inside the block, then restore the previous setting.

    float32 training that drifts into denormals (tiny gradients of a deep MLP) runs several times slower
    otherwise. The engine's entry points (`pretrain`, `adapt`) and the benchmarks run inside it. PyTorch's switch
    is per thread, one more reason small stacks run on one thread."""
    before = _denormals_flushed()
    torch.set_flush_denormal(True)  # a no-op (returning False) on CPUs without the feature
    try:
        yield
    finally:
        if not before:
            torch.set_flush_denormal(False)


@contextlib.contextmanager
def num_threads(n: int | None):
    """Run a block with n intra-op threads (None: leave the setting as it is)."""
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def compiled(model: nn.Module) -> nn.Module:
    """torch.compile for the training forward: Inductor's default mode on every device.

    On CUDA the whole step (forward, backward, the optimiser's update) is recorded in a CUDA graph by the engine
    itself (`--capture`, engine/step.py), over the compiled forward or the eager one; torch.compile's own CUDA
    graphs ("reduce-overhead") are not used: they record the forward and backward only, not the optimiser's update,
    and can abort the process (docs/design.md, "Why torch.compile's own CUDA graphs are not used").

    It shares the model's parameters; evaluation keeps calling the eager model (its batch shapes vary). Whether
    `--compile auto` uses it depends on the device and budget (`compile_by_default`). `qlbench bench` also times
    no-grad forwards through it. Call it before the first call of anything compiled earlier: the reset below drops
    compiled code (which then recompiles on its next call).
    """
    # a fresh in-process cache per training run: every method's model re-enters the same forward code, and past
    # torch._dynamo's recompile limit (8 per code object) a sweep's later methods would silently run eager. The
    # on-disk Inductor cache survives the reset, so a model seen before still compiles in seconds.
    torch._dynamo.reset()
    return torch.compile(model, dynamic=False)


# Budgets whose training step `--compile auto` compiles, per device type: a cold compile warm-up is repaid only by the
# paper budget's 35,000 steps per member, not by a quick run's 2,800. On CUDA, where the captured step already removes
# the per-kernel launch cost, compiling fuses kernels, and the same rule holds (docs/speed.md).
COMPILE_BUDGETS = {"cpu": ("paper",), "cuda": ("paper",)}


def compile_by_default(device: torch.device, budget_name: str) -> bool:
    """Whether `--compile auto` compiles the training step for this device and budget (COMPILE_BUDGETS)."""
    return budget_name in COMPILE_BUDGETS.get(torch.device(device).type, ())


CAPTURE_SETTINGS = ("auto", "on", "off")


def use_capture(setting: str, device: torch.device) -> bool:
    """Whether a run records its training steps in CUDA graphs (engine/step.py): `--capture` auto (on CUDA, every
    budget: recording costs a few ordinary steps per batch shape), on (CUDA only) or off. ValueError naming the
    valid settings otherwise."""
    if setting not in CAPTURE_SETTINGS:
        raise ValueError(f"unknown capture setting {setting!r}; valid: {', '.join(CAPTURE_SETTINGS)}")
    cuda = torch.device(device).type == "cuda"
    if setting == "on" and not cuda:
        raise ValueError(f"--capture on needs a CUDA device (CUDA graphs), got {device}; valid here: auto, off")
    return cuda and setting != "off"


def release() -> None:
    """Teardown before the interpreter's own: collect what is garbage, let the device finish, and stop Inductor's
    compile workers, in that order, while torch and CUDA are whole (`qlbench.cli.main` calls it when a command ends).

    Why: the interpreter's own teardown after CUDA or Inductor use can crash in atexit's finalisers or its final
    garbage collection (docs/design.md, "Why a CUDA process leaves through os._exit"); the console script
    (`qlbench.cli.entry`) then skips that teardown in a process that initialised CUDA. A process that used neither
    CUDA nor Inductor skips this."""
    cuda, workers = torch.cuda.is_initialized(), sys.modules.get("torch._inductor.async_compile")
    if not (cuda or workers):
        return
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
    if workers is not None:
        workers.shutdown_compile_workers()


T = TypeVar("T")
_worker = threading.local()  # `concurrent` is set in the threads of `concurrently`


def in_concurrent_worker() -> bool:
    """Whether this thread is one of `concurrently`'s: its CUDA-graph recordings then restrict only its own thread's
    CUDA calls (engine/step.py `CudaGraphs`), since the other workers keep launching while it records."""
    return getattr(_worker, "concurrent", False)


class Gate:
    """CUDA work against CUDA-graph recordings, where several stacks train at once (`concurrently`): each job holds
    the gate (`held`) while it runs, and a recording (`alone`) waits until every other job has stopped at a step's
    start (`pause`), then runs with the gate to itself.

    Why: while a stream captures, another thread's replay or synchronisation fails ("Cannot prepare for replay during
    capturing stage", "operation not permitted when stream is capturing") and later recordings hit device-side asserts
    (docs/design.md, "Why a CUDA-graph recording runs alone"). The jobs hold it on the CPU too, where only the tests'
    stand-in for CUDA graphs records (tests/test_concurrent.py). Outside `concurrently` no thread holds the gate, and
    `alone` costs a lock and `pause` a read."""

    def __init__(self):
        self._cond = threading.Condition()
        self._holders = 0  # threads holding the gate
        self._waiting = 0  # recordings waiting for it
        self._alone = False  # a recording under way
        self._mine = threading.local()

    def _enter(self) -> None:
        with self._cond:
            while self._alone or self._waiting:
                self._cond.wait()
            self._holders += 1
        self._mine.held = True

    def _leave(self) -> None:
        with self._cond:
            self._holders -= 1
            self._mine.held = False
            self._cond.notify_all()

    @contextlib.contextmanager
    def held(self):
        """Held by a job for as long as it runs (its CUDA work)."""
        self._enter()
        try:
            yield
        finally:
            self._leave()

    def pause(self) -> None:
        """Where a job can let a waiting recording run: the start of each training step and evaluation."""
        if getattr(self._mine, "held", False) and self._waiting:
            self._leave()
            self._enter()

    @contextlib.contextmanager
    def alone(self):
        """The gate to this thread alone (a job's own hold given up meanwhile): for a recording."""
        held = getattr(self._mine, "held", False)
        if held:
            self._leave()
        with self._cond:
            self._waiting += 1
            while self._alone or self._holders:
                self._cond.wait()
            self._waiting -= 1
            self._alone = True
        try:
            yield
        finally:
            with self._cond:
                self._alone = False
                self._cond.notify_all()
            if held:
                self._enter()


GATE = Gate()  # the process's one: every recording and every job of `concurrently`


def concurrently(jobs: list[Callable[[], T]], width: int, device: torch.device) -> list[T]:
    """Each job's result, in order, with up to `width` jobs running at once, each in its own thread and, on CUDA,
    on its own stream, so that the kernels of small stacks overlap on the device (a deep-narrow step's kernels are
    far too small to fill a GPU; docs/speed.md). width <= 1: one after another in this thread.

    The threads share this one's intra-op thread count (a process-wide setting, tests/test_concurrent.py). Each job
    waits for its stream before it ends, so a result's tensors are ready on any stream. A job's exception is raised
    here, after every job has ended. The jobs must not share mutable state: each trains its own stack with its own
    generators, so its numbers are the ones it gives alone. An interrupt (Ctrl-C, or SIGTERM through the CLI's
    handler) is raised here at once: no job starts after it, and the threads (daemons) do not hold the process
    open while the jobs running end."""
    if width <= 1 or len(jobs) <= 1:
        return [job() for job in jobs]
    cuda = torch.device(device).type == "cuda"
    caller = torch.cuda.current_stream(device) if cuda else None
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for i, job in enumerate(jobs):
        todo.put((i, job))
    results: dict[int, T] = {}
    errors: dict[int, BaseException] = {}
    stop = threading.Event()

    def one(job: Callable[[], T]) -> T:
        with GATE.held():  # no other thread records a CUDA graph while this one launches (`Gate`)
            if not cuda:
                return job()
            stream = torch.cuda.Stream(device=device)
            stream.wait_stream(caller)  # what the caller queued before (pretraining)
            with torch.cuda.stream(stream):
                out = job()
            stream.synchronize()
        return out

    def worker() -> None:
        _worker.concurrent = True
        while not stop.is_set():
            try:
                i, job = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results[i] = one(job)
            except BaseException as err:  # raised in the caller's thread once every job has ended
                errors[i] = err

    threads = [
        threading.Thread(target=worker, name=f"qlbench-stack-{k}", daemon=True) for k in range(min(width, len(jobs)))
    ]
    try:  # an interrupt while the threads start (a job may already run) stops them too
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():  # woken every 0.2 s, so that an interrupt is raised here at once
                t.join(0.2)
    except BaseException:
        stop.set()
        raise
    if errors:
        raise errors[min(errors)]
    return [results[i] for i in range(len(jobs))]
