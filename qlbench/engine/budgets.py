"""Budgets: the epochs, learning rates and seeds of the paper's protocol and of the shorter quick and smoke runs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    """One optimisation phase: AdamW-style hyper-parameters and the epoch count."""

    epochs: int
    lr: float
    batch_size: int = 64
    weight_decay: float = 0.01  # AdamW's default (the paper does not state one)


@dataclass(frozen=True)
class Budget:
    name: str
    seeds: int
    pretrain: Phase
    adapt: Phase
    eval_every: int  # epochs between evaluations of train and test MSE (the best-epoch metrics use these)


# The paper's protocol: pretrain 300 epochs at lr 3e-3, adapt 5,000 epochs at lr 5e-4, batch 64, 5 seeds.
_PAPER = Budget("paper", 5, Phase(300, 3e-3), Phase(5000, 5e-4), eval_every=10)
BUDGETS: dict[str, dict[str, Budget]] = {
    "deep-narrow": {
        "paper": _PAPER,
        "quick": Budget("quick", 3, Phase(100, 3e-3), Phase(400, 5e-4), eval_every=10),
        "smoke": Budget("smoke", 2, Phase(3, 3e-3), Phase(4, 5e-4), eval_every=2),
    },
    "transformer": {
        "paper": _PAPER,
        "quick": Budget("quick", 2, Phase(10, 3e-3), Phase(20, 5e-4), eval_every=5),
        "smoke": Budget("smoke", 2, Phase(1, 3e-3), Phase(2, 5e-4), eval_every=1),
    },
}


def budget(name: str, arch: str) -> Budget:
    if arch not in BUDGETS:
        raise ValueError(f"unknown arch {arch!r}; valid: {', '.join(BUDGETS)}")
    if name not in BUDGETS[arch]:
        raise ValueError(f"unknown budget {name!r}; valid: {', '.join(BUDGETS[arch])}")
    return BUDGETS[arch][name]


def steps(phase: Phase, n_train: int) -> int:
    """Optimizer steps in a phase (for progress bars)."""
    return phase.epochs * -(-n_train // phase.batch_size)
