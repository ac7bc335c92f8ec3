"""What an adapter costs, measured on one member (a stack of one) of a cell's method, beside its frozen backbone:

- adapter_bytes: the size of the file that holds one member's trainable weights (torch.save of its trainable
  state, as a peft adapter folder holds the adapter and not the backbone); 0 for a method that trains nothing;
- peak_train_bytes: the peak memory of one training step at the budget's batch size, after a first step has made
  the optimiser state. On CUDA the allocator's peak (torch.cuda.max_memory_allocated). On CPU PyTorch keeps no
  allocator statistics, so qlbench counts (qlbench interpretation, "cpu-accounting"): the bytes of every
  parameter (frozen backbone included), of the gradients and of the optimiser state, plus the activations autograd
  saves for backward during the forward (saved_tensors_hooks), each storage counted once. Transient temporaries
  inside an op are not counted, so it is a lower bound of the process's true peak; it is exact in what it counts
  and the same accounting for every method, which is what the comparison needs. None for a method that trains
  nothing;
- latency_s_per_sample: the median over REPEATS forwards (no grad; fewer, at least MIN_REPEATS, when they would take
  more than ROUND_BUDGET_S; MIN_REPEATS at the smoke budget, `repeats_for`) of one forward's wall time divided by the
  batch, at batch 1 and at batch 256, for the adapted model and for the frozen backbone timed alternately in the same
  loop (so drift of a noisy machine hits both alike), under the caller's intra-op threads.

Timings on a shared or noisy machine move; compare methods by their ratio to `frozen` measured in the same record
(the tables' "× frozen" columns), and quote `qlbench bench` for speed claims.
"""

from __future__ import annotations

import io
import statistics
import time

import torch

from qlbench import adapters, engine

LATENCY_BATCHES = (1, 256)
REPEATS = 11
MIN_REPEATS = 3
WARMUP = 3
ROUND_BUDGET_S = 2.0  # seconds of timed rounds per batch size, above which fewer rounds are timed


def repeats_for(budget_name: str) -> int:
    """Timed rounds per latency: MIN_REPEATS at the smoke budget, which only checks that everything runs (its
    seconds-long training would otherwise cost less than its latencies: a Transformer smoke cell's cost takes about
    3 s a method), REPEATS otherwise."""
    return MIN_REPEATS if budget_name == "smoke" else REPEATS


def adapter_bytes(model: torch.nn.Module) -> int:
    """Bytes of torch.save of member 0's trainable parameters (0 when nothing trains)."""
    state = {n: p.detach()[0].cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
    if not state:
        return 0
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getbuffer().nbytes


def _tensors(obj):
    """Every tensor inside an optimiser-state value (tensors, lists, tuples, dicts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _forward(model, x, task=None):
    return model(x, None) if task is None else model(x, None, task=task)


def peak_train_bytes(model, optimizer, xb: torch.Tensor, yb: torch.Tensor, task=None) -> tuple[int, str]:
    """(peak bytes of one training step, method): see the module docstring. Runs two steps of `model` (the first
    creates the optimiser state); the model is changed, so pass a throwaway one. `task` (E, b): a suite's task
    index per sample, for the task-conditioned methods."""
    step = engine.make_step(model, optimizer)
    step(xb, yb, task=task)  # the optimiser state exists from here on
    if xb.device.type == "cuda":
        torch.cuda.synchronize(xb.device)
        torch.cuda.reset_peak_memory_stats(xb.device)
        step(xb, yb, task=task)
        torch.cuda.synchronize(xb.device)
        return int(torch.cuda.max_memory_allocated(xb.device)), "cuda-allocator"
    counted: dict[int, int] = {}
    for p in model.parameters():
        ptr, n = _storage(p)
        counted[ptr] = n
    for t in _tensors(vars(optimizer)):  # its state (parameters among them are already counted, by storage)
        ptr, n = _storage(t)
        counted[ptr] = n
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr, n = _storage(t)
        if ptr not in counted:
            saved[ptr] = n
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # the second step: what its forward saves
        step(xb, yb, task=task)
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return sum(counted.values()) + sum(saved.values()) + grads, "cpu-accounting"


def _latency(
    models: dict[str, torch.nn.Module], x: torch.Tensor, task=None, repeats: int = REPEATS
) -> dict[str, float]:
    """Median seconds per sample of one no-grad forward of each model on x (1, b, d), timed alternately: WARMUP untimed
    rounds (one when `repeats` < REPEATS), then `repeats` rounds, or fewer (at least MIN_REPEATS) where a round takes
    more than ROUND_BUDGET_S / repeats seconds (a Transformer at batch 256), so that a record's cost stays a few
    seconds."""
    times: dict[str, list[float]] = {k: [] for k in models}
    sync = (lambda: torch.cuda.synchronize(x.device)) if x.device.type == "cuda" else (lambda: None)

    def round_() -> dict[str, float]:
        out = {}
        for k, m in models.items():
            sync()
            t0 = time.perf_counter()
            _forward(m, x, task)
            sync()
            out[k] = time.perf_counter() - t0
        return out

    with torch.no_grad():
        for _ in range(WARMUP if repeats >= REPEATS else 1):  # fewer timed rounds, one warm-up
            last = round_()
        repeats = max(MIN_REPEATS, min(repeats, int(ROUND_BUDGET_S / max(sum(last.values()), 1e-9))))
        for _ in range(repeats):
            for k, t in round_().items():
                times[k].append(t)
    return {k: statistics.median(v) / x.shape[1] for k, v in times.items()}


@engine.flush_denormals()
def measure_model(
    model, frozen, method_name: str, config, data: engine.StackedData, batch_size: int, repeats: int = REPEATS
) -> dict:
    """The cost fields of a record (see the module docstring): `model`, a fresh one-member stack of the method, and
    `frozen`, its backbone, on that member's data (x_test for the latencies, a training batch for the memory);
    `repeats` timed rounds per latency (`repeats_for`)."""
    method = adapters.get(method_name)
    latency = {}
    for b in LATENCY_BATCHES:
        idx = torch.arange(b, device=data.x_test.device) % data.x_test.shape[1]  # cycled to the batch
        task = None if data.task_test is None else data.task_test[:, idx]
        t = _latency({"adapted": model.eval(), "frozen": frozen.eval()}, data.x_test[:, idx], task, repeats)
        latency[str(b)] = {"adapted": t["adapted"], "frozen": t["frozen"]}
    model.train()
    out = {"adapter_bytes": adapter_bytes(model) if method.trains else 0, "latency_s_per_sample": latency}
    if not method.trains:
        return out | {"peak_train_bytes": None, "memory_method": None}
    optimizer = method.optimizer(model, config, 1e-12, 0.0)  # a step that barely moves: only memory matters
    task = None if data.task_train is None else data.task_train[:, :batch_size]
    xb, yb = data.x_train[:, :batch_size], data.y_train[:, :batch_size]
    peak, how = peak_train_bytes(model, optimizer, xb, yb, task)
    return out | {"peak_train_bytes": peak, "memory_method": how}


def measure(
    pretrained: engine.Pretrained, method_name: str, config, *, batch_size: int, device, dtype, repeats: int = REPEATS
) -> dict:
    """`measure_model` for `method_name` built on `pretrained`'s first member, beside that member's frozen
    backbone, on its target data."""
    one = pretrained.select([pretrained.members[0]])
    model, data = engine.build_model(one, method_name, config, device=device, dtype=dtype)
    return measure_model(model, one.model(device=device, dtype=dtype), method_name, config, data, batch_size, repeats)
