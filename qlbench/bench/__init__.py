"""`qlbench bench`: speed, measured side by side in one process, reported as ratios.

The tables:
  - adaptation throughput (model-steps/s at batch 64) of every method on both backbones: the stacked engine at
    E = 5 and E = 45 members against the per-seed loop (the same modules, one member at a time, eager, PyTorch's
    default threads), plus the plain PyTorch loop (nn.Linear + LoRA, the loop a user would write) so the per-seed
    loop can be seen not to be artificially slow, and the kernel floor of the stacked LoRA steps measured against
    it (the same LoRA step with its backward written out and nothing else, compiled where the run compiles), the
    rate the engine would reach without the fixed cost of autograd and per-tensor optimizer bookkeeping;
  - the share of this machine's dense matmul peak the stacked engine reaches (FLOPs counted with
    torch.utils.flop_counter over one real step; the peak is the best large-sgemm rate timed at the start and at
    the end of the same run);
  - inference efficiency like the paper's: forward latency at batch 64, overhead against LoRA, samples/s and FLOP
    overhead against LoRA, for every method on both backbones;
  - outside --quick: every trained method's deep-narrow stack at the largest E compiled against eager (warm-up and
    steady rate), Queryable LoRA against LoRA compiled, and the plain-loop comparison's stacks compiled, so the
    estimate of the full deep-narrow paper table counts the steps as the paper budget runs them (`--compile
    auto`), in one process and, when `threads` lets several stacks fit on the machine, that many at once: the rates
    of a few stacks run side by side in separate processes (as Ray's workers run a sweep's tasks) are measured
    against their rates alone, and the estimate slows every task by that ratio.
  - on CUDA: every trained method's step eager against captured whole in a CUDA graph (engine/step.py; compiled
    too outside --quick), the CUDA kernels per step, their device time and its share of the captured step, the
    kernels that take most of it, and the step's roofline floor (its kernels' FLOPs and bytes counted on the meta
    device, each kernel at the run's matmul peak or memory bandwidth, whichever bounds it) and the captured step's
    share of it, at each E of the run and at the paper's 45 members (one stack on a GPU), and the paper-table
    estimate of each backbone at the widest captured rates, with its adaptation steps at their floors.
Measurements alternate between the compared variants in rounds (A B A B ...) and report medians, so slow drift of
a shared machine hits both sides alike. `--only` runs the measurements of the kinds it names (KINDS: the report's
keys), e.g. `--only throughput,capture` for the paper-table estimate of every method in a short GPU call. Nothing
here asserts a speed: the numbers are reported, not tested.

The modules: `timing` (Settings, alternating rounds, timed chunks, the matmul peak, the memory bandwidth, FLOP
counts), `models` (what is timed: qlbench's stacks, the plain PyTorch loop, the kernel floor), `dispatch` (a step's
kernels on the meta device, their FLOPs and bytes, the roofline floor), the measured cases by kind: `training`
(plain, throughput, overhead, compile, dispatch, profile, soap, padding), `capture` (capture, at_once), `forwards`
(inference), `workloads` (pareto_stack, suite, hf, snapshot) and `members` (members), then `schedule` (the
measurements in order, KINDS and `run`), `parallel` (tasks side by side in separate processes), `estimate` (the
paper-table estimate) and `output` (the Markdown).
"""

from __future__ import annotations

from qlbench.bench.estimate import list_schedule, paper_estimate
from qlbench.bench.forwards import COMPILED_FORWARDS, inference
from qlbench.bench.models import batches, lora_floor_step, plain_deep_narrow_lora, plain_step, stacked_model
from qlbench.bench.output import markdown
from qlbench.bench.parallel import side_by_side
from qlbench.bench.schedule import KINDS, run, tasks
from qlbench.bench.timing import BATCH, Settings
from qlbench.bench.training import compile_row, overhead, plain_loop, profile_row, soap_row, throughput

__all__ = [
    "BATCH",
    "COMPILED_FORWARDS",
    "KINDS",
    "Settings",
    "batches",
    "compile_row",
    "inference",
    "list_schedule",
    "lora_floor_step",
    "markdown",
    "overhead",
    "paper_estimate",
    "plain_deep_narrow_lora",
    "plain_loop",
    "plain_step",
    "profile_row",
    "run",
    "side_by_side",
    "soap_row",
    "stacked_model",
    "tasks",
    "throughput",
]
