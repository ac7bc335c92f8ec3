"""The training step every stack runs, eager or captured whole in a CUDA graph and replayed.

`Step` is the step: forward, each member's batch-mean loss, backward of their sum, the optimiser's update.
`CapturedStep` is the same step on CUDA, recorded once per batch shape (forward, backward and the optimiser's
update, `torch.cuda.graph`) and replayed: one launch per step instead of one per kernel (a deep-narrow step is
hundreds of small kernels, each launched from Python when eager; docs/speed.md). Both are called as step(xb, yb,
inspect, task) and return the members' losses (E,). `CapturedEvaluation` records a captured stage's evaluation of
its train and test sets the same way, once per stage.

How the captured step stays the same training as the eager one:
- Capture records kernels without running them. Each batch shape first trains WARMUP ordinary steps on a side
  stream (as PyTorch's CUDA-graph notes require: lazy initialisation, the optimiser's state, a compiled forward's
  compilation), then is recorded, then every later step of that shape replays the recording. The warm-up steps are
  real training steps, so nothing is run twice or skipped.
- A stage's last partial batch is one more shape, recorded once for the stage (not once per epoch).
- The optimiser must keep its step count on the device (AdamW's `capturable`, which `adapters.base.adamw` sets on
  CUDA), or split its step around a device part (full-soap's `soap.StackedSoap`, `capturable` on CUDA: the host
  counts the step and writes its step size to the device before each replay, and refreshes the eigenbases in place
  after it, every tenth step: `CapturedRefresh`, recorded and replayed too where the refresh is device work alone;
  its first step's eigendecompositions are a warm-up step's). An optimiser that does neither has the forward and
  backward captured and steps eagerly after the replay.
- The gradients a replay writes are the recording's own tensors; `inspect` (gradient diagnostics) is handed them,
  so it reads the step's gradients whichever shape was recorded last. An ordinary step (another shape's warm-up)
  first detaches them from the parameters, so its backward does not add to them; `close()` does the same when the
  stage ends and frees the recordings.
- Inputs are copied into the recording's fixed buffers; the returned loss is a fixed buffer too, overwritten by
  the next call of the same shape (the loop adds it to its running sum at once).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable

import torch

from qlbench.engine.runtime import GATE, in_concurrent_worker

WARMUP = 3  # ordinary steps per batch shape before it is recorded


def _loss(forward: Callable, instruction, xb: torch.Tensor, yb: torch.Tensor, task) -> torch.Tensor:
    """Each member's batch-mean squared error (E,) for xb (E, b, 2) or (E, b, ...), yb (E, b)."""
    out = forward(xb, instruction) if task is None else forward(xb, instruction, task=task)
    return (out - yb).pow(2).mean(dim=1)


class Step:
    """The training step: step(xb (E, b, 2), yb (E, b), inspect=None, task=None) -> loss (E,).

    Each member's loss is its own batch mean and the stack minimises their sum, so member e's gradient is the one
    it would get alone. `inspect()`, if given, is called after backward and before the optimiser's update (the
    gradients are in .grad), e.g. to record gradient norms; `task` (E, b): each sample's task in a suite."""

    captured = False

    def __init__(
        self,
        forward: Callable,
        optimizer: torch.optim.Optimizer,
        instruction: torch.Tensor | None,
        compile_update: bool = False,
    ):
        self.forward, self.optimizer, self.instruction = forward, optimizer, instruction
        self.update = compiled_update(optimizer) if compile_update else optimizer.step

    def __call__(self, xb, yb, inspect: Callable[[], None] | None = None, task=None) -> torch.Tensor:
        loss = _loss(self.forward, self.instruction, xb, yb, task)
        loss.sum().backward()
        if inspect is not None:
            inspect()
        self.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def close(self) -> None:
        """Called once the stage has trained: nothing to release for an eager step."""


def updates_compile(optimizer: torch.optim.Optimizer) -> bool:
    """Whether compiling the optimiser's update pays: torch.optim's multi-tensor ("foreach") AdamW over float32
    parameters, as `adapters.base.adamw` builds it off CUDA. Inductor fuses its per-tensor kernels, which pays beside
    a compiled forward (docs/speed.md). Not in float64: the compiled update rounds its scalars at float32 level, which
    moves a float64 run's curve (docs/speed.md), precision a float64 run asks for. CUDA's fused AdamW is one kernel
    already and is recorded in the CUDA graph; SOAP's update (eigendecompositions) stays eager: `soap.StackedSoap`
    has no param_groups, so the type is checked first."""
    if type(optimizer) is not torch.optim.AdamW:  # not engine.rates.MemberRates, whose update slices per rate
        return False
    groups = optimizer.param_groups
    return bool(groups) and all(g.get("foreach") and all(p.dtype == torch.float32 for p in g["params"]) for g in groups)


def compiled_update(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """optimizer.step through torch.compile (PyTorch's compiled-optimizer recipe: the step, hooks included, traced
    once per optimiser; the learning rate is a constant of each stage)."""

    @torch.compile(fullgraph=False)
    def update() -> None:
        optimizer.step()

    return update


def capturable(optimizer) -> bool:
    """Whether the optimiser's update can be recorded in a CUDA graph (its state, step count included, lives on the
    device): torch.optim's `capturable` flag, or full-soap's `soap.StackedSoap` built `capturable` (its update split
    into host parts around a device part: `split`)."""
    if split(optimizer):
        return optimizer.capturable
    groups = getattr(optimizer, "param_groups", None)
    return bool(groups) and all(g.get("capturable", False) for g in groups)


def split(optimizer) -> bool:
    """Whether the optimiser's step is before_update() (host), update() (device: what a recording holds) and
    after_update() (host), as `soap.StackedSoap`'s."""
    return all(callable(getattr(optimizer, f, None)) for f in ("before_update", "update", "after_update"))


def parameters(optimizer) -> list[torch.Tensor]:
    """The parameters an optimiser updates, in a fixed order: torch.optim's param_groups, or `groups` (full-soap's
    `soap.StackedSoap`)."""
    groups = getattr(optimizer, "param_groups", None) or optimizer.groups
    return [p for g in groups for p in g["params"]]


class CudaGraphs:
    """How `CapturedStep` records and replays, on CUDA: the warm-up steps on a side stream, then `torch.cuda.graph`.
    tests/test_engine.py swaps in a CPU stand-in (the recording's body re-run at each replay) to check the captured
    step's bookkeeping for every method without a GPU."""

    def __init__(self, device: torch.device):
        self.side = torch.cuda.Stream(device=device)

    @contextlib.contextmanager
    def warm_up(self):
        """The ordinary steps before a recording, on a side stream (PyTorch's CUDA-graph notes)."""
        main = torch.cuda.current_stream()
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            yield
        main.wait_stream(self.side)

    def record(self, body: Callable[[], tuple], params, optimizer) -> tuple[torch.cuda.CUDAGraph, tuple]:
        """(graph, body's outputs): body recorded, not run (its kernels run at each graph.replay(), on the same
        memory, so its outputs are the buffers every replay rewrites). `params`, `optimizer`: what body changes."""
        graph = torch.cuda.CUDAGraph()
        # recorded on this step's own side stream (torch.cuda.graph's default is one stream shared by every
        # recording), with the process's gate to itself (`_record`); in a thread of runtime.concurrently only
        # this thread's CUDA calls may break the recording ("thread_local"), not the other threads', which wait
        mode = "thread_local" if in_concurrent_worker() else "global"
        with torch.cuda.graph(graph, stream=self.side, capture_error_mode=mode):
            out = body()
        return graph, out


RECORDER = CudaGraphs  # built per captured step with the parameters' device


class CapturedStep(Step):
    """`Step` recorded in a CUDA graph per batch shape and replayed (CUDA only; see the module docstring)."""

    captured = True

    def __init__(self, forward: Callable, optimizer: torch.optim.Optimizer, instruction: torch.Tensor | None):
        super().__init__(forward, optimizer, instruction)  # its own update: recorded, or eager after the replay
        self.params = parameters(optimizer)
        self.whole = capturable(optimizer)  # the update recorded too (else it steps eagerly after each replay)
        self.split = self.whole and split(optimizer)  # its host parts run around each replay
        self.seen: dict[tuple, int] = {}  # batch shape -> ordinary steps taken
        self.graphs: dict[tuple, _Recording] = {}
        self.recorder = RECORDER(self.params[0].device)
        self.refresh = CapturedRefresh(optimizer, self.recorder)

    def __call__(self, xb, yb, inspect: Callable[[], None] | None = None, task=None) -> torch.Tensor:
        GATE.pause()  # a recording in another thread goes first (runtime.Gate)
        key = (tuple(xb.shape), None if task is None else tuple(task.shape))
        if key not in self.graphs and self.seen.get(key, 0) < WARMUP:
            self.seen[key] = self.seen.get(key, 0) + 1
            # .grad may still hold another recording's gradient tensors: an ordinary backward would add to them
            self.optimizer.zero_grad(set_to_none=True)
            # contiguous, as the recording's buffers are: a compiled forward guards on strides, and the loop's
            # batches are strided views (a column slice of the epoch's order), so warming up on them and recording
            # on contiguous copies recompiled inside the recording, which cannot launch compilation's own work
            # (a replay copies the views into its buffers as they are)
            xb, yb = xb.contiguous(), yb.contiguous()
            task = None if task is None else task.contiguous()
            with self.recorder.warm_up():
                return super().__call__(xb, yb, inspect, task)
        if key not in self.graphs:
            self.graphs[key] = self._record(xb, yb, task)
        rec = self.graphs[key]
        rec.x.copy_(xb)
        rec.y.copy_(yb)
        if task is not None:
            rec.task.copy_(task)
        if self.split:
            self.optimizer.before_update()  # the host's part: the step count, its step size on the device
        rec.graph.replay()
        if self.split:
            self.refresh()  # the optimiser's host part after the update: the eigenbases' refresh when due
        if inspect is not None or not self.whole:
            for p, g in zip(self.params, rec.grads):
                p.grad = g
            if inspect is not None:
                inspect()
            if not self.whole:
                self.optimizer.step()
        return rec.loss

    def _record(self, xb, yb, task) -> _Recording:
        contiguous = dict(memory_format=torch.contiguous_format)  # the warm-up's layout (see __call__)
        x, y = xb.clone(**contiguous), yb.clone(**contiguous)
        t = None if task is None else task.clone(**contiguous)

        def body() -> tuple[torch.Tensor, list]:
            self.optimizer.zero_grad(set_to_none=True)  # backward inside the recording allocates its own gradients
            loss = _loss(self.forward, self.instruction, x, y, t)
            loss.sum().backward()
            if self.split:
                self.optimizer.update()  # the device part alone
            elif self.whole:
                self.optimizer.step()
            return loss.detach(), [p.grad for p in self.params]

        graph, (loss, grads) = _record(self.recorder, "training step", body, self.params, self.optimizer)
        return _Recording(graph, x, y, t, loss, grads)

    def close(self) -> None:
        """Release the recordings (their memory pools) and detach their gradient tensors from the parameters, so
        that a later backward outside them (the next stage, a measurement) starts from no gradient."""
        self.optimizer.zero_grad(set_to_none=True)
        self.graphs.clear()
        self.refresh.close()


REFRESH_WARMUP = 1  # refreshes run eagerly (on the side stream) before the refresh is recorded


class CapturedRefresh:
    """What a split optimiser does after each replayed update (`after_update`), its periodic refresh recorded in a
    CUDA graph and replayed when due wherever the optimiser can have it recorded (`soap.StackedSoap`: the
    eigenbases' power iteration and QR every `precondition_frequency` steps; `refresh_recordable`: device work
    alone, on deep-narrow); elsewhere `after_update` itself, eagerly. The first REFRESH_WARMUP due refreshes run
    eagerly on the side stream, the next is recorded and replayed (a recording runs nothing), and so is every later
    one. The refresh writes in place, into the tensors the recorded update reads, so a replay leaves the optimiser
    as the eager refresh does.

    Why: eagerly, a refresh of a wide deep-narrow stack launches thousands of kernels one by one from Python, and
    full-soap refreshes at every tenth step (docs/speed.md; `qlbench bench`'s soap row times both on CUDA)."""

    def __init__(self, optimizer, recorder):
        self.optimizer, self.recorder = optimizer, recorder
        self.eager, self.graph = 0, None

    def __call__(self) -> None:
        opt = self.optimizer
        recordable = getattr(opt, "refresh_recordable", None)
        if recordable is None or not opt.refresh_due() or not recordable():
            opt.after_update()
            return
        self.refresh()

    def refresh(self) -> None:
        """One refresh of a recordable optimiser now: eagerly for the first REFRESH_WARMUP, then the recording's
        replay (`qlbench bench`'s soap row times it against the eager refresh)."""
        opt = self.optimizer
        if self.graph is None and self.eager < REFRESH_WARMUP:
            self.eager += 1
            with self.recorder.warm_up():
                opt.refresh()
            return
        if self.graph is None:

            def body() -> tuple[None, list]:
                opt.refresh()
                return None, []

            self.graph, _ = _record(self.recorder, "eigenbases' refresh", body, [], opt)
        self.graph.replay()

    def close(self) -> None:
        """Release the recording (its memory pool) once the stage has trained."""
        self.graph = None


EVALUATION_WARMUP = 1  # ordinary evaluations of a stage's data before it is recorded


class CapturedEvaluation:
    """A stage's evaluation of one fixed set (`evaluate` of its train or test data), recorded in a CUDA graph and
    replayed: call() -> per-member MSE (E,). The data, the instruction and the parameters are the same tensors at
    every evaluation of the stage (the optimiser updates the parameters in place), so each replay reads their
    current values; the first EVALUATION_WARMUP evaluations run as they are (the first comes before any training
    step: it loads the forward's kernels), the next is recorded. Evaluation is eager on either device otherwise.
    Why: eager, the paper budget's 501 evaluations per stage launch their kernels one by one, a share of a GPU's
    deep-narrow paper table worth recording (docs/speed.md)."""

    def __init__(self, evaluate: Callable[[], torch.Tensor], device: torch.device):
        self.evaluate, self.calls, self.recording = evaluate, 0, None
        self.recorder = RECORDER(device)

    def __call__(self) -> torch.Tensor:
        GATE.pause()
        if self.recording is None and self.calls < EVALUATION_WARMUP:
            self.calls += 1
            with self.recorder.warm_up():
                return self.evaluate()
        if self.recording is None:
            self.recording = _record(self.recorder, "evaluation", lambda: (self.evaluate(), []), [], None)
        graph, (mse, _) = self.recording
        graph.replay()
        return mse.clone()  # the recording's buffer is rewritten by the next replay

    def close(self) -> None:
        """Release the recording (its memory pool) once the stage has trained."""
        self.recording = None


def _record(recorder, what: str, body: Callable[[], tuple], params, optimizer) -> tuple:
    """recorder.record(body, params, optimizer), a failure raised as one line naming `--capture off`."""
    try:
        # no other thread launches while this one records (runtime.Gate), and no garbage collection runs in it
        with GATE.alone(), cyclic_gc_paused():
            return recorder.record(body, params, optimizer)
    except RuntimeError as err:
        message = f"the {what} could not be captured in a CUDA graph ({first_line(err)}); --capture off runs it eagerly"
        raise RuntimeError(message) from err


@contextlib.contextmanager
def cyclic_gc_paused():
    """Python's cyclic garbage collector off for the block, then as it was. A collection that starts inside a
    CUDA-graph recording (any allocation can start one) and frees another recording kept alive by a reference
    cycle destroys that graph while a stream captures, which CUDA forbids: the recording is invalidated ("operation
    not permitted when stream is capturing"), and the allocator asserts at its next allocation. torch.cuda.graph
    does not collect garbage before a recording from PyTorch 2.9 on (pytorch/pytorch#158193); pausing the collector
    during a recording is the remedy proposed there (pytorch/pytorch#161037; docs/design.md, "Why the garbage
    collector pauses during a recording"). What it leaves uncollected is collected at the next collection after
    the recording."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def first_line(err: BaseException) -> str:
    """A CUDA error's first line (they run to several), or its type's name when it has no message."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class _Recording:
    """One recorded step: the graph, its fixed input buffers, its loss buffer and the gradients it writes."""

    def __init__(self, graph, x, y, task, loss, grads):
        self.graph, self.x, self.y, self.task, self.loss, self.grads = graph, x, y, task, loss, grads


def build(
    forward: Callable, optimizer, instruction=None, *, capture: bool = False, compile_update: bool = False
) -> Step:
    """The step over `forward` (a model, or its compiled wrapper): captured when `capture` (CUDA only), else with
    the optimiser's update compiled when `compile_update` and it pays (`updates_compile`)."""
    if capture:
        return CapturedStep(forward, optimizer, instruction)
    return Step(forward, optimizer, instruction, compile_update and updates_compile(optimizer))
