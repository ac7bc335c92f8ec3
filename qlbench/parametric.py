"""Parametric suites: one function under a continuous family of shifts, steepnesses and rotations, each task's
instruction a sentence that states its parameters in words, with held-out tasks inside and outside the training
region (the test of whether an instruction helps through its meaning, not as a task identifier).

    param-sin-cos-T   T training tasks (T in SIZES) + N_INTERPOLATION + N_EXTRAPOLATION held-out tasks

A task is sin(x1) + cos(x2) (the zoo's Sin-Cos source surface) on its own box [-pi, pi]^2, moved by a shift s
(function units), made k times as steep and rotated by theta (suites.py: task(x) = f(k R(theta) (x - c - s) + c)),
so the feature f has at z sits at x = c + s + R(-theta) (z - c) / k: shifted by s, k times closer together about
the moved centre, and turned theta degrees clockwise. The sentence says exactly that, e.g.

    "A sine-cosine wave surface shifted 1.5 units right and 0.5 units down, 1.25 times as steep, rotated 30 degrees
     clockwise."

with two paraphrases in other words and another order (evaluation only). Parameters lie on grids (so the words can
state them exactly; tests parse every sentence back and compare it with the data's parameters):

    training region   shift in {-1.5, -1, .., 1.5}^2, k in STEEPNESS, theta in {0, 5, .., 60}
    interpolation     drawn from the training region, never a training task
    extrapolation     the training region's shifts and k, theta in {70, 75, .., 90}: past every training angle

One seeded draw of the whole pool: the training tasks of a smaller suite are the first ones of a larger (T = 4 is
within T = 16, within T = 64) and every size holds out the same tasks, on one backbone, with each task's samples
drawn alike (every size keys them as param-sin-cos-4 does, `data_name`: a task's first n training inputs are the
same for every n, their label noise is not), so held-out MSE against T compares like with like.

qlbench interpretation of the data: a suite's training tasks share TRAIN_TOTAL training samples (1,600, zoo-4's
4 x 400), TRAIN_TOTAL / T each, so T changes the number of tasks and not the amount of data or of compute per
epoch; every task has TEST_PER_TASK test samples. The sequential schedule runs STAGES stages of
T / STAGES training tasks each.

Fixed n per task (the crossing of T with the data per task):

    param-sin-cos-T-n50   the same tasks as param-sin-cos-T, FIXED_N = 50 training samples per task (T x 50 in all)

Under the fixed total, T = 4, 16, 64 gives each task 400, 100, 25 samples, so "more tasks" is also "less data per
task"; at a fixed n only the number of tasks changes (and the total data, and the compute per epoch, with it).
qlbench interpretation: n = 50, not one of 400, 100, 25, so that no fixed-n suite is a fixed-total one under another
name (n = 100 would make T = 16 the same card as param-sin-cos-16, n = 25 T = 64), and so that T = 64 costs 3,200
samples per epoch, twice a fixed-total row (n = 100: four times). They share the family's backbone, tasks, held-out
tasks and draws (`data_name`): a task's first 50 training inputs are those of every other member.

Distance between tasks (`distance`): Euclidean, each parameter divided by its training range (shift 3 units,
k 0.75, theta 60 degrees), so one unit is one training range along any axis; `closest` names the nearest of a list
(the nearest-task row's routing, multitask.py).

Parameter codes (`codes`: the param-code and text-lora-params rows, multitask.py): a task's parameters, centred on
the training region's midpoint CENTRE and divided by RANGES, times a fixed seeded Gaussian matrix M (d, 4) with
entries of variance 1 / d, d the sentence embedding's 384: code(p) = M u(p), u(p) = (p - CENTRE) / RANGES. It is
linear in the parameters, so ||code(p) - code(q)|| <= ||M||_2 distance(p, q) (||M||_2 = 1.07 at d = 384): nearby
tasks get nearby codes and a held-out task's code lies between (or, extrapolating, past) its neighbours', unlike
task-code's seeded random vector per task, which a held-out task receives untrained. A code's norm is about ||u||
(0.29 to 1.16 over the pool's 80 tasks; e(c) is a unit vector). One M for the family (keyed by FUNCTION and d), so
a task has the same code at every T.
"""

from __future__ import annotations

import functools
import itertools
import math
import re

import torch

from qlbench.seeding import generator

FUNCTION = "sin-cos"
PREFIX = f"param-{FUNCTION}-"
SIZES = (4, 16, 64)
N_INTERPOLATION = 8
N_EXTRAPOLATION = 8
TRAIN_TOTAL = 1600
TEST_PER_TASK = 200
STAGES = 4
SHIFTS = (-1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5)
STEEPNESS = (0.75, 1.0, 1.25, 1.5)
TRAIN_ANGLES = tuple(range(0, 61, 5))
EXTRAPOLATION_ANGLES = tuple(range(70, 91, 5))
RANGES = (3.0, 3.0, 0.75, 60.0)  # (dx, dy, k, theta): the training region's width along each parameter
CENTRE = (0.0, 0.0, 1.125, 30.0)  # the training region's midpoint (parameter codes are centred on it)
FIXED_N = 50  # training samples per task of the fixed-n suites (param-sin-cos-T-n50)

Params = tuple[float, float, float, float]  # (dx, dy, k, theta)


def suite_name(T: int, n: int | None = None) -> str:
    """The suite of T training tasks: under the fixed total (n None), or with n training samples per task."""
    return f"{PREFIX}{T}" + ("" if n is None else f"-n{n}")


def names() -> list[str]:
    """The fixed-total suites (param-sin-cos-T), then the fixed-n ones (param-sin-cos-T-n50)."""
    return [*(suite_name(t) for t in SIZES), *(suite_name(t, FIXED_N) for t in SIZES)]


def size(name: str) -> tuple[int, int | None]:
    """(T, the fixed training samples per task or None under the fixed total) of a suite of `names`; ValueError
    for another name (listing them)."""
    for T in SIZES:
        for n in (None, FIXED_N):
            if name == suite_name(T, n):
                return T, n
    raise ValueError(f"unknown parametric suite {name!r}; valid: {', '.join(names())}")


def data_name(name: str) -> str:
    """The suite of the family that keys every member's data and backbone: the smallest (suites.data_name)."""
    return f"{PREFIX}{min(SIZES)}"


def _grid(angles) -> list[Params]:
    return [(dx, dy, k, float(a)) for dx, dy, k, a in itertools.product(SHIFTS, SHIFTS, STEEPNESS, angles)]


def pool() -> tuple[list[Params], list[Params], list[Params]]:
    """(training, interpolation, extrapolation) parameters of the whole family: max(SIZES) training tasks and the
    held-out ones, one seeded draw without replacement from each region's grid."""
    inside, outside = _grid(TRAIN_ANGLES), _grid(EXTRAPOLATION_ANGLES)
    order = torch.randperm(len(inside), generator=generator("parametric", FUNCTION, "inside")).tolist()
    picked = [inside[i] for i in order[: max(SIZES) + N_INTERPOLATION]]
    far = torch.randperm(len(outside), generator=generator("parametric", FUNCTION, "outside")).tolist()
    return picked[: max(SIZES)], picked[max(SIZES) :], [outside[i] for i in far[:N_EXTRAPOLATION]]


def _num(v: float) -> str:
    return f"{v:g}"


def _moves(dx: float, dy: float) -> tuple[str, str]:
    return (
        f"{_num(abs(dx))} units {'right' if dx >= 0 else 'left'}",
        f"{_num(abs(dy))} units {'up' if dy >= 0 else 'down'}",
    )


def sentences(p: Params) -> tuple[str, str, str]:
    """(instruction, paraphrase 1, paraphrase 2) stating the task's parameters p = (dx, dy, k, theta)."""
    dx, dy, k, theta = p
    h, v = _moves(dx, dy)
    return (
        f"A sine-cosine wave surface shifted {h} and {v}, {_num(k)} times as steep, rotated {_num(theta)} degrees "
        "clockwise.",
        f"Turn the rolling sine and cosine hills {_num(theta)} degrees clockwise, make them {_num(k)} times as steep, "
        f"and move them {h} and {v}.",
        f"Waves of sines and cosines, {_num(k)} times as steep as usual, rotated {_num(theta)} degrees clockwise "
        f"about their centre, with the pattern moved {h} and {v}.",
    )


_NUMBER = r"(\d+(?:\.\d+)?)"
_PATTERNS = {
    "dx": re.compile(rf"{_NUMBER} units (right|left)"),
    "dy": re.compile(rf"{_NUMBER} units (up|down)"),
    "k": re.compile(rf"{_NUMBER} times as steep"),
    "theta": re.compile(rf"{_NUMBER} degrees clockwise"),
}


def parse(sentence: str) -> Params:
    """The parameters a sentence states (the inverse of `sentences`, for tests and for reading a card);
    ValueError if one is not stated exactly once."""
    found = {}
    for key, pattern in _PATTERNS.items():
        hits = [m.groups() for m in pattern.finditer(sentence)]
        if len(hits) != 1:
            raise ValueError(f"{key} is stated {len(hits)} times in {sentence!r}")
        value, *word = hits[0]
        found[key] = float(value) * (-1 if word and word[0] in ("left", "down") else 1)
    return found["dx"], found["dy"], found["k"], found["theta"]


def params(task) -> Params:
    """(dx, dy, k, theta) of a suite task (suites.SuiteTask) as the data is made with them."""
    return (*task.shift, task.steepness, task.rotation_deg)


def distance(a: Params, b: Params) -> float:
    """Euclidean distance in units of the training ranges (RANGES)."""
    return math.sqrt(sum(((x - y) / r) ** 2 for x, y, r in zip(a, b, RANGES)))


def nearest(p: Params, among: list[Params]) -> float:
    """Distance from p to the nearest of `among`."""
    return min(distance(p, q) for q in among)


def closest(p: Params, among: list[Params]) -> int:
    """The index in `among` of the task nearest p (`distance`; the first of equally near ones), so that
    distance(p, among[closest(p, among)]) == nearest(p, among)."""
    if not among:
        raise ValueError("no task to be nearest to: `among` is empty")
    return min(range(len(among)), key=lambda i: distance(p, among[i]))


def scaled(p: Params) -> tuple[float, float, float, float]:
    """u(p) = (p - CENTRE) / RANGES: the parameters in training ranges about the training region's midpoint, so
    that ||u(p) - u(q)|| = distance(p, q)."""
    return tuple((x - c) / r for x, c, r in zip(p, CENTRE, RANGES))


@functools.cache
def _code_matrix(dim: int) -> torch.Tensor:
    g = generator("param-code", FUNCTION, dim)
    return torch.randn(dim, len(RANGES), generator=g, dtype=torch.float64) / math.sqrt(dim)


def code_matrix(dim: int) -> torch.Tensor:
    """M (dim, 4) float64: the fixed seeded Gaussian projection of the parameter codes, entries N(0, 1 / dim)."""
    return _code_matrix(dim).clone()


def codes(ps: list[Params], dim: int) -> torch.Tensor:
    """(len(ps), dim) float64: each task's parameter code M u(p) (module docstring)."""
    u = torch.tensor([scaled(p) for p in ps], dtype=torch.float64).reshape(len(ps), len(RANGES))
    return u @ _code_matrix(dim).T


def _task(name: str, p: Params, split: str) -> dict:
    instruction, *paraphrases = sentences(p)
    dx, dy, k, theta = p
    return dict(
        name=name,
        function=FUNCTION,
        shift=[dx, dy],
        steepness=k,
        rotation_deg=theta,
        split=split,
        instruction=instruction,
        paraphrases=paraphrases,
    )


def card(name: str) -> dict:
    """The generated card of suite `name` as a table (suites.from_dict checks it as it checks a TOML card);
    ValueError for a name that is not one (listing them). A fixed-n suite is its fixed-total twin's card with n
    training samples per task (and its own description)."""
    T, n = size(name)
    train, inter, extra = pool()
    lo, hi = -math.pi, math.pi
    per_task = "" if n is None else f", {n} training samples per task"
    return dict(
        description=f"Sin-Cos under {T} training shifts, steepnesses and rotations stated in words, and "
        f"{N_INTERPOLATION} + {N_EXTRAPOLATION} held-out ones (inside and past the training angles){per_task}",
        bounds=[[lo, hi], [lo, hi]],
        source=dict(function=FUNCTION),
        task=[
            *(_task(f"train-{i:02d}", p, "train") for i, p in enumerate(train[:T])),
            *(_task(f"interp-{i}", p, "interpolation") for i, p in enumerate(inter)),
            *(_task(f"extrap-{i}", p, "extrapolation") for i, p in enumerate(extra)),
        ],
        train_per_task=TRAIN_TOTAL // T if n is None else n,
        test_per_task=TEST_PER_TASK,
        stages=STAGES,
    )
