"""The registry declares each method's kind, and every grouping of methods (statistics, diagnostics, verify, the
tables' column order) comes from it."""

from __future__ import annotations

import pandas as pd
import pytest

from qlbench import adapters, diagnostics, verify
from qlbench.adapters.base import KINDS, Method
from qlbench.metrics import stats


def test_kinds_as_the_paper_groups_the_methods():
    # Written out here on purpose: a method registered under the wrong kind would silently move between a
    # table's groups (a routed adapter ranked as a static baseline, a reference row ranked at all).
    assert adapters.of_kind("full") == ("full-soap", "full-adamw")
    assert adapters.of_kind("static") == (
        "lora", "lora-matched", "dora", "hyra", "replora", "doran", "vb-lora", "share-lora"
    )  # fmt: skip
    assert adapters.of_kind("task") == ("lora-per-task", "task-lora", "poly", "text-lora")
    assert adapters.of_kind("routed") == ("moe-lora", "lily", "queryable", "instruct-queryable")
    assert adapters.of_kind("reference") == ("frozen", "mean")
    assert all(not adapters.get(m).trains for m in adapters.of_kind("reference"))


def test_every_method_has_exactly_one_kind_and_the_order_covers_them():
    assert sorted(stats.ORDER) == sorted(adapters.names())
    assert list(stats.ORDER) == adapters.names()  # registry order is the tables' column order
    assert {adapters.kind_of(m) for m in adapters.names()} == set(KINDS)
    assert adapters.kind_of("no-such-method") is None


def test_groups_elsewhere_derive_from_the_kinds():
    assert stats.STATIC == adapters.of_kind("static")
    assert stats.REFERENCE == adapters.of_kind("reference")
    # the route maps and the theorems are about routing over shared atoms: the queryable family, not every router
    assert (
        diagnostics.ROUTED == verify.METHODS == adapters.of_family("queryable") == ("queryable", "instruct-queryable")
    )
    assert diagnostics.GRADIENT_METHODS == ("lora", *adapters.of_family("queryable"))
    assert stats.TASK == adapters.of_kind("task")
    # a single-task run's default: the paper's comparison and the reference rows (not full AdamW, not the
    # task-conditioned methods, which mean something in suites only, not qlbench's extra baselines)
    assert adapters.EXTRA_BASELINES == ("vb-lora", "share-lora", "moe-lora", "lily")
    assert adapters.DEFAULT_METHODS == tuple(
        m
        for m in adapters.names()
        if m != "full-adamw" and adapters.kind_of(m) != "task" and m not in adapters.EXTRA_BASELINES
    )


def test_a_method_without_a_known_kind_is_refused():
    class Nameless(Method):
        name, summary, kind = "nameless", "no such kind", "magic"

    with pytest.raises(ValueError, match="kind 'magic'; valid: full, static, task, routed, reference"):
        adapters.register(Nameless())
    with pytest.raises(ValueError, match="unknown method kind 'magic'"):
        adapters.of_kind("magic")
    assert "nameless" not in adapters.REGISTRY


def test_kind_decides_how_a_table_treats_a_method():
    """is_full and is_adapter read the kind: full fine-tuning and reference rows are never 'adapters'; an old
    record's unregistered full-* name is still full fine-tuning."""
    assert stats.is_full("full-soap") and stats.is_full("full-sgd-from-an-old-record")
    assert not stats.is_adapter("full-adamw") and not stats.is_adapter("mean")
    assert all(stats.is_adapter(m) for m in (*adapters.of_kind("static"), *adapters.of_kind("routed")))
    order = stats.method_order(pd.Series(["mean", "queryable", "zzz-unknown", "lora", "full-soap", "frozen"]))
    assert order == ["full-soap", "lora", "queryable", "zzz-unknown", "frozen", "mean"]
