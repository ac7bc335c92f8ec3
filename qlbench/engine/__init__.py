"""One engine for every method: pretrain a stack of backbones on the source, adapt it to the target, evaluate.

The package's modules, each one concern, imported in this order (none imports a later one):

    budgets   Phase and Budget: the paper's protocol and the quick and smoke runs
    runtime   device, intra-op threads, flush-denormal, torch.compile and CUDA-graph policy, stacks trained at once
    step      the training step, eager or captured whole in a CUDA graph
    snapshot  a stage's training state saved as it goes, so that a stopped run resumes mid-stage
    loop      stacked data, the training step and `fit`, the one training loop (pretraining, adaptation, suite
              stages and the real model all train through it), evaluation and curves
    cache     source-pretrained backbone stacks and their on-disk cache
    adapt     a method built on a pretrained stack and adapted to every member's target

Callers use the names below (`engine.fit`, `engine.pretrain`, ...); the modules hold them.
"""

from qlbench.engine.adapt import Adaptation, AdaptResult, Runtime, adapt, build_model
from qlbench.engine.budgets import BUDGETS, Budget, Phase, budget, steps
from qlbench.engine.cache import Backbones, Pretrained, pretrain
from qlbench.engine.loop import (
    DIVERGENCE_FACTOR,
    MIN_STACK,
    Curves,
    Member,
    StackedData,
    Stage,
    evaluate,
    fit,
    make_step,
    padded,
    squared_errors,
)
from qlbench.engine.runtime import (
    CAPTURE_SETTINGS,
    COMPILE_BUDGETS,
    auto_threads,
    check_threads,
    compile_by_default,
    compiled,
    concurrently,
    flush_denormals,
    num_threads,
    resolve_device,
    use_capture,
)
from qlbench.engine.snapshot import EVERY_S as SNAPSHOT_EVERY_S
from qlbench.engine.snapshot import Snapshots
from qlbench.engine.step import CapturedEvaluation, CapturedStep, Step

__all__ = [
    "Adaptation", "AdaptResult", "Runtime", "adapt", "build_model", "BUDGETS", "Budget", "Phase", "budget", "steps",
    "Pretrained", "pretrain",
    "Backbones", "DIVERGENCE_FACTOR", "MIN_STACK", "Curves", "Member", "StackedData", "Stage", "evaluate", "fit",
    "make_step", "padded", "squared_errors", "COMPILE_BUDGETS", "auto_threads", "check_threads", "compile_by_default",
    "compiled", "concurrently", "flush_denormals", "num_threads", "resolve_device", "CAPTURE_SETTINGS", "use_capture",
    "Step", "CapturedStep", "CapturedEvaluation", "Snapshots", "SNAPSHOT_EVERY_S",
]  # fmt: skip
