"""Suites: several target tasks on one backbone, each with its own instruction (multi-task and continual runs).

A suite card (`functions/suites/<name>.toml`, shipped as package data `qlbench.functions.suites`) names the
backbone's source task and T target tasks. Every task is a zoo function on the suite's common input box:

    task_t(x) = sign_t * f_t( k_t R(phi_t) (m_t(x) - centre_t - shift_t) + centre_t - offset_t * width_t )

where m_t maps the common box affinely onto the function's own card box (the identity when they coincide),
centre_t and width_t are that box's centre and side lengths, offset_t is a fraction of the box (so the surface's
features move by offset_t * width_t) and sign_t = -1 turns the surface upside down. f_t uses the card's source
coefficients unless the task asks for its target ones. Two more fields serve the parametric suites (parametric.py)
and default to no change: shift_t, in the function's own units, moves the surface's features by exactly shift_t
(before the rotation and the steepness, so the words "shifted 1.5 units right" stay true of any rotated task), and
k_t > 0 makes the surface k_t times as steep (its features k_t times closer together about the moved centre). A
task's `split` ("train", "interpolation" or "extrapolation") marks the tasks a card holds out (`held_out`).

A card may also set how much data each task gets (`train_per_task`, `test_per_task`; default the zoo's 400 and 800)
and how many stages the sequential schedule has (`stages`: the trained tasks split into that many consecutive
groups; default one task per stage). Cards come from TOML files or from a generator (parametric.py) through the
same checks (`from_dict`).

qlbench interpretation (the paper does not say how its tasks were scaled): every task's labels, and the source's,
are standardised by the clean function's own mean and std over a SPREAD_GRID x SPREAD_GRID grid of the common box
(fixed numbers of the task, not of a dataset, so no split leaks into another), and carry Gaussian noise of std
zoo.NOISE_FRACTION in those units: every task then has unit label variance over the box and a signal to noise of
about 400, so tasks weigh alike in a joint loss (raw label spreads across the zoo differ by a factor of 400).

Besides the cards, every suite has a control, `<name>-same-instruction`: the same tasks, every one of them given
SAME_INSTRUCTION, so that what an instruction adds can be told apart from what the adapter's capacity does.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from dataclasses import dataclass, replace
from importlib.resources import files

import torch
from torch import Tensor

from qlbench import parametric, zoo
from qlbench.records.store import stable_hash
from qlbench.seeding import generator

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser from PyPI
    import tomli as tomllib

CONTROL_SUFFIX = "-same-instruction"
SAME_INSTRUCTION = "One of several related regression tasks on the same two-dimensional input."
MIN_PARAPHRASES = 2
COEFFICIENT_SETS = ("source", "target")
TASK_FIELDS = {
    "name", "function", "coefficients", "rotation_deg", "offset", "flip", "instruction", "paraphrases", "shift",
    "steepness", "split",
}  # fmt: skip
CARD_FIELDS = {"description", "bounds", "source", "task", "train_per_task", "test_per_task", "stages"}
SPLITS = ("", "train", "interpolation", "extrapolation")  # "": a card that holds out nothing by itself
HELD_OUT_SPLITS = ("interpolation", "extrapolation")


@dataclass(frozen=True)
class SuiteTask:
    """One task of a suite: a zoo function placed on the common box, its instruction and paraphrases."""

    name: str
    function: str  # zoo card name
    coefficients: str  # "source" (the card's defaults) or "target" (the card's target coefficients)
    rotation_deg: float
    offset: tuple[float, float]  # fraction of the function's box the features move by, per coordinate
    flip: bool  # upside down (sign -1)
    instruction: str
    paraphrases: tuple[str, ...]  # other words for the same task: used only at evaluation
    shift: tuple[float, float] = (0.0, 0.0)  # function units the features move by (before rotation and steepness)
    steepness: float = 1.0  # k: features k times closer together
    split: str = ""  # one of SPLITS: a parametric card's training or held-out region

    def clean(self, x: Tensor, bounds: Tensor) -> Tensor:
        """The noiseless raw task function at x (..., 2) on the common box `bounds` (2, 2) -> (...), float64 math
        in x's dtype."""
        c = zoo.card(self.function)
        own = torch.tensor(c.bounds, dtype=torch.float64).T.to(x)  # (2, 2): row 0 lower, row 1 upper
        lo, hi = bounds.to(x)
        z = own[0] + (x - lo) / (hi - lo) * (own[1] - own[0])  # onto the function's own box
        centre, width = own.mean(0), own[1] - own[0]
        turned = (z - centre - torch.tensor(self.shift).to(x)) @ zoo.rotation(self.rotation_deg).to(x).T
        z = self.steepness * turned + centre - torch.tensor(self.offset).to(x) * width
        coefficients = c.target_coefficients if self.coefficients == "target" else {}
        y = zoo.function(self.function, **coefficients)(z)
        return -y if self.flip else y


@dataclass(frozen=True)
class Suite:
    """A suite card, parsed: the common box, the backbone's source function and the T target tasks."""

    name: str
    description: str
    bounds: tuple[tuple[float, float], tuple[float, float]]
    source: SuiteTask  # what the backbone is pretrained on (its instruction is not used)
    tasks: tuple[SuiteTask, ...]
    train_per_task: int = zoo.TARGET_TRAIN  # training samples drawn for each task
    test_per_task: int = zoo.TARGET_SIZE - zoo.TARGET_TRAIN  # test samples drawn for each task
    stages: int | None = None  # sequential stages over the trained tasks; None: one task per stage

    @property
    def box(self) -> Tensor:
        """(2, 2) float64: row 0 lower bounds, row 1 upper bounds."""
        return torch.tensor(self.bounds, dtype=torch.float64).T

    @property
    def task_names(self) -> list[str]:
        return [t.name for t in self.tasks]

    def instructions(self) -> list[str]:
        return [t.instruction for t in self.tasks]

    @property
    def held_out(self) -> tuple[int, ...]:
        """The tasks the held-out schedule never trains on (`held_out`)."""
        return held_out([t.split for t in self.tasks])

    def schedule_stages(self, schedule: str) -> list[list[int]]:
        """The tasks each stage of `schedule` trains on (`schedule_stages`)."""
        return schedule_stages(schedule, [t.split for t in self.tasks], self.stages)

    def standardisation(self, task: SuiteTask) -> tuple[float, float]:
        """(mean, std) of the clean task function over the grid of the common box (float64)."""
        return _standardisation(self, task)

    def labels(self, task: SuiteTask, x: Tensor) -> Tensor:
        """Clean standardised labels of `task` at x (..., 2) float64."""
        mu, sd = self.standardisation(task)
        return (task.clean(x, self.box) - mu) / sd

    def source_data(self, seed: int, dtype=torch.float32, device="cpu") -> zoo.Split:
        """zoo.SOURCE_SIZE noisy standardised samples of the source, split zoo.SOURCE_TRAIN / rest."""
        return self._sample(self.source, "source", seed, zoo.SOURCE_SIZE, zoo.SOURCE_TRAIN, dtype, device)

    def task_data(self, t: int, seed: int, dtype=torch.float32, device="cpu") -> zoo.Split:
        """train_per_task + test_per_task noisy standardised samples of task t, split in that order."""
        n = self.train_per_task + self.test_per_task
        return self._sample(self.tasks[t], "target", seed, n, self.train_per_task, dtype, device)

    def _sample(self, task: SuiteTask, stream: str, seed: int, n: int, n_train: int, dtype, device) -> zoo.Split:
        # drawn in float64 on the CPU from a generator named by (suite, task, stream, seed): the same tensors for
        # every dtype and device; the control suite draws exactly its card's data (it keys on the card's name)
        g = generator("suite-data", data_name(self.name), task.name, stream, seed)
        lo, hi = self.box
        x = lo + (hi - lo) * torch.rand(n, 2, generator=g, dtype=torch.float64)  # (n, 2)
        y = self.labels(task, x) + zoo.NOISE_FRACTION * torch.randn(n, generator=g, dtype=torch.float64)  # (n,)
        x, y = x.to(dtype=dtype, device=device), y.to(dtype=dtype, device=device)
        return zoo.Split(x[:n_train], y[:n_train], x[n_train:], y[n_train:])


# the fields added for the parametric suites, at the values that change nothing (card_config leaves them out there)
TASK_DEFAULTS = {"shift": (0.0, 0.0), "steepness": 1.0, "split": ""}
CARD_DEFAULTS = {
    "train_per_task": zoo.TARGET_TRAIN,
    "test_per_task": zoo.TARGET_SIZE - zoo.TARGET_TRAIN,
    "stages": None,
}


def held_out(splits: list[str]) -> tuple[int, ...]:
    """The tasks a card holds out, from its tasks' splits: those marked interpolation or extrapolation, or the last
    task of a card that marks none."""
    return tuple(i for i, s in enumerate(splits) if s in HELD_OUT_SPLITS) or (len(splits) - 1,)


def schedule_stages(schedule: str, splits: list[str], stages: int | None) -> list[list[int]]:
    """The tasks each stage of `schedule` trains on, for a card whose tasks have `splits` and whose sequential
    schedule has `stages` stages: joint, every task at once; held-out, every task but the held-out ones at once;
    sequential, one task per stage (stages None), or the tasks the card does not hold out in `stages` consecutive
    groups of (nearly) equal size."""
    T, kept = len(splits), held_out(splits)
    trained = [t for t in range(T) if t not in kept]
    if schedule == "joint":
        return [list(range(T))]
    if schedule == "held-out":
        return [trained]
    if schedule != "sequential":
        raise ValueError(f"unknown schedule {schedule!r}; valid: joint, sequential, held-out")
    if stages is None:
        return [[t] for t in range(T)]
    bounds = [round(i * len(trained) / stages) for i in range(stages + 1)]
    return [trained[a:b] for a, b in zip(bounds, bounds[1:])]


def record_stages(config: dict) -> list[list[int]]:
    """schedule_stages of a suite record's config (its card as card_config wrote it)."""
    card = config["suite_card"]
    return schedule_stages(config["schedule"], [t.get("split", "") for t in card["tasks"]], card.get("stages"))


@functools.cache
def _standardisation(suite: Suite, task: SuiteTask) -> tuple[float, float]:
    y = task.clean(zoo.grid(suite.box), suite.box)  # (SPREAD_GRID^2,)
    return y.mean().item(), y.std().item()


def data_name(name: str) -> str:
    """The suite whose name keys a suite's data draws, task codes and backbone: its card (base_name), or for every
    parametric suite the family's smallest (parametric.data_name), so that the suites of one family, whatever their
    T, share a backbone and each task's samples."""
    return parametric.data_name(name) if name in parametric.names() else base_name(name)


def base_name(name: str) -> str:
    """The card a suite name reads: the name itself, or the card of a `-same-instruction` control."""
    return name.removesuffix(CONTROL_SUFFIX)


# --------------------------------------------------------------------------------------------------------------
# Cards.


def _fail(name: str, where: str, message: str):
    raise ValueError(f"suite {name!r}: {where}: {message}")


# qlbench interpretation of a card's limits: the zoo's boxes span tens of units and its shifts a few; coordinates
# past MAX_COORDINATE overflow the functions' arithmetic (bounds near 1e300 give NaN tables), and a card of more
# than MAX_TASKS tasks is beyond any suite here (one of 10,000 runs for minutes with no estimate)
MAX_COORDINATE = 1e3
MAX_TASKS = 256
MAX_SAMPLES = 100_000  # per task and split


def _text(name: str, where: str, value) -> str:
    if not isinstance(value, str) or not value.strip():
        _fail(name, where, f"must be a non-empty sentence, got {value!r}")
    if not value.isprintable():  # control characters would reach the terminal raw
        _fail(name, where, f"must be one line of printable text, got {value!r}")
    return value


def _number(name: str, where: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        _fail(name, where, f"must be a finite number, got {value!r}")
    if abs(value) > MAX_COORDINATE:
        _fail(name, where, f"must lie within +-{MAX_COORDINATE:g}, got {value!r}")
    return float(value)


def _pair(name: str, where: str, value) -> tuple[float, float]:
    if not (isinstance(value, list) and len(value) == 2):
        _fail(name, where, f"must be a list of two numbers, got {value!r}")
    return tuple(_number(name, where, v) for v in value)


def _task(name: str, where: str, d: dict, *, source: bool = False) -> SuiteTask:
    if not isinstance(d, dict):
        _fail(name, where, f"must be a table, got {d!r}")
    if unknown := sorted(set(d) - TASK_FIELDS):
        _fail(name, f"{where}.{unknown[0]}", f"unknown field; valid: {', '.join(sorted(TASK_FIELDS))}")
    for key in ("function",) if source else ("name", "function", "instruction"):
        if key not in d:
            _fail(name, f"{where}.{key}", "missing")
    function = d["function"]
    if function not in zoo.names():
        _fail(name, f"{where}.function", f"unknown function {function!r}; valid: {', '.join(zoo.names())}")
    coefficients = d.get("coefficients", "source")
    if coefficients not in COEFFICIENT_SETS:
        _fail(name, f"{where}.coefficients", f"must be one of {', '.join(COEFFICIENT_SETS)}, got {coefficients!r}")
    flip = d.get("flip", False)
    if not isinstance(flip, bool):
        _fail(name, f"{where}.flip", f"must be true or false, got {flip!r}")
    paraphrases = d.get("paraphrases", [])
    if not source:
        if not isinstance(paraphrases, list) or len(paraphrases) < MIN_PARAPHRASES:
            _fail(name, f"{where}.paraphrases", f"needs at least {MIN_PARAPHRASES} sentences, got {paraphrases!r}")
        paraphrases = [_text(name, f"{where}.paraphrases", p) for p in paraphrases]
    steepness = _number(name, f"{where}.steepness", d.get("steepness", 1.0))
    if steepness <= 0:
        _fail(name, f"{where}.steepness", f"must be a positive number, got {steepness!r}")
    split = d.get("split", "")
    if split not in SPLITS or (source and split):
        valid = "leave it out (the source is never a task)" if source else ", ".join(repr(v) for v in SPLITS)
        _fail(name, f"{where}.split", f"must be one of {valid}, got {split!r}")
    task_name = d.get("name", "source")
    if not isinstance(task_name, str) or not task_name.strip() or "/" in task_name or not task_name.isprintable():
        _fail(name, f"{where}.name", f"must be a non-empty printable name without '/', got {task_name!r}")
    return SuiteTask(
        name=task_name,
        function=function,
        coefficients=coefficients,
        rotation_deg=_number(name, f"{where}.rotation_deg", d.get("rotation_deg", 0.0)),
        offset=_pair(name, f"{where}.offset", d.get("offset", [0.0, 0.0])),
        flip=flip,
        instruction="" if source else _text(name, f"{where}.instruction", d["instruction"]),
        paraphrases=tuple(paraphrases),
        shift=_pair(name, f"{where}.shift", d.get("shift", [0.0, 0.0])),
        steepness=steepness,
        split=split,
    )


def _count(name: str, where: str, value, default: int | None, top: int) -> int | None:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
        _fail(name, where, f"must be an integer from 1 to {top}, got {value!r}")
    return value


def parse(name: str, text: str) -> Suite:
    """A suite card's text -> Suite; ValueError naming the suite and the field for anything wrong."""
    try:
        d = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        _fail(name, "TOML", str(err))
    return from_dict(name, d)


def from_dict(name: str, d: dict) -> Suite:
    """A card as a table (a parsed TOML file's, or a generated one's) -> Suite, every field checked (ValueError
    naming the suite and the field)."""
    if unknown := sorted(set(d) - CARD_FIELDS):
        _fail(name, unknown[0], f"unknown field; valid: {', '.join(sorted(CARD_FIELDS))}")
    for key in ("description", "bounds", "source", "task"):
        if key not in d:
            _fail(name, key, "missing")
    bounds = d["bounds"]
    if not (isinstance(bounds, list) and len(bounds) == 2):
        _fail(name, "bounds", f"must be [[lo1, hi1], [lo2, hi2]], got {bounds!r}")
    bounds = tuple(_pair(name, "bounds", b) for b in bounds)
    if any(lo >= hi for lo, hi in bounds):
        _fail(name, "bounds", f"each lower bound must be below its upper bound, got {bounds}")
    tasks = d["task"]
    if not isinstance(tasks, list) or not 2 <= len(tasks) <= MAX_TASKS:
        _fail(
            name,
            "task",
            f"needs from 2 to {MAX_TASKS} [[task]] tables, got {0 if not isinstance(tasks, list) else len(tasks)}",
        )
    parsed = tuple(_task(name, f"task[{i}]", t) for i, t in enumerate(tasks))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        _fail(name, "task", f"task names must differ, got {names}")
    held = [t for t in parsed if t.split in HELD_OUT_SPLITS]
    if len(held) == len(parsed):
        _fail(name, "task", "every task is held out (split interpolation or extrapolation): none is left to train")
    suite = Suite(
        name=name,
        description=_text(name, "description", d["description"]),
        bounds=bounds,
        source=_task(name, "source", d["source"], source=True),
        tasks=parsed,
        train_per_task=_count(name, "train_per_task", d.get("train_per_task"), zoo.TARGET_TRAIN, MAX_SAMPLES),
        test_per_task=_count(
            name, "test_per_task", d.get("test_per_task"), zoo.TARGET_SIZE - zoo.TARGET_TRAIN, MAX_SAMPLES
        ),
        stages=_count(name, "stages", d.get("stages"), None, MAX_TASKS),
    )
    if suite.stages is not None and suite.stages > len(parsed) - len(suite.held_out):
        _fail(
            name,
            "stages",
            f"{suite.stages} stages need as many trained tasks; the card trains {len(parsed) - len(suite.held_out)}",
        )
    return suite


def card_config(suite: Suite) -> dict:
    """The card as a record's config holds it: every field, except that the fields added for the parametric suites
    (shift, steepness, split; train_per_task, test_per_task, stages) are left out where they hold their defaults,
    so that a card without them keeps the config hash its records were written under."""
    d = dataclasses.asdict(suite)
    for key, default in CARD_DEFAULTS.items():
        if d[key] == default:
            del d[key]
    for task in (d["source"], *d["tasks"]):
        for key, default in TASK_DEFAULTS.items():
            if task[key] == default:
                del task[key]
    return d


def cards(name: str) -> dict[str, str]:
    """The versions of the cards the suite `name`'s data is made from, as records and backbone files hold them
    (zoo.card_digest): its own card's (as card_config holds it) under "suite <name>", and each function card its
    source and tasks use under the function's name."""
    suite = get(name)
    used = sorted({t.function for t in (suite.source, *suite.tasks)})
    return {f"suite {name}": stable_hash(card_config(suite))} | {f: zoo.card_digest(f) for f in used}


@functools.cache
def _cards() -> dict[str, Suite]:
    out = {}
    for p in files("qlbench.functions.suites").iterdir():
        if p.name.endswith(".toml"):
            name = p.name.removesuffix(".toml")
            out[name] = parse(name, p.read_text(encoding="utf-8"))
    return out


def control(suite: Suite) -> Suite:
    """The same tasks, every one given SAME_INSTRUCTION (and it as every paraphrase)."""
    same = tuple(replace(t, instruction=SAME_INSTRUCTION, paraphrases=(SAME_INSTRUCTION,) * 2) for t in suite.tasks)
    return replace(suite, name=suite.name + CONTROL_SUFFIX, tasks=same)


def card_names() -> list[str]:
    """The suites of the card files: each card, sorted, followed by its same-instruction control."""
    return [n for card in sorted(_cards()) for n in (card, card + CONTROL_SUFFIX)]


def names() -> list[str]:
    """Every suite: card_names, then the parametric suites (parametric.py; no same-instruction control: the
    held-out experiment's controls are its rows' instruction sources, task-code and the shuffled sentences)."""
    return [*card_names(), *parametric.names()]


@functools.cache
def _parametric(name: str) -> Suite:
    return from_dict(name, parametric.card(name))


def get(name: str) -> Suite:
    """The suite `name` (a card, a card's `-same-instruction` control, or a parametric suite); ValueError listing
    the valid names."""
    if name in parametric.names():
        return _parametric(name)
    cards = _cards()
    card = base_name(name)
    if card not in cards:
        raise ValueError(f"unknown suite {name!r}; valid: {', '.join(names())}")
    return cards[card] if card == name else control(cards[card])
