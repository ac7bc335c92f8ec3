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
    outside,
    peft_tuners,
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
from qlbench.adapters.member import MemberMethod, MemberStack

REGISTRY: dict[str, Method] = {}  # qlbench's own methods, in table order
LOADED: dict[str, Method] = {}  # methods from outside the registry, once `get` has loaded them (never in REGISTRY,
# so that the tables, kinds and defaults of qlbench's own methods do not depend on what a process loaded before)


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
    """The kind of a method (`get`'s names); None for a name no method answers to (e.g. in an old record)."""
    try:
        return get(name).kind
    except ValueError:
        return None


def get(name: str) -> Method:
    """The method called `name`, registered on first use when it comes from outside the registry: `peft:<type>`
    (peft's tuner, peft_tuners.py), `package.module:NAME` (outside.py; registered under the method's own name, which
    `canonical` returns) or an installed package's `qlbench.methods` entry point. A ValueError in one line names
    what is wrong and the valid choices."""
    if name in REGISTRY or name in LOADED:
        return REGISTRY.get(name) or LOADED[name]
    if name.startswith(peft_tuners.PREFIX):
        method = peft_tuners.method(name)
    elif outside.is_spec(name):
        method = outside.load(name)
    elif (method := outside.from_entry_point(name)) is None:
        raise ValueError(
            f"unknown method {name!r}; valid: {', '.join(REGISTRY)}; also peft:<type> (qlbench methods --peft "
            "lists them), package.module:NAME or an installed qlbench.methods entry point (docs/extending.md)"
        )
    known = REGISTRY.get(method.name) or LOADED.get(method.name)
    if known is not None and known is not method:
        raise ValueError(f"method {name!r} is called {method.name!r}, which clashes with another method of that name")
    if getattr(method, "kind", None) not in KINDS:
        raise ValueError(f"method {name!r} has kind {getattr(method, 'kind', None)!r}; valid: {', '.join(KINDS)}")
    LOADED[method.name] = method
    if name != method.name:
        LOADED[name] = method  # package.module:NAME answers too
    return method


def canonical(name: str) -> str:
    """The name a method's records carry: its own `name` (for package.module:NAME, the method's name; for
    everything else, `name` itself); a ValueError as `get`'s."""
    return get(name).name


__all__ = [
    "AdapterMethod",
    "BASELINE",
    "EPS",
    "KINDS",
    "MemberMethod",
    "MemberStack",
    "Method",
    "NoConfig",
    "REGISTRY",
    "DEFAULT_METHODS",
    "EXTRA_BASELINES",
    "LOADED",
    "canonical",
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
