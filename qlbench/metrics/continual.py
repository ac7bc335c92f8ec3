"""Multi-task and continual metrics on plain arrays: the stage x task matrix and the routers' atom usage.

Inputs are one seed's arrays; the report averages the outputs over seeds.

    R (S, T)     test MSE of task j after stage i (lower is better). A joint run has S = 1; a sequential run trains
                 task i at stage i, so S = T. `initial` (T,) is every task's MSE before any training.
    U (S, T, M)  block-averaged atom usage: row (i, j) is the routing weights alpha averaged over blocks and task
                 j's held-out samples after stage i (each row sums to 1).

GEM's metrics (Lopez-Paz & Ranzato 2017) are defined on an accuracy, where higher is better. qlbench interpretation:
they are applied to -MSE, so their signs keep GEM's meaning (BWT < 0: training later tasks hurt earlier ones;
FWT > 0: earlier tasks helped a task before it was trained), in MSE units:

    BWT = 1/(T-1) sum_{j < T-1} (R[j, j] - R[T-1, j])
    FWT = 1/(T-1) sum_{j > 0}   (initial[j] - R[j-1, j])

Forgetting of task j (Chaudhry et al. 2018, on MSE): how far its final MSE is above the best it reached at an
earlier stage after it was trained, R[T-1, j] - min_{j <= l < T-1} R[l, j] (>= 0 up to its sign convention: a
later stage that lowers task j's error gives a negative value); defined for j < T-1.

With stages of several tasks (a parametric suite's sequential schedule), `stage_of` (T,) gives the stage that trains
each task (-1: never trained, a held-out task); the same definitions then read s_j for j: forgetting and BWT over
the tasks trained before the last stage, R[S-1, j] - min_{s_j <= l < S-1} R[l, j] and R[s_j, j] - R[S-1, j]; FWT
over the tasks trained after the first, initial[j] - R[s_j - 1, j]. With s_j = j they are the formulas above.

Usage comparisons (the paper's continual-routing section names them without formulas; qlbench interpretation):
distributions are smoothed towards uniform by SMOOTHING before any logarithm, p' = (1 - SMOOTHING) p + SMOOTHING / M,
because top-k routing leaves atoms exactly unused and a KL of an exact zero is infinite;

    symmetric KL between tasks a, b     KL(U'[a] || U'[b]) + KL(U'[b] || U'[a])      (nats)
    stagewise route drift of task j     total variation 1/2 sum_m |U[i, j, m] - U[i-1, j, m]| for i >= 1 (in [0, 1])
    usage drift of task j               U[i, j] - U[i-1, j] per atom (the maps of the paper's drift figure)
    atom entropy across tasks           H(U[S-1, :, m] / sum_j U[S-1, j, m]) / log T for each atom m (0: one task
                                        uses it, 1: every task alike); NaN for an atom no task uses
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import entropy

SMOOTHING = 1e-3


def _stages(R) -> np.ndarray:
    R = np.asarray(R, dtype=float)
    if R.ndim != 2:
        raise ValueError(f"R must be a (stages, tasks) matrix, got shape {R.shape}")
    return R


def _stage_of(R: np.ndarray, stage_of) -> np.ndarray | None:
    """Each task's training stage: `stage_of` as given, or task j at stage j for a square R (S = T >= 2); None
    for a run that is not sequential (one stage)."""
    if stage_of is None:
        return np.arange(R.shape[1]) if R.shape[0] == R.shape[1] and R.shape[1] >= 2 else None
    s = np.asarray(stage_of, dtype=int)
    if s.shape != (R.shape[1],) or s.max() >= R.shape[0]:
        raise ValueError(f"stage_of must give one stage below {R.shape[0]} per task, got {s.tolist()}")
    return s if R.shape[0] >= 2 else None


def average(R) -> float:
    """Final average MSE: the mean over tasks of the last stage's row."""
    return float(_stages(R)[-1].mean())


def forgetting(R, stage_of=None) -> np.ndarray:
    """Forgetting of every task trained before the last stage ((T - 1,) with one task per stage); NaN for a joint
    run."""
    R = _stages(R)
    s = _stage_of(R, stage_of)
    if s is None:
        return np.full(max(R.shape[1] - 1, 0), math.nan)
    S = R.shape[0]
    return np.array([R[-1, j] - R[s[j] : -1, j].min() for j in range(R.shape[1]) if 0 <= s[j] < S - 1])


def bwt(R, stage_of=None) -> float:
    """Backward transfer (GEM, on -MSE): < 0 when later stages raised earlier tasks' error; NaN for a joint run."""
    R = _stages(R)
    s = _stage_of(R, stage_of)
    if s is None:
        return math.nan
    S = R.shape[0]
    return float(np.mean([R[s[j], j] - R[-1, j] for j in range(R.shape[1]) if 0 <= s[j] < S - 1]))


def fwt(R, initial, stage_of=None) -> float:
    """Forward transfer (GEM, on -MSE): > 0 when earlier stages lowered a task's error before it was trained."""
    R, b = _stages(R), np.asarray(initial, dtype=float)
    s = _stage_of(R, stage_of)
    if s is None:
        return math.nan
    return float(np.mean([b[j] - R[s[j] - 1, j] for j in range(R.shape[1]) if s[j] >= 1]))


def smooth(p) -> np.ndarray:
    """Usage rows mixed with the uniform distribution by SMOOTHING (last axis: atoms)."""
    p = np.asarray(p, dtype=float)
    return (1 - SMOOTHING) * p + SMOOTHING / p.shape[-1]


def symmetric_kl(usage) -> np.ndarray:
    """(T, T) symmetric KL between the tasks' usage rows `usage` (T, M), smoothed (nats; zero diagonal)."""
    u = smooth(usage)
    T = u.shape[0]
    return np.array([[entropy(u[a], u[b]) + entropy(u[b], u[a]) for b in range(T)] for a in range(T)])


def usage_drift(U) -> np.ndarray:
    """(S - 1, T, M) change of every task's usage from one stage to the next."""
    U = np.asarray(U, dtype=float)
    return U[1:] - U[:-1]


def route_drift(U) -> np.ndarray:
    """(S - 1, T) total variation between every task's usage after stage i and after stage i - 1."""
    return 0.5 * np.abs(usage_drift(U)).sum(-1)


def atom_entropy(usage) -> np.ndarray:
    """(M,) normalised entropy of each atom's usage across the tasks, from the final usage `usage` (T, M)."""
    u = np.asarray(usage, dtype=float)
    T = u.shape[0]
    mass = u.sum(0)  # (M,)
    out = np.full(u.shape[1], math.nan)
    used = mass > 0
    out[used] = entropy(u[:, used] / mass[used], axis=0) / math.log(T)
    return out
