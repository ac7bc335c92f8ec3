"""Named, versioned benchmark protocols: the fixed settings under which committed baselines were measured, so that a
method run elsewhere can be compared with them (`qlbench compare`, docs/results/baselines/).

A protocol fixes everything that changes the numbers apart from the method: the backbone and its init, the budget
(epochs, learning rates, batch size, evaluation cadence), the functions, the seeds, the dtype, the optimiser's eps and
the label noise; and the version of each function's card (`cards`, zoo.card_digest), since a card holds the data's
coefficients. A record is under a protocol when its config says so, field by field, and the cards it records are the
protocol's (`differences`; a record written before records held their cards is taken on its config); its seeds may
be a subset of the protocol's (pairs are made by function and seed).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from qlbench import adapters, zoo
from qlbench.engine.budgets import budget as engine_budget


@dataclass(frozen=True)
class Benchmark:
    """A published benchmark protocol (zoo-v1, zoo-v2): what `--protocol NAME` names. Not settings.Protocol, the run
    settings a plan takes, which a benchmark fixes most of (`run_settings`)."""

    name: str
    arch: str
    budget: str
    backbone_init: str
    functions: tuple[str, ...]
    seeds: tuple[int, ...]
    dtype: str = "float32"
    eps: float = adapters.EPS
    noise: str = zoo.DEFAULT_NOISE
    cards: tuple[tuple[str, str], ...] = ()  # (function, zoo.card_digest) of the cards its baselines were made from
    # the digest of its shipped backbones' manifest (instances.py: docs/protocols/<name>/); "" ships none
    backbones: str = ""
    # the protocol whose shipped backbones it runs on ("": its own, docs/protocols/<name>/); a protocol on the same
    # arch, pretraining and init as another reuses its artifact instead of shipping a copy
    backbones_from: str = ""
    # the learning-rate grid every method is tried at, the same trials for each, the rate chosen per method on the
    # targets' validation sets (metrics/board.py, tuned); (): the budget's one rate, no choice
    lrs: tuple[float, ...] = ()

    @property
    def instances(self) -> str:
        """The name of the folder its backbones are shipped in (instances.folder)."""
        return self.backbones_from or self.name

    def run_settings(self) -> dict:
        """The run options the protocol fixes, by their parsed attribute (commands.options): a run under the protocol
        takes these and refuses an option that contradicts one."""
        return {
            "arch": self.arch,
            "budget": self.budget,
            "backbone_init": self.backbone_init,
            "dtype": self.dtype,
            "eps": self.eps,
            "noise": self.noise,
            "validation": bool(self.lrs),
        }

    def lr_rule(self) -> str:
        """One sentence for a page: the learning rate each method trains at under the protocol."""
        fixed = self.budget_fields()["adapt"]["lr"]
        if not self.lrs:
            return f"lr: every method trains at the budget's fixed learning rate {fixed:g} (no grid in this protocol)."
        return (
            f"lr: the rate chosen for the method from the grid {', '.join(f'{x:g}' for x in self.lrs)} (every method "
            "tried at every rate, the same trials for all) on the targets' validation sets: fewest divergences, then "
            "the lowest mean log validation MSE, never the test set; its row shows its records at that rate."
        )

    def budget_fields(self) -> dict:
        """The budget's epochs, learning rates, batch size and cadence, as a record's config holds them (less the
        seed count, which the protocol's seeds give)."""
        return {k: v for k, v in dataclasses.asdict(engine_budget(self.budget, self.arch)).items() if k != "seeds"}

    def differences(self, config: dict, cards: dict[str, str] | None = None) -> list[str]:
        """What in a record's config (run_info.config) and the card versions it was made from (run_info.settings.
        cards; None: not recorded) differs from the protocol, one phrase each; [] when the record is under it."""
        out = []
        if changed := [f for f, d in self.cards if f in (cards or {}) and cards[f] != d]:
            out.append(f"another version of card {', '.join(changed)} than the protocol's")
        want = {"arch": self.arch, "dtype": self.dtype}
        out += [f"{k} {config.get(k)!r} (protocol: {v!r})" for k, v in want.items() if config.get(k) != v]
        init = config.get("backbone_init", "default")  # a default-init config has no key
        if init != self.backbone_init:
            out.append(f"backbone init {init!r} (protocol: {self.backbone_init!r})")
        if config.get("eps", adapters.EPS) != self.eps:
            out.append(f"eps {config.get('eps')!r} (protocol: {self.eps!r})")
        noise = config.get("noise", zoo.LEGACY_NOISE)  # a config without the key was made with the legacy noise
        if noise != self.noise:
            out.append(f"label noise {noise!r} (protocol: {self.noise!r})")
        if config.get("function") not in self.functions:
            out.append(f"function {config.get('function')!r} (protocol: {', '.join(self.functions)})")
        if extra := sorted(set(config.get("seeds", [])) - set(self.seeds)):
            out.append(f"seeds {extra} outside the protocol's {self.seeds[0]}-{self.seeds[-1]}")
        if config.get("validation", False) != bool(self.lrs):
            out.append("no validation set" if self.lrs else "a validation set (protocol: none)")
        got = {k: v for k, v in (config.get("budget") or {}).items() if k != "seeds"}
        want = self.budget_fields()
        if self.lrs and isinstance(got.get("adapt"), dict) and got["adapt"].get("lr") in self.lrs:
            want["adapt"] = want["adapt"] | {"lr": got["adapt"]["lr"]}  # any rate of the grid
        if got != want:
            name = got.get("name", "?")
            out.append(f"budget {name!r} with other settings" if name == self.budget else f"budget {name!r}")
        return out


ZOO_V1 = Benchmark(
    name="zoo-v1",
    arch="deep-narrow",
    budget="quick",
    backbone_init="kaiming",
    # written out, not zoo.names(): a card added to functions/ later must not change a published protocol
    functions=(
        "ackley",
        "dropwave",
        "langermann",
        "levy",
        "matyas",
        "michalewicz",
        "rastrigin",
        "sin-cos",
        "styblinski-tang",
    ),
    seeds=tuple(range(10)),
    cards=(
        ("ackley", "adfbe182bb86427f"),
        ("dropwave", "942f12dec268207d"),
        ("langermann", "d5e6564af012207f"),
        ("levy", "32eac97a67feb63f"),
        ("matyas", "69fecdc98454fee3"),
        ("michalewicz", "cdb7d3ef8ab510f2"),
        ("rastrigin", "b6df603b03f8e74a"),
        ("sin-cos", "5fc69d5e5da26d06"),
        ("styblinski-tang", "21e435d57ba6c7d0"),
    ),
    backbones="e854f947bbc9e3fb",
)
# zoo-v2: the 24 tasks the item analysis keeps (docs/results/items/candidates, verdict "keep"), with each one's reasons
# in docs/protocols/zoo-v2/README.md: Ackley, Levy, Matyas, Sin-Cos and Styblinski-Tang at their own shift and at 2, 3
# and 4 times it, Michalewicz at 1, 2 and 4 times (x3: reliability 0.67), and Rastrigin at 4 times (the one strength
# where adapting beats the frozen backbone by 1.5x); Drop-Wave and Langermann are out. Each method at its best rate of
# one grid, chosen on the targets' validation sets. 5 seeds: by the power analysis, more seeds buy almost nothing,
# since the spread between tasks dominates. Its backbones are zoo-v1's (same arch, pretraining and init; a variant's
# source is its card's).
_ZOO_V2_CARDS = ("ackley", "levy", "matyas", "michalewicz", "rastrigin", "sin-cos", "styblinski-tang")
_ZOO_V2_DROPPED = ("michalewicz@s3", "rastrigin", "rastrigin@s2", "rastrigin@s3")
ZOO_V2 = Benchmark(
    name="zoo-v2",
    arch="deep-narrow",
    budget="quick",
    backbone_init="kaiming",
    # from literals, not zoo.names(): a card added to functions/ later must not change a published protocol
    functions=tuple(
        f"{c}{s}" for c in _ZOO_V2_CARDS for s in ("", "@s2", "@s3", "@s4") if f"{c}{s}" not in _ZOO_V2_DROPPED
    ),
    seeds=tuple(range(5)),
    cards=tuple((f, d) for f, d in ZOO_V1.cards if f in _ZOO_V2_CARDS),
    backbones=ZOO_V1.backbones,
    backbones_from=ZOO_V1.name,
    lrs=(1.5e-4, 5e-4, 1.5e-3, 5e-3),
)
PROTOCOLS = {p.name: p for p in (ZOO_V1, ZOO_V2)}


def get(name: str) -> Benchmark:
    """The protocol of a name; ValueError naming the valid ones."""
    try:
        return PROTOCOLS[name]
    except KeyError:
        raise ValueError(f"unknown protocol {name!r}; valid: {', '.join(PROTOCOLS)}") from None


def of_config(config: dict, cards: dict[str, str] | None = None) -> str | None:
    """The name of the protocol a record's config and card versions are under, or None."""
    return next((p.name for p in PROTOCOLS.values() if not p.differences(config, cards)), None)
