"""The method registry: a method name -> the `Method` that builds and optimises it (one file per method).

    from qlbench import adapters
    method = adapters.get("queryable")
    config = method.make_config(top_k=3)            # validated in the config's __post_init__
    model = method.build(backbone, config, generators, y_train)

A new method is a file with a `Method` (or `AdapterMethod`) and one `register(...)` line below. Its `kind`
(base.KINDS: full, static, task, routed, reference) is how statistics, reports, diagnostics and the benchmark group it:
`of_kind("static")` lists the static adapters in registry order, which is also the tables' column order.
"""

from __future__ import annotations

from qlbench.adapters import (
    dora,
    doran,
    full,
    hyra,
    instruct,
    lily,
    lora,
    lora_matched,
    lora_per_task,
    moe_lora,
    poly,
    queryable,
    reference,
    replora,
    share_lora,
    task_lora,
    text_lora,
    vblora,
)
from qlbench.adapters.base import (
    EPS,
    KINDS,
    AdapterMethod,
    Method,
    NoConfig,
    inject,
    total_parameter_count,
    trainable_parameter_count,
)

REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add a method under its name; a name can be registered once, and its kind must be one of KINDS (ValueError
    otherwise)."""
    if method.name in REGISTRY:
        raise ValueError(f"method {method.name!r} is already registered")
    kind = getattr(method, "kind", None)
    if kind not in KINDS:
        raise ValueError(f"method {method.name!r} has kind {kind!r}; valid: {', '.join(KINDS)}")
    REGISTRY[method.name] = method
    return method


for _method in (
    full.FULL_SOAP,
    full.FULL_ADAMW,
    lora.METHOD,
    lora_matched.MatchedLora(REGISTRY),
    dora.METHOD,
    hyra.METHOD,
    replora.METHOD,
    doran.METHOD,
    vblora.METHOD,
    share_lora.METHOD,
    lora_per_task.METHOD,
    task_lora.METHOD,
    poly.METHOD,
    text_lora.METHOD,
    moe_lora.METHOD,
    lily.METHOD,
    queryable.METHOD,
    instruct.METHOD,
    reference.FROZEN,
    reference.MEAN,
):
    register(_method)

# The method every other is compared with by default (statistics, tables, suites, diagnostics): plain LoRA.
BASELINE = lora.METHOD.name

# Baselines that are not in the paper's comparison: they separate sharing from routing (docs/methods.md) and run
# when named (`--methods vb-lora`).
EXTRA_BASELINES = (vblora.NAME, share_lora.NAME, moe_lora.NAME, lily.NAME)

# `qlbench run` default: the paper's comparison (SOAP is its full fine-tuning) plus the honest reference rows; the
# task-conditioned methods only mean something in a multi-task suite (`qlbench suite`).
DEFAULT_METHODS = tuple(
    name
    for name, m in REGISTRY.items()
    if name != full.FULL_ADAMW.name and m.kind != "task" and name not in EXTRA_BASELINES
)


def names() -> list[str]:
    return list(REGISTRY)


def of_kind(kind: str) -> tuple[str, ...]:
    """The registered methods of one kind (base.KINDS), in registry order; ValueError for an unknown kind."""
    if kind not in KINDS:
        raise ValueError(f"unknown method kind {kind!r}; valid: {', '.join(KINDS)}")
    return tuple(name for name, m in REGISTRY.items() if m.kind == kind)


def of_family(family: str) -> tuple[str, ...]:
    """The registered adapters that share a family's layers (e.g. "queryable": queryable, instruct-queryable), in
    registry order."""
    return tuple(name for name, m in REGISTRY.items() if getattr(m, "family", None) == family)


def kind_of(name: str) -> str | None:
    """The kind of a registered method; None for a name the registry does not know (e.g. in an old record)."""
    return REGISTRY[name].kind if name in REGISTRY else None


def get(name: str) -> Method:
    """The registered method, or a ValueError naming the valid choices."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; valid: {', '.join(REGISTRY)}") from None


__all__ = [
    "AdapterMethod",
    "BASELINE",
    "EPS",
    "KINDS",
    "Method",
    "NoConfig",
    "REGISTRY",
    "DEFAULT_METHODS",
    "EXTRA_BASELINES",
    "get",
    "inject",
    "kind_of",
    "names",
    "of_family",
    "of_kind",
    "register",
    "total_parameter_count",
    "trainable_parameter_count",
]
