"""The function zoo: nine 2-D test functions, their cards, and the source -> target tasks built from them.

A card (`functions/<name>.toml`, shipped as package data `qlbench.functions`) holds everything that is data:
domain, default coefficients, target coefficients and rotation, optimum, reference values, instruction text.
This module holds the formulas (one small function per family, `f(x, **coefficients)` with x of shape (..., 2))
and turns a card into a `TestFunction` or a `Task`:

    target(x) = out_scale * f_{theta_target}( R(phi) (x - centre) + centre ) + out_shift

The paper says it "rotates the outputs"; rotating a scalar means nothing beyond a sign, so qlbench rotates the
input plane about the box centre (CEC-style) and keeps an output affine map (identity by default).
"""

from __future__ import annotations

import functools
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.resources import files
from typing import NamedTuple

import torch
from torch import Tensor

from qlbench.records.store import stable_hash
from qlbench.seeding import generator

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser from PyPI
    import tomli as tomllib

# Sampling protocol (paper, appendix "deep-narrow stress test"): sizes and label noise.
SOURCE_SIZE = 3000
SOURCE_TRAIN = 2400  # 80/20 source train/test
TARGET_SIZE = 1200
TARGET_TRAIN = 400  # 400 for adaptation, 800 held out
VALIDATION_SIZE = 400  # further target samples, their own stream, for choosing a learning rate (Task.validation_data)

# Label noise: additive Gaussian, train and test alike. qlbench interpretation (the paper gives no noise level or
# label scale): by default ("relative") its std is NOISE_FRACTION times the clean function's own spread over the
# box, so every task has the same signal to noise, about 1 / NOISE_FRACTION^2 = 400, whatever its units; "absolute"
# is the construction of records written before the setting existed (std LABEL_NOISE in raw units: signal to noise
# from 8 on Drop-Wave to above 10^5), kept so that they stay reproducible.
NOISES = ("relative", "absolute")
DEFAULT_NOISE = "relative"
LEGACY_NOISE = "absolute"  # what a config without a "noise" key means
NOISE_FRACTION = 0.05  # relative: noise std / the clean function's std over the box
LABEL_NOISE = 0.05  # absolute: noise std in raw units (MSE floor 0.0025)
SPREAD_GRID = 256  # the spread is measured on a SPREAD_GRID x SPREAD_GRID grid of cell midpoints over the box

Coefficient = float | tuple  # a number, or a (nested) tuple of numbers such as Langermann's c and A


# --------------------------------------------------------------------------------------------------------------
# Formulas. Each takes x (..., 2) in any float dtype and returns (...) in the same dtype.
# Python-float constants keep x's dtype; sequences become tensors on x's dtype and device.


def ackley(x: Tensor, a: float, b: float, c: float) -> Tensor:
    """-a exp(-b sqrt(mean_i x_i^2)) - exp(mean_i cos(c x_i)) + a + e."""
    return -a * torch.exp(-b * x.square().mean(-1).sqrt()) - torch.exp(torch.cos(c * x).mean(-1)) + a + math.e


def dropwave(x: Tensor, k: float, q: float, o: float) -> Tensor:
    """-(1 + cos(k r)) / (q r^2 + o), r = ||x||."""
    r2 = x.square().sum(-1)
    return -(1 + torch.cos(k * r2.sqrt())) / (q * r2 + o)


def langermann(x: Tensor, c: Sequence[float], A: Sequence[Sequence[float]]) -> Tensor:
    """sum_i c_i exp(-s_i / pi) cos(pi s_i), s_i = ||x - A_i||^2 (SFU sign: no leading minus)."""
    c_ = torch.as_tensor(c, dtype=x.dtype, device=x.device)  # (m,)
    A_ = torch.as_tensor(A, dtype=x.dtype, device=x.device)  # (m, 2)
    s = (x.unsqueeze(-2) - A_).square().sum(-1)  # (..., m)
    return (c_ * torch.exp(-s / math.pi) * torch.cos(math.pi * s)).sum(-1)


def levy(x: Tensor, a: float, w: float) -> Tensor:
    """w_i = 1 + (x_i - 1)/4; sin^2(pi w1) + (w1-1)^2 [1 + a sin^2(pi w1 + 1)] + (w2-1)^2 [1 + sin^2(w w2)].

    Source: a = 10, w = 2 pi (SFU, BoTorch).
    """
    w1, w2 = (1 + (x - 1) / 4).unbind(-1)
    return (
        torch.sin(math.pi * w1).square()
        + (w1 - 1).square() * (1 + a * torch.sin(math.pi * w1 + 1).square())
        + (w2 - 1).square() * (1 + torch.sin(w * w2).square())
    )


def matyas(x: Tensor, a: float, b: float) -> Tensor:
    """a (x1^2 + x2^2) - b x1 x2 (convex while b < 2a)."""
    x1, x2 = x.unbind(-1)
    return a * (x1.square() + x2.square()) - b * x1 * x2


def michalewicz(x: Tensor, m: float) -> Tensor:
    """-sum_i sin(x_i) sin^(2m)(i x_i^2 / pi), i = 1..d."""
    i = torch.arange(1, x.shape[-1] + 1, dtype=x.dtype, device=x.device)  # (d,)
    return -(torch.sin(x) * torch.sin(i * x.square() / math.pi).pow(2 * m)).sum(-1)


def rastrigin(x: Tensor, A: float, w: float) -> Tensor:
    """A d + sum_i (x_i^2 - A cos(w x_i))."""
    return A * x.shape[-1] + (x.square() - A * torch.cos(w * x)).sum(-1)


def styblinski_tang(x: Tensor, p: float, q: float) -> Tensor:
    """(1/2) sum_i (x_i^4 - p x_i^2 + q x_i)."""
    return 0.5 * (x.pow(4) - p * x.square() + q * x).sum(-1)


def sin_cos(x: Tensor, a: float, b: float, w1: float, w2: float) -> Tensor:
    """a sin(w1 x1) + b cos(w2 x2) (not an SFU function; qlbench's reading of the paper's "Sin-Cos")."""
    x1, x2 = x.unbind(-1)
    return a * torch.sin(w1 * x1) + b * torch.cos(w2 * x2)


# A card names its formula by `family`, so a variant (other coefficients, other box) is just a new card.
FAMILIES: dict[str, Callable[..., Tensor]] = {
    f.__name__: f
    for f in (ackley, dropwave, langermann, levy, matyas, michalewicz, rastrigin, styblinski_tang, sin_cos)
}


# --------------------------------------------------------------------------------------------------------------
# Cards.


@dataclass(frozen=True)
class Card:
    """One `functions/<name>.toml`, parsed; arrays become tuples. Treat the coefficient dicts as read-only."""

    name: str  # the file stem, e.g. "styblinski-tang"
    family: str  # key into FAMILIES
    display_name: str
    formula: str  # LaTeX
    source_url: str
    instruction: str  # one sentence describing the target surface (instruction routing)
    adversarial_instruction: str  # a sentence describing a very different surface (the instruction ablation)
    bounds: tuple[tuple[float, float], ...]  # ((lo1, hi1), (lo2, hi2))
    coefficients: Mapping[str, Coefficient]  # source (default) coefficients
    target_coefficients: Mapping[str, Coefficient]  # only those that change
    rotation_deg: float
    out_scale: float
    out_shift: float
    optimum_value: float
    optimum_locations: tuple[tuple[float, ...], ...]
    tolerance: float  # abs accuracy of the card's numbers (optimum, references): 1e-9 unless the card says
    references: tuple[tuple[tuple[float, ...], float], ...]  # ((x, value), ...)


def _frozen(v):
    """Lists (TOML arrays) -> tuples, nested: coefficient sequences and points are immutable and comparable."""
    return tuple(_frozen(e) for e in v) if isinstance(v, (list, tuple)) else v


def _parse(name: str, text: str) -> Card:
    d = tomllib.loads(text)
    coefficients = {k: _frozen(v) for k, v in d["coefficients"].items()}
    target = d["target"]
    changed = {k: _frozen(v) for k, v in target["coefficients"].items()}
    if d["family"] not in FAMILIES:
        raise ValueError(f"card {name!r}: unknown family {d['family']!r}; choose from {', '.join(FAMILIES)}")
    if unknown := changed.keys() - coefficients.keys():
        raise ValueError(f"card {name!r}: target changes unknown coefficients {sorted(unknown)}")
    return Card(
        name=name,
        family=d["family"],
        display_name=d["display_name"],
        formula=d["formula"],
        source_url=d["source_url"],
        instruction=d["instruction"],
        adversarial_instruction=d["adversarial_instruction"],
        bounds=tuple((float(lo), float(hi)) for lo, hi in d["domain"]["bounds"]),
        coefficients=coefficients,
        target_coefficients=changed,
        rotation_deg=float(target["rotation_deg"]),
        out_scale=float(target["out_scale"]),
        out_shift=float(target["out_shift"]),
        optimum_value=float(d["optimum"]["value"]),
        optimum_locations=_frozen(d["optimum"]["locations"]),
        tolerance=float(d["optimum"].get("tolerance", 1e-9)),
        references=tuple((_frozen(r["x"]), float(r["value"])) for r in d["reference"]),
    )


# The parts of a card that the data and the instructions are made from (card_digest); the name, formula, optimum and
# references describe the function and change no number of a run.
DATA_FIELDS = ("family", "instruction", "adversarial_instruction", "domain", "coefficients", "target")


@functools.cache
def _texts() -> dict[str, str]:
    # Package data, not a repo path: the same code reads the cards from a wheel or an editable install.
    return {
        p.name.removesuffix(".toml"): p.read_text(encoding="utf-8")
        for p in files("qlbench.functions").iterdir()
        if p.name.endswith(".toml")
    }


@functools.cache
def _cards() -> dict[str, Card]:
    return {name: _parse(name, text) for name, text in _texts().items()}


def names() -> list[str]:
    """Names of all cards in the zoo, sorted (the variants of card_name do not count: there are infinitely many)."""
    return sorted(_cards())


# A task variant: a card's task with its shift scaled, named "<card>@s<strength>" (e.g. "dropwave@s2"). qlbench
# interpretation of a shift's strength s (item analysis, docs/results/items): each changed coefficient moves s times
# as far from its source value, the rotation is s times the card's angle, and the output map moves s times as far
# from the identity (out_scale 1 + s (a - 1), out_shift s b). s = 1 is the card's own task; the source is the
# card's, so a variant's backbones are the card's (engine.cache keys them by card_name).
VARIANT = "@"
_STRENGTH = re.compile(r"s(\d+(?:\.\d+)?)")
MAX_STRENGTH = 10.0


def split_name(name: str) -> tuple[str, float]:
    """(card name, shift strength) of a task name: "dropwave" -> ("dropwave", 1.0), "dropwave@s2" -> ("dropwave",
    2.0); ValueError (one line, naming the valid forms) for an unknown card or a malformed variant."""
    base, sep, variant = name.partition(VARIANT)
    card(base)  # ValueError listing the valid names
    if not sep:
        return base, 1.0
    m = _STRENGTH.fullmatch(variant)
    strength = float(m.group(1)) if m else 0.0
    if not 0 < strength <= MAX_STRENGTH:
        raise ValueError(
            f"task {name!r}: a variant is {base}{VARIANT}s<strength>, 0 < strength <= {MAX_STRENGTH:g} "
            f"(e.g. {base}{VARIANT}s2)"
        )
    if strength == 1.0:
        raise ValueError(f"task {name!r} is the card's own task; name it {base!r}")
    return base, strength


def card_name(name: str) -> str:
    """The card a task name (a card's or a variant's, split_name) is made from."""
    return split_name(name)[0]


def card_digest(name: str) -> str:
    """16 hex digits naming the version of the card `name` that data is made from: the stable hash of its
    DATA_FIELDS as parsed (comments, layout and the descriptive fields do not count). Records and backbone files
    hold it, so a card edited in place is found out (runner.finished, engine.pretrain, protocols)."""
    table = tomllib.loads(_texts()[card_name(name)])  # a variant's: its card's (the strength is in its name)
    return stable_hash({k: table.get(k) for k in DATA_FIELDS})


def card(name: str) -> Card:
    """The card `functions/<name>.toml` (a variant's name, split_name: its card's); ValueError listing the valid
    names if there is none."""
    cards = _cards()
    if VARIANT in name:
        name = split_name(name)[0]  # ValueError for a malformed variant
    if name not in cards:
        raise ValueError(f"unknown function {name!r}; choose from: {', '.join(sorted(cards))}")
    return cards[name]


# --------------------------------------------------------------------------------------------------------------
# Functions and tasks.


@dataclass(frozen=True)
class TestFunction:
    """A card's formula with fixed coefficients: `f(x)`, x (..., 2) -> (...), same dtype and device as x."""

    __test__ = False  # not a pytest test class, despite the name

    name: str
    card: Card
    coefficients: Mapping[str, Coefficient]

    def __call__(self, x: Tensor) -> Tensor:
        return FAMILIES[self.card.family](x, **self.coefficients)

    @property
    def bounds(self) -> Tensor:
        """(2, d) float64: row 0 lower bounds, row 1 upper bounds."""
        return torch.tensor(self.card.bounds, dtype=torch.float64).T

    @property
    def optimum_value(self) -> float | None:
        """The card's global minimum; None once coefficients are overridden (the card no longer knows it)."""
        return self.card.optimum_value if self.coefficients == self.card.coefficients else None

    @property
    def optimum_locations(self) -> tuple[tuple[float, ...], ...] | None:
        """Where the card's global minimum is attained; None once coefficients are overridden."""
        return self.card.optimum_locations if self.coefficients == self.card.coefficients else None


def function(name: str, **coefficient_overrides: Coefficient) -> TestFunction:
    """The card's function with its default (source) coefficients, or some of them overridden."""
    c = card(name)
    if unknown := coefficient_overrides.keys() - c.coefficients.keys():
        raise ValueError(
            f"{name}: unknown coefficient(s) {', '.join(sorted(unknown))}; choose from: {', '.join(c.coefficients)}"
        )
    overrides = {k: _frozen(v) for k, v in coefficient_overrides.items()}
    return TestFunction(name, c, {**c.coefficients, **overrides})


def rotation(phi_deg: float) -> Tensor:
    """(2, 2) float64 counter-clockwise rotation by phi degrees: R(90) (1, 0) = (0, 1)."""
    phi = math.radians(phi_deg)
    return torch.tensor([[math.cos(phi), -math.sin(phi)], [math.sin(phi), math.cos(phi)]], dtype=torch.float64)


@dataclass(frozen=True)
class ShiftedFunction:
    """The target of a task: out_scale * f(R(phi) (x - centre) + centre) + out_shift, centre = box centre;
    x (..., 2) -> (...)."""

    function: TestFunction  # with the target coefficients
    rotation_deg: float
    out_scale: float
    out_shift: float

    def __call__(self, x: Tensor) -> Tensor:
        centre = self.function.bounds.mean(0).to(x)  # (2,)
        R = rotation(self.rotation_deg).to(x)  # (2, 2)
        # x holds row vectors, and (R v)^T = v^T R^T. Features of f at z show up at x = centre + R^T (z - centre):
        # the drawn surface turns clockwise by phi.
        z = (x - centre) @ R.T + centre  # (..., 2)
        return self.out_scale * self.function(z) + self.out_shift


class Split(NamedTuple):
    """A dataset: inputs (N, 2) and noisy labels (N,) for training and held-out testing."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor


@dataclass(frozen=True)
class Task:
    """A source function (card defaults) and its shifted target, with the paper's seeded datasets."""

    name: str
    card: Card
    source: TestFunction
    target: ShiftedFunction
    instruction: str
    noise: str = DEFAULT_NOISE  # NOISES

    @property
    def bounds(self) -> Tensor:
        """(2, d) float64: row 0 lower bounds, row 1 upper bounds (shared by source and target)."""
        return self.source.bounds

    def noise_std(self, stream: str) -> float:
        """The std of the label noise of the "source" or "target" stream under this task's noise construction."""
        if self.noise == "absolute":
            return LABEL_NOISE
        return NOISE_FRACTION * _spread(self.name, stream)

    def source_data(self, seed: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Split:
        """SOURCE_SIZE noisy samples of the source, split SOURCE_TRAIN / rest."""
        return self._sample(self.source, "source", seed, SOURCE_SIZE, SOURCE_TRAIN, dtype, device)

    def validation_data(
        self, seed: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> tuple[Tensor, Tensor]:
        """VALIDATION_SIZE noisy samples of the target, drawn from their own stream: x (N, 2), y (N,), neither
        training nor test data (a protocol chooses learning rates on them)."""
        x, y, _, _ = self._sample(self.target, "validation", seed, VALIDATION_SIZE, VALIDATION_SIZE, dtype, device)
        return x, y

    def target_data(self, seed: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Split:
        """TARGET_SIZE noisy samples of the target, split TARGET_TRAIN / rest."""
        return self._sample(self.target, "target", seed, TARGET_SIZE, TARGET_TRAIN, dtype, device)

    def _sample(
        self,
        f: Callable[[Tensor], Tensor],
        stream: str,
        seed: int,
        n: int,
        n_train: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> Split:
        # Drawn in float64 on CPU from a generator named by (task, stream, seed): identical tensors for every
        # dtype and device, independent seeds, and source/target never share a stream.
        # the source of a variant is its card's: the same stream, so the same data and backbones as the card's task
        g = generator("data", self.card.name if stream == "source" else self.name, stream, seed)
        lo, hi = self.bounds  # (2,), (2,)
        x = lo + (hi - lo) * torch.rand(n, len(lo), generator=g, dtype=torch.float64)  # (n, 2)
        y = f(x) + self.noise_std("source" if stream == "source" else "target") * torch.randn(
            n, generator=g, dtype=torch.float64
        )  # (n,)
        x, y = x.to(dtype=dtype, device=device), y.to(dtype=dtype, device=device)
        return Split(x[:n_train], y[:n_train], x[n_train:], y[n_train:])


def check_noise(noise: str) -> None:
    """ValueError naming the valid constructions unless `noise` is one of NOISES."""
    if noise not in NOISES:
        raise ValueError(f"unknown label noise {noise!r}; valid: {', '.join(NOISES)}")


def task(name: str, noise: str = DEFAULT_NOISE) -> Task:
    """The source -> target task of the card `name` (target coefficients, rotation and output map from the card),
    its labels noised by the construction `noise` (NOISES)."""
    check_noise(noise)
    base, s = split_name(name)
    c = card(base)
    moved = {k: _moved(c.coefficients[k], v, s) for k, v in c.target_coefficients.items()}
    target = ShiftedFunction(function(base, **moved), s * c.rotation_deg, 1 + s * (c.out_scale - 1), s * c.out_shift)
    return Task(name, c, function(base), target, c.instruction, noise)


def _moved(source: Coefficient, target: Coefficient, s: float) -> Coefficient:
    """source + s (target - source), element by element through nested tuples; s = 1 gives `target` exactly."""
    if isinstance(source, tuple):
        return tuple(_moved(a, b, s) for a, b in zip(source, target))
    return target if s == 1.0 else source + s * (target - source)


def grid(bounds: Tensor, n: int = SPREAD_GRID) -> Tensor:
    """(n * n, 2) float64: the midpoints of an n x n grid of equal cells over the box `bounds` (2, 2)."""
    lo, hi = bounds  # (2,), (2,)
    t = (torch.arange(n, dtype=torch.float64) + 0.5) / n  # (n,)
    u, v = torch.meshgrid(lo[0] + (hi[0] - lo[0]) * t, lo[1] + (hi[1] - lo[1]) * t, indexing="ij")
    return torch.stack([u.flatten(), v.flatten()], dim=-1)


@functools.cache
def _spread(name: str, stream: str) -> float:
    """The std of the clean "source" or "target" function of card `name` over the grid of its box (float64)."""
    t = task(name, LEGACY_NOISE)
    f = {"source": t.source, "target": t.target}[stream]
    return f(grid(t.bounds)).std().item()


def signal_to_noise(name: str, seeds: Sequence[int] = (0, 1, 2), noise: str = DEFAULT_NOISE) -> dict[str, float]:
    """How much of the target is signal: measured on the target's seeded datasets (float64), averaged over `seeds`,
    under the label-noise construction `noise`.

    label_var   variance of the clean target labels f'(x) over the target's inputs (train and test)
    noise_var   variance of the target's label noise
    snr         label_var / noise_var
    mean_mse    test MSE of predicting the mean training label (what the `mean` row scores)
    shift_mse   test MSE of the source function itself on the target (what a frozen backbone that fitted the source
                exactly would score: how far the shift moved the labels)
    """
    t = task(name, noise)
    rows = []
    for seed in seeds:
        x_train, y_train, x_test, y_test = t.target_data(seed, dtype=torch.float64)
        clean = t.target(torch.cat([x_train, x_test]))  # (TARGET_SIZE,)
        rows.append(
            (
                clean.var().item(),
                (y_test - y_train.mean()).pow(2).mean().item(),
                (y_test - t.source(x_test)).pow(2).mean().item(),
            )
        )
    label_var, mean_mse, shift_mse = (sum(col) / len(rows) for col in zip(*rows))
    noise_var = t.noise_std("target") ** 2
    return dict(
        label_var=label_var,
        noise_var=noise_var,
        snr=label_var / noise_var,
        mean_mse=mean_mse,
        shift_mse=shift_mse,
    )
