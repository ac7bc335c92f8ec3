"""One engine for every method: pretrain a stack of backbones on the source, adapt it to the target, evaluate.

The package's modules, each one concern, imported in this order (none imports a later one):

    budgets   Phase and Budget: the paper's protocol and the quick and smoke runs
    runtime   device, intra-op threads, flush-denormal, torch.compile and CUDA-graph policy, stacks trained at once
    step      the training step, eager or captured whole in a CUDA graph
    snapshot  a stage's training state saved as it goes, so that a stopped run resumes mid-stage
    stack     what a stack is: members and padding, stacked data, curves, evaluation, pretrained backbones
    loop      `fit`, the one training loop (pretraining, adaptation, suite stages and the real models all train
              through it), and `adapt`: a method built on a pretrained stack and adapted to every member's target
    cache     source-pretrained backbone stacks and their on-disk cache

Callers use the names below (`engine.fit`, `engine.pretrain`, ...); the modules hold them.
"""

from qlbench.engine.budgets import BUDGETS, Budget, Phase, budget, steps
from qlbench.engine.cache import Backbones, pretrain
from qlbench.engine.loop import Adaptation, AdaptResult, Runtime, Stage, adapt, build_model, fit, make_step
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
from qlbench.engine.stack import (
    DIVERGENCE_FACTOR,
    MIN_STACK,
    Curves,
    Member,
    Pretrained,
    StackedData,
    evaluate,
    padded,
    squared_errors,
)
from qlbench.engine.step import CapturedEvaluation, CapturedStep, Step

__all__ = [
    "Adaptation", "AdaptResult", "Runtime", "adapt", "build_model", "BUDGETS", "Budget", "Phase", "budget", "steps",
    "Pretrained", "pretrain",
    "Backbones", "DIVERGENCE_FACTOR", "MIN_STACK", "Curves", "Member", "StackedData", "Stage", "evaluate", "fit",
    "make_step", "padded", "squared_errors", "COMPILE_BUDGETS", "auto_threads", "check_threads", "compile_by_default",
    "compiled", "concurrently", "flush_denormals", "num_threads", "resolve_device", "CAPTURE_SETTINGS", "use_capture",
    "Step", "CapturedStep", "CapturedEvaluation", "Snapshots", "SNAPSHOT_EVERY_S",
]  # fmt: skip
