"""Every tuner of the installed peft as a method: `peft:<type>` (peft:lora, peft:loha, peft:vera, ...).

Each member's backbone is wrapped by peft itself (`get_peft_model` on one plain member, member.py), with the
backbone's adapter targets as `target_modules`, and the members are trained as one stack (stacked by vmap, or
looped where vmap cannot run the tuner). The method's config is the peft config's own fields with simple values
(numbers, strings, booleans, lists; `--hp key=value`, checked against the field's type and by peft's own
validation), plus qlbench's `targets` and the installed `peft_version`, so a record names the peft that made it.

qlbench interpretation, where peft's default cannot be built on the zoo's backbones (a 32-wide deep-narrow layer):
`QLBENCH_DEFAULTS` (documented in docs/methods.md). Tuners that cannot run here are refused in one line with the
reason (`REFUSED`), never run half-way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import math
import re
import warnings

import torch

from qlbench.adapters.base import check_targets
from qlbench.adapters.member import MemberMethod
from qlbench.stacked import uniform_members

PREFIX = "peft:"

# Fields qlbench sets: where the tuner goes (the backbone's targets) and what peft needs for a transformers model.
RESERVED = (
    "target_modules",
    "exclude_modules",
    "target_parameters",
    "modules_to_save",
    "layers_to_transform",
    "layers_pattern",
    "task_type",
    "peft_type",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "auto_mapping",
    "feedforward_modules",
)

# peft's defaults are sized for language models; these fit a 32-wide layer and the Transformer's 256 and 1024.
QLBENCH_DEFAULTS = {
    "c3a": {"block_size": 32},  # peft: 256, which must divide the layer's input size
    "miss": {"r": 8},  # peft: 64, more than a 32-wide layer's rank
    "road": {"group_size": 32},  # peft: 64, which must divide the output size
    "shira": {"r": 8},  # peft: 32, more entries than a 32 x 32 layer holds
    "waveft": {"n_frequency": 256},  # peft: 2592, more than a 32 x 32 layer's 1024 entries
    "vblora": {"vector_length": 32},  # peft: 256, which must divide the layer's input size
    "ia3": {"feedforward_modules": []},
    # qlbench's `lora` scale, alpha / r = 16 / 8 (peft: alpha 8, scale 1): peft:lora is then lora, seed for seed
    # (its A also starts from lora's draws: PeftMethod.build), so the pair is an A/A check, not two methods
    "lora": {"lora_alpha": 16},
    # peft: a random spectrum (scaled by 150) at the start, whose update makes the 32-layer MLP's output infinite
    # before the first step; zeros start it at the pretrained model, as every other adapter starts
    "fourierft": {"init_weights": True},  # none is a feed-forward module: IA3 scales every target's output
}

_PROMPT = "prompt learning: it learns virtual tokens for a transformers language model; the zoo's backbones read "
_PROMPT += "two coordinates, not tokens"
REFUSED = {
    "adaption_prompt": _PROMPT,
    "cartridge": _PROMPT,
    "cpt": _PROMPT,
    "multitask_prompt_tuning": _PROMPT,
    "p_tuning": _PROMPT,
    "prefix_tuning": _PROMPT,
    "prompt_tuning": _PROMPT,
    "shadow": "needs a transformers model (it reads model.config)",
    "xlora": "needs a transformers model (it reads model.config) and trained LoRA adapters to mix",
    "trainable_tokens": "trains token embeddings; the zoo's backbones have none",
    "poly": "routes on the task_ids passed with every forward; qlbench's own `poly` is the suite method",
    "adalora": "needs update_and_allocate(step) after every optimiser step (its rank budget); without it AdaLoRA "
    "would train as a fixed-rank adapter, not as AdaLoRA",
    "adamss": "its parameter shapes depend on each member's weights (ranks chosen at init), so members cannot share "
    "one stacked layout",
}


def _peft():
    import peft  # imported on first use: `qlbench --help` and the other methods do not pay for it

    return peft


# qlbench's own tuner for transformers models (qlbench.hf registers it into peft once imported): on the zoo, its
# methods are `queryable` and `instruct-queryable`, so it is not listed among peft's tuners.
OWN = ("queryable_lora",)


def types() -> list[str]:
    """Every tuner type of the installed peft, lower case (peft.PeftType values), sorted; qlbench's own (OWN) left
    out, whether or not qlbench.hf has registered it in this process."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    return sorted(t.value.lower() for t in PEFT_TYPE_TO_CONFIG_MAPPING if t.value.lower() not in OWN)


def _peft_config_cls(kind: str):
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    return {t.value.lower(): c for t, c in PEFT_TYPE_TO_CONFIG_MAPPING.items()}[kind]


_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "Literal": (str,)}
_TYPES |= {"list": (list, tuple), "dict": (dict,), "None": (type(None),), "Optional": (type(None),)}


def _allowed(annotation) -> tuple[type, ...] | None:
    """The Python types a peft field's annotation admits, from its words (None: not checked)."""
    words = set(re.findall(r"[A-Za-z]+", str(annotation)))
    allowed = tuple(t for w in words & set(_TYPES) for t in _TYPES[w])
    return allowed or None


def _simple(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_simple(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _check(config) -> None:
    """Each field's type (from peft's annotation), then peft's own validation; ValueError in one line."""
    check_targets(config)
    installed = _peft().__version__
    if config.peft_version != installed:
        got = config.peft_version
        raise ValueError(f"peft_version is the installed peft's ({installed}), not a setting: got {got!r}")
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        if f.name in ("targets", "peft_version") or (allowed := f.metadata.get("allowed")) is None:
            continue
        if isinstance(v, bool) and bool not in allowed:
            raise ValueError(f"{f.name} must be {f.metadata['annotation']}, got {v!r}")
        if not isinstance(v, allowed):
            raise ValueError(f"{f.name} must be {f.metadata['annotation']}, got {v!r}")
        choices = re.findall(r"['\"]([^'\"]*)['\"]", f.metadata["annotation"].partition("Literal")[2])
        if isinstance(v, str) and choices and not re.search(r"\bstr\b", f.metadata["annotation"]) and v not in choices:
            raise ValueError(f"{f.name} must be one of {', '.join(choices)}, got {v!r}")
        if isinstance(v, list):
            setattr(config, f.name, tuple(v))
    try:
        to_peft(config, ["linear"])
    except (TypeError, ValueError) as err:
        raise ValueError(str(err).splitlines()[0]) from None


@functools.cache
def config_class(kind: str) -> type:
    """qlbench's config for peft tuner `kind`: the peft config's fields with simple defaults (lists as tuples),
    QLBENCH_DEFAULTS applied, plus `targets` and `peft_version`."""
    peft_cls, ours = _peft_config_cls(kind), QLBENCH_DEFAULTS.get(kind, {})
    fields = [("targets", "tuple[str, ...] | None", dataclasses.field(default=None))]
    for f in dataclasses.fields(peft_cls):
        if not f.init or f.name in RESERVED or f.name == "peft_version":
            continue
        default = ours.get(f.name, f.default if f.default is not dataclasses.MISSING else None)
        if f.default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            default = ours.get(f.name, f.default_factory())
        if not _simple(default):
            continue  # a dict or an object: not a setting qlbench passes through
        default = tuple(default) if isinstance(default, list) else default
        meta = {"allowed": _allowed(f.type), "annotation": str(f.type)}
        fields.append((f.name, f.type, dataclasses.field(default=default, metadata=meta)))
    fields.append(("peft_version", str, dataclasses.field(default=_peft().__version__)))
    name = "Peft" + "".join(w.title() for w in kind.split("_")) + "Config"
    namespace = {"__post_init__": _check, "__module__": __name__, "tuner": kind}
    return dataclasses.make_dataclass(name, fields, namespace=namespace)


def to_peft(config, target_modules: list[str]):
    """The peft config of a qlbench config, aimed at `target_modules`."""
    kind = type(config).tuner
    values = {
        f.name: list(v) if isinstance(v := getattr(config, f.name), tuple) else v
        for f in dataclasses.fields(config)
        if f.name not in ("targets", "peft_version")
    }
    reserved = {k: v for k, v in QLBENCH_DEFAULTS.get(kind, {}).items() if k in RESERVED}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _peft_config_cls(kind)(**values, **reserved, target_modules=list(target_modules))


class PeftMethod(MemberMethod):
    """peft's tuner `kind`, applied to each member by peft's own `get_peft_model`."""

    strip = "model."  # the tuner module holds the member as `.model`

    def __init__(self, kind: str):
        self.tuner = kind
        self.name, self.kind = PREFIX + kind, "static"
        self.summary = f"peft's {kind} tuner (peft {_peft().__version__}), through get_peft_model"
        self.config_cls = config_class(kind)
        self.stream = "lora" if kind == "lora" else None  # peft:lora draws lora's start (build): the same stream

    def rewrites(self):
        from qlbench.adapters import peft_rewrites

        return peft_rewrites.rewrites(self.tuner)

    def adapt_member(self, model, config, targets):
        # peft's warnings, and its own progress bars (frod's decomposition), would land in qlbench's output
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            return _peft().get_peft_model(model, to_peft(config, targets)).base_model

    def build(self, backbone, config, generators, y_train):
        """peft's tuner on every member (MemberMethod.build). peft:lora with peft's own init (init_lora_weights
        True) starts from qlbench's LoRA draws: each target's A (E, r, d_in) drawn as `lora` draws it, from the same
        generators in the same order, before anything else is drawn (peft's own kaiming-uniform A has the same
        distribution but comes from torch's global generator). So peft:lora and lora share their start per seed."""
        starts = None
        if self.tuner == "lora" and config.init_lora_weights is True:
            starts = {}
            for t in backbone.adapter_targets(config.targets):  # in forward order, as inject draws lora's
                d_in = backbone.get_submodule(t.path).d_in
                A = uniform_members((config.r, d_in), 1.0 / math.sqrt(d_in), generators)  # (E, r, d_in)
                starts[f"{t.path}.linear.lora_A.default.weight"] = A
        stack = super().build(backbone, config, generators, y_train)
        if starts and next(stack.parameters()).device.type != "meta":
            params = dict(stack.named_parameters())
            with torch.no_grad():
                for name, A in starts.items():
                    params[name].copy_(A)  # (E, r, d_in), cast to the stack's dtype and device
        return stack


INSTALL = "pip install 'qlbench[hf]'"


def method(name: str) -> PeftMethod:
    """The method `peft:<type>`; a ValueError naming the valid types, the reason a type is refused, or how to install
    peft where it is not."""
    kind = name.removeprefix(PREFIX)
    try:
        _peft()
    except ImportError:
        raise ValueError(f"{name} needs peft, which is not installed: {INSTALL}") from None
    valid = [t for t in types() if t not in REFUSED]
    if kind in REFUSED:
        raise ValueError(f"{name} is refused: {REFUSED[kind]}; runnable: {', '.join(PREFIX + t for t in valid)}")
    if kind not in types():
        raise ValueError(f"unknown peft tuner {kind!r} (peft {_peft().__version__}); valid: {', '.join(valid)}")
    return PeftMethod(kind)


def catalogue(archs: tuple[str, ...] = ("deep-narrow", "transformer"), progress=None) -> list[dict]:
    """One row per tuner of the installed peft: {"tuner", "status", "reason", <arch>: trainable count per member}.
    status: "stacked", "looped" or "refused" (the path on deep-narrow; reason: why a tuner loops or is refused).
    Each runnable tuner is built on one member of each backbone (float32, CPU, untrained); `progress(1)`, if given,
    is called as each tuner's row is done."""
    from qlbench.backbones import build_backbone
    from qlbench.seeding import generator

    rows = []
    for kind in types():
        if rows and progress is not None:
            progress(1)
        row = {"tuner": PREFIX + kind}
        if kind in REFUSED:
            rows.append(row | {"status": "refused", "reason": REFUSED[kind]})
            continue
        m = method(PREFIX + kind)
        for arch in archs:
            backbone = build_backbone(arch, [("catalogue", 0)], init="kaiming" if arch == "deep-narrow" else "default")
            model = m.build(backbone, m.make_config(), [generator("catalogue", kind)], torch.zeros(1, 1))
            row[arch] = sum(p[0].numel() for p in model.parameters() if p.requires_grad)
            if arch == archs[0]:
                status, _, why = model.path.partition(": ")
                row |= {"status": status, "reason": why}
        rows.append(row)
    if rows and progress is not None:
        progress(1)
    return rows
