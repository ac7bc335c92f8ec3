"""The method registry: a method name -> the `Method` that builds and optimises it (one file per method).

    from qlbench import adapters
    method = adapters.get("queryable")
    config = method.make_config(top_k=3)            # validated in the config's __post_init__
    model = method.build(backbone, config, generators, y_train)

A new method is a file with a `Method` (or `AdapterMethod`) and one `register(...)` line below.
"""

from __future__ import annotations

from qlbench.adapters import dora, doran, full, hyra, instruct, lora, queryable, reference, replora
from qlbench.adapters.base import (
    AdapterMethod,
    Method,
    NoConfig,
    inject,
    total_parameter_count,
    trainable_parameter_count,
)

REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add a method under its name; a name can be registered once (ValueError otherwise)."""
    if method.name in REGISTRY:
        raise ValueError(f"method {method.name!r} is already registered")
    REGISTRY[method.name] = method
    return method


for _method in (
    full.FULL_SOAP,
    full.FULL_ADAMW,
    lora.METHOD,
    dora.METHOD,
    replora.METHOD,
    hyra.METHOD,
    doran.METHOD,
    queryable.METHOD,
    instruct.METHOD,
    reference.FROZEN,
    reference.MEAN,
):
    register(_method)

# `qlbench run` default: the paper's comparison plus the honest reference rows.
DEFAULT_METHODS = (
    "full-soap",
    "lora",
    "dora",
    "hyra",
    "replora",
    "doran",
    "queryable",
    "instruct-queryable",
    "frozen",
    "mean",
)


def names() -> list[str]:
    return list(REGISTRY)


def get(name: str) -> Method:
    """The registered method, or a ValueError naming the valid choices."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; valid: {', '.join(REGISTRY)}") from None


__all__ = [
    "AdapterMethod",
    "Method",
    "NoConfig",
    "REGISTRY",
    "DEFAULT_METHODS",
    "get",
    "inject",
    "names",
    "register",
    "total_parameter_count",
    "trainable_parameter_count",
]
