"""The backbone cache: source-pretrained stacks, one file per member, keyed by everything the weights depend on."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from qlbench import suites, zoo
from qlbench.adapters.base import adamw
from qlbench.backbones import DEFAULT_INIT, build_backbone
from qlbench.engine.budgets import Phase
from qlbench.engine.loop import Stage, fit
from qlbench.engine.runtime import flush_denormals
from qlbench.engine.stack import Member, Pretrained, StackedData, padded
from qlbench.instances import digest
from qlbench.records import record
from qlbench.records.store import DamagedFile, Store, load_torch, save_torch, set_aside, stable_hash
from qlbench.seeding import generator

SOURCES = ("function", "suite")


@dataclass(frozen=True)
class Backbones:
    """What a stack of source-pretrained backbones is, besides its members: everything their weights depend on,
    which keys the cache. `source`: "function" (members are (zoo function, seed), trained on the function's source
    data with labels noised by `noise`, zoo.NOISES) or "suite" (members are (suite card, seed), trained on the suite's
    standardised source, suites.py); `init`: the backbone initialisation (backbones.INITS)."""

    arch: str
    phase: Phase
    dtype: torch.dtype = torch.float32
    init: str = DEFAULT_INIT
    noise: str = zoo.DEFAULT_NOISE
    source: str = "function"

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"unknown backbone source {self.source!r}; valid: {', '.join(SOURCES)}")

    def paths(self, members: list[Member], store: Store | None) -> list[Path | None]:
        """Cache files keyed by everything the weights depend on; a non-default backbone init and a label noise
        other than the legacy one join the key (so the caches written before either setting existed keep their
        keys); a suite's backbone is keyed as one."""
        if store is None:
            return [None] * len(members)
        return [store.backbone_path(self.arch, self._source(f), s, k) for (f, s), k in zip(members, self.keys(members))]

    def _source(self, name: str) -> str:
        """The name a member's source is made from: a zoo task variant's card (zoo.split_name), else the name."""
        return name if self.source == "suite" else zoo.card_name(name)

    def keys(self, members: list[Member]) -> list[str]:
        """Each member's cache key: the hash of everything its weights depend on (it names the file, and the file
        holds it, so a file copied over another member's is found out)."""
        extra = {} if self.init == DEFAULT_INIT else {"init": self.init}
        extra |= {} if self.noise == zoo.LEGACY_NOISE else {"noise": self.noise}
        extra |= {"suite_source": True} if self.source == "suite" else {}
        key = dict(arch=self.arch, phase=asdict(self.phase), dtype=str(self.dtype))
        return [stable_hash(dict(arch=self.arch, function=self._source(f), seed=s) | key | extra) for f, s in members]

    def cards(self, member: Member) -> dict[str, str]:
        """The versions of the cards a member's source data is made from (zoo.card_digest, suites.cards): its file
        holds them, and a file made from another version is retrained (`_read_backbone`)."""
        name = self._source(member[0])
        return suites.cards(name) if self.source == "suite" else {name: zoo.card_digest(name)}

    def needed(self, members: list[Member], store: Store | None) -> bool:
        """Whether `pretrain` will train anything (some member is not in the cache)."""
        return any(p is None or not p.exists() for p in self.paths(members, store))

    def source_data(self, members: list[Member], *, device) -> StackedData:
        """The members' source training and test data."""
        if self.source == "suite":
            return StackedData.stack(
                [suites.get(n).source_data(s, dtype=self.dtype, device=device) for n, s in members]
            )
        return StackedData.build(members, "source", device=device, dtype=self.dtype, noise=self.noise)


@functools.cache
def _member_shapes(arch: str) -> dict[str, tuple[int, ...]]:
    """One member's weight names and shapes, from a shapes-only build on the meta device (they do not depend on
    the init), computed once per arch."""
    meta = build_backbone(arch, [("shape", 0)], device="meta").state_dict()
    return {k: tuple(v.shape[1:]) for k, v in meta.items()}


def _read_backbone(path: Path, arch: str, key: str, cards: dict[str, str]) -> dict:
    """A cached member, checked by content: DamagedFile (one line) unless it holds this member's cache key (a file
    without one, written before files held it, is retrained once), was made from the cards as they are now (`cards`;
    a file without them, written before files held them, is not checked), holds a state with exactly the backbone's
    weight names and per-member shapes (from a shapes-only build on the meta device), finite weights, and its two
    source MSEs as numbers."""
    saved = load_torch(path)
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
        raise DamagedFile(f"{path} is damaged (not a backbone file: no state)")
    if saved.get("key") != key:
        what = "no member key: written by an older qlbench" if "key" not in saved else "another member's weights"
        raise DamagedFile(f"{path} is damaged ({what})")
    if changed := record.card_changes(saved.get("cards"), cards):
        raise DamagedFile(f"{path} is out of date (pretrained on another version of {changed})")
    want = _member_shapes(arch)
    got = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in saved["state"].items()}
    if wrong := sorted(set(want) ^ set(got)) or [k for k in want if got[k] != want[k]]:
        raise DamagedFile(f"{path} is damaged ({wrong[0]}: not the {arch} backbone's weights)")
    if not all(isinstance(saved.get(k), float) for k in ("source_train_mse", "source_test_mse")):
        raise DamagedFile(f"{path} is damaged (no source MSEs)")
    if bad := [k for k, v in saved["state"].items() if v.is_floating_point() and not torch.isfinite(v).all()]:
        raise DamagedFile(f"{path} is damaged (non-finite weights in {bad[0]})")
    return saved


def install(spec: Backbones, members: list[Member], store: Store, shipped: dict, made_by: dict) -> list[Member]:
    """Write shipped backbones ({(card, seed): {state, source_train_mse, source_test_mse, cards, digest}}, a
    protocol's: instances.load; a task variant's member takes its card's) into the store's cache as `pretrain` would
    have written them, so that `pretrain` loads them and trains nothing; `made_by` is recorded as the file's git. A
    member already cached whose weights have another
    digest (pretrained by other code, or on a machine whose floating-point paths differ) is set aside and replaced;
    returns those members."""
    others = []
    for member, path, key in zip(members, spec.paths(members, store), spec.keys(members)):
        one = shipped[(spec._source(member[0]), member[1])]
        if path.exists():
            try:
                if digest(_read_backbone(path, spec.arch, key, spec.cards(member))["state"]) == one["digest"]:
                    continue
            except DamagedFile:
                pass
            others.append(member)
            set_aside(path)
        saved = {k: one[k] for k in ("state", "source_train_mse", "source_test_mse", "cards")}
        save_torch(saved | {"key": key, "git": made_by}, path)
    return others


@flush_denormals()
def pretrain(
    spec: Backbones,
    members: list[Member],
    *,
    device,
    store: Store | None = None,
    progress: Callable[[int], None] | None = None,
    compile: bool = False,
    capture: bool = False,
    log: Callable[[str], None] = lambda message: None,
) -> Pretrained:
    """Source-pretrained backbones `spec` for `members`. Members found in the store's backbone cache are loaded; the
    rest are trained together and cached one file per member, so any later stacking of the same members reuses
    them. A damaged cache file is reported through `log`, set aside and retrained. `compile`, `capture`: how the
    training step runs (engine.fit)."""
    arch, phase, dtype = spec.arch, spec.phase, spec.dtype
    paths, keys = spec.paths(members, store), spec.keys(members)
    cached = {}
    for i, path in enumerate(paths):
        if path is not None and path.exists():
            try:
                cached[i] = _read_backbone(path, arch, keys[i], spec.cards(members[i]))
            except DamagedFile as err:
                log(f"{err}; {set_aside(path)}, retraining that backbone")
    todo = [i for i in range(len(members)) if i not in cached]
    if todo:
        sub = padded([members[i] for i in todo])  # trained as a stack of at least MIN_STACK
        model = build_backbone(arch, sub, device=device, dtype=dtype, init=spec.init)
        data = spec.source_data(sub, device=device)
        order = [generator("order", "pretrain", arch, f, s) for f, s in sub]
        optimizer = lambda: adamw(model.parameters(), phase.lr, phase.weight_decay)
        stage = Stage(data, phase, optimizer, order, phase.epochs)
        (curves,) = fit(model, [stage], progress=progress, compile=compile, capture=capture)
        state = model.state_dict()
        for j, i in enumerate(todo):
            cached[i] = dict(
                key=keys[i],
                cards=spec.cards(members[i]),
                state={k: v[j].detach().cpu().clone() for k, v in state.items()},
                source_train_mse=curves.train_mse[j, -1].item(),
                source_test_mse=curves.test_mse[j, -1].item(),
                git=record.git_info(),  # which code trained it (the cache key does not say)
            )
            if paths[i] is not None:
                save_torch(cached[i], paths[i])
    state = {k: torch.stack([cached[i]["state"][k] for i in range(len(members))]) for k in cached[0]["state"]}
    return Pretrained(
        arch,
        list(members),
        state,
        [cached[i]["source_train_mse"] for i in range(len(members))],
        [cached[i]["source_test_mse"] for i in range(len(members))],
        [cached[i].get("git") for i in range(len(members))],
    )
