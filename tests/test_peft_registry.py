"""qlbench.hf.registry against the installed peft: fails when what the registration relies on moves.

The registration (qlbench/hf/registry.py) calls peft's public `register_peft_method` and, because that function
accepts only members of peft's `PeftType` enum, adds `QUERYABLE_LORA` to the enum by hand. A peft upgrade can change
the function, the tables it fills or the enum; these tests check each piece where peft itself reads it, so that an
upgrade fails here rather than at a user's `PeftModel.from_pretrained`.

Skipped where the `hf` extra (peft, transformers) is not installed; CI installs it with `[dev]`."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from dataclasses import fields

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from peft.mapping import (  # noqa: E402
    PEFT_TYPE_TO_CONFIG_MAPPING,
    PEFT_TYPE_TO_MIXED_MODEL_MAPPING,
    PEFT_TYPE_TO_PREFIX_MAPPING,
    PEFT_TYPE_TO_TUNER_MAPPING,
)
from peft.utils import PeftType  # noqa: E402

from qlbench.hf import QueryableLoraConfig, QueryableLoraModel, register  # noqa: E402
from qlbench.hf.registry import NAME, PREFIX, peft_type  # noqa: E402

KEY = "QUERYABLE_LORA"  # what adapter_config.json holds


def test_peft_has_the_public_registration_function_with_the_expected_signature():
    from peft.utils import register_peft_method

    kw = inspect.Parameter.KEYWORD_ONLY
    params = inspect.signature(register_peft_method).parameters
    assert [(p.name, p.kind) for p in params.values()] == [
        ("name", kw), ("config_cls", kw), ("model_cls", kw), ("prefix", kw), ("is_mixed_compatible", kw)
    ]  # fmt: skip
    assert params["prefix"].default is None and params["is_mixed_compatible"].default is False
    assert peft.PEFT_TYPE_TO_TUNER_MAPPING is PEFT_TYPE_TO_TUNER_MAPPING  # the table registry.register reads


def test_peft_still_requires_a_peft_type_member():
    """The one private step (adding the enum member) exists because of this check; if peft drops it, the step can
    go (and this test with it)."""
    from peft.utils import register_peft_method

    with pytest.raises(ValueError, match="Unknown PEFT type"):
        register_peft_method(name="qlbench_not_a_member", config_cls=QueryableLoraConfig, model_cls=QueryableLoraModel)
    assert "QLBENCH_NOT_A_MEMBER" not in PEFT_TYPE_TO_CONFIG_MAPPING


def test_the_member_resolves_every_way_peft_and_enum_look_it_up():
    member = peft_type()
    assert member is PeftType(KEY) is PeftType[KEY] is PeftType.QUERYABLE_LORA is getattr(PeftType, NAME.upper())
    assert KEY in list(PeftType) and member in PeftType and KEY in PeftType.__members__
    assert isinstance(member, PeftType) and isinstance(member, str)
    assert member == KEY and hash(member) == hash(KEY) and member.value == KEY and member.name == KEY
    assert [m for m in PeftType if m == KEY] == [member]  # added once
    assert PeftType("LORA") is PeftType.LORA  # peft's own members untouched


def test_peft_tables_resolve_the_saved_name_to_qlbenchs_classes():
    for key in (KEY, peft_type()):  # a config read from JSON holds the plain string
        assert PEFT_TYPE_TO_CONFIG_MAPPING[key] is QueryableLoraConfig
        assert PEFT_TYPE_TO_TUNER_MAPPING[key] is QueryableLoraModel
        assert PEFT_TYPE_TO_PREFIX_MAPPING[key] == PREFIX == QueryableLoraModel.prefix
    assert KEY not in PEFT_TYPE_TO_MIXED_MODEL_MAPPING
    assert QueryableLoraConfig(target_modules=["query"]).peft_type is peft_type()


def test_a_second_registration_does_nothing():
    names = list(PeftType.__members__)
    register(QueryableLoraConfig, QueryableLoraModel)
    assert peft_type() is peft_type() and list(PeftType.__members__) == names
    assert PEFT_TYPE_TO_TUNER_MAPPING[KEY] is QueryableLoraModel


def tiny_bert():
    torch.manual_seed(0)
    c = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    return transformers.BertModel(c)


def test_a_saved_adapter_loads_back_through_peft_here_and_in_a_fresh_interpreter(tmp_path):
    config = QueryableLoraConfig(target_modules=["query", "value"], r=4, n_atoms=8, top_k=2, n_blocks=2)
    model = peft.get_peft_model(tiny_bert(), config)
    assert isinstance(model.base_model, QueryableLoraModel)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "queryable_B" in n:
                p.normal_(0, 0.2)
    model.eval()
    x = torch.randint(1, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    before = model(input_ids=x).last_hidden_state
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["peft_type"] == KEY

    loaded_config = peft.PeftConfig.from_pretrained(tmp_path)
    assert type(loaded_config) is QueryableLoraConfig and loaded_config.peft_type is peft_type()
    own = {f.name for f in fields(QueryableLoraConfig)} - {f.name for f in fields(peft.PeftConfig)}  # qlbench's
    assert {"r", "n_atoms", "top_k", "target_modules"} <= own
    assert {k: getattr(loaded_config, k) for k in own} == {k: getattr(config, k) for k in own}
    loaded = peft.PeftModel.from_pretrained(tiny_bert(), tmp_path).eval()
    assert isinstance(loaded.base_model, QueryableLoraModel)
    assert torch.equal(loaded(input_ids=x).last_hidden_state, before)

    # A fresh process: only importing qlbench.hf registers the method (no other test's state).
    code = (
        "import sys, peft, qlbench.hf; from qlbench.hf.registry import peft_type; "
        "c = peft.PeftConfig.from_pretrained(sys.argv[1]); "
        "assert type(c) is qlbench.hf.QueryableLoraConfig and c.peft_type is peft_type(), c; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
