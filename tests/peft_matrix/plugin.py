"""A pytest plugin that adds Queryable LoRA to peft's own generic custom-model tests (test_custom_models.py in the
tests folder of peft's sdist, run unmodified): `pytest -p plugin <that folder>/test_custom_models.py`.

peft's TestPeftCustomModel parametrizes every test over the module-level list TEST_CASES (name, model, config class,
config kwargs). The plugin extends that list, in place, when pytest has imported the module and before it expands
the parameters, with QUERYABLE_CASES: the same tiny models peft's LoRA cases use, with LoRA's target modules. Tests
of merging are skipped by name: Queryable LoRA's update depends on its input through the route, so no fixed weight
equals it and merging is refused (docs/hf.md). Run by tests/test_peft_matrix.py (`make test-peft-matrix`).
"""

from __future__ import annotations

import pytest

from qlbench.hf import QueryableLoraConfig  # importing qlbench.hf registers the tuner with peft

SIZES = {"r": 4, "n_atoms": 4, "top_k": 2, "d_k": 8}

# the models and targets of peft's own LoRA cases on linear and Conv1D layers (MLP: lin0, lin1; EmbConv1D: conv1d)
QUERYABLE_CASES = [
    ("Vanilla MLP 1 Queryable LoRA", "MLP", QueryableLoraConfig, {"target_modules": "lin0"} | SIZES),
    ("Vanilla MLP 2 Queryable LoRA", "MLP", QueryableLoraConfig, {"target_modules": ["lin0"]} | SIZES),
    ("Vanilla MLP 3 Queryable LoRA", "MLP", QueryableLoraConfig, {"target_modules": ["lin1"]} | SIZES),
    ("Vanilla MLP 4 Queryable LoRA", "MLP", QueryableLoraConfig, {"target_modules": ["lin0", "lin1"]} | SIZES),
    (
        "Vanilla MLP 5 Queryable LoRA",
        "MLP",
        QueryableLoraConfig,
        {"target_modules": ["lin0"], "modules_to_save": ["lin1"]} | SIZES,
    ),
    (
        "Vanilla MLP 6 Queryable LoRA",
        "MLP",
        QueryableLoraConfig,
        {"target_modules": ["lin0"], "lora_alpha": 4, "lora_dropout": 0.1} | SIZES,
    ),
    (
        "Embedding + transformers Conv1D 1 Queryable LoRA",
        "EmbConv1D",
        QueryableLoraConfig,
        {"target_modules": ["conv1d"]} | SIZES,
    ),
]

# peft's LoRA cases on the same models, targets and settings: the comparison's other side
LORA_CASES = [name.replace("Queryable LoRA", "LoRA") for name, *_ in QUERYABLE_CASES]
KEPT = [*(name for name, *_ in QUERYABLE_CASES), *LORA_CASES]

MERGING = "merg"  # test names with it merge (merge_and_unload, merge_adapter, safe_merge, ...)
# tests that merge though their names do not say so (each calls merge_adapter and merge_and_unload after its forward)
MERGING_TESTS = {
    "test_forward_float16",
    "test_forward_bfloat16",
    "test_forward_float16_no_autocast",
    "test_forward_bfloat16_no_autocast",
}
MERGE_REASON = "Queryable LoRA cannot be merged: its update depends on the input through the route (docs/hf.md)"


def pytest_pycollect_makeitem(collector, name, obj):
    """Once per module that holds peft's TEST_CASES: Queryable LoRA's cases appended, before the class's tests are
    parametrized."""
    module = getattr(collector, "obj", None)
    cases = getattr(module, "TEST_CASES", None)
    if isinstance(cases, list) and not getattr(module, "_queryable_cases_added", False):
        cases.extend(QUERYABLE_CASES)
        module._queryable_cases_added = True


def case(item) -> str | None:
    """The TEST_CASES name an item runs (its parameter id starts with it), or None."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("test_name")


def pytest_collection_modifyitems(config, items):
    """Only the Queryable LoRA cases and LoRA's on the same models run; Queryable LoRA's merging tests are skipped
    by name with the reason."""
    kept, dropped = [], []
    for item in items:
        (kept if case(item) in KEPT else dropped).append(item)
        merges = MERGING in item.originalname.lower() or item.originalname in MERGING_TESTS
        if case(item) in KEPT and "Queryable LoRA" in case(item) and merges:
            item.add_marker(pytest.mark.skip(reason=MERGE_REASON))
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept
