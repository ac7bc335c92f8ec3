"""Registration with peft.

peft's public API for a method defined outside peft is `peft.utils.register_peft_method` (peft 0.15 and later; the
`hf` extra pins the range tested). It fills peft's own tables (config class, tuner class, parameter prefix) that
`get_peft_model`, `PeftConfig.from_pretrained` and `PeftModel.from_pretrained` read, so qlbench writes none of them.

One step has no public API: `register_peft_method` accepts only a name that already is a member of peft's `PeftType`
enum (it checks `name.upper() in list(PeftType)`), and peft has no function to add one. `_add_peft_type_member` does
that, and is the only place where qlbench writes private state (of the enum). The member is a `str` like every
PeftType, so saved configs (`"peft_type": "QUERYABLE_LORA"`) load through peft's own mappings. docs/hf.md says why;
tests/test_peft_registry.py fails if what this relies on in peft (or in `enum`) moves.
"""

from __future__ import annotations

from peft.utils import PeftType, register_peft_method

NAME = "queryable_lora"  # peft's method name; PeftType.QUERYABLE_LORA
PREFIX = "queryable_"  # every adapter parameter's name holds it (peft marks those trainable)


def _add_peft_type_member(key: str) -> None:
    """Add the member `key` (value `key`) to peft's PeftType enum, in place.

    Why private state: `register_peft_method` requires the member, peft offers no way to add one, an enum with
    members cannot be subclassed, and a separate enum would not be PeftType (peft's configs and mappings hold
    PeftType members). So this writes the member where the enum's own class creation puts it (CPython's `enum`): the
    member map, the value map, the name list and the class attribute. Keep every such write in this function.
    """
    member = str.__new__(PeftType, key)
    member._name_, member._value_ = key, key
    PeftType._member_map_[key] = member
    PeftType._value2member_map_[key] = member
    PeftType._member_names_.append(key)
    type.__setattr__(PeftType, key, member)


def peft_type() -> PeftType:
    """PeftType.QUERYABLE_LORA, added to peft's enum the first time."""
    key = NAME.upper()
    if key not in PeftType.__members__:
        _add_peft_type_member(key)
    return PeftType[key]


def register(config_cls: type, model_cls: type) -> None:
    """Register the tuner (QueryableLoraConfig, QueryableLoraModel) with peft; a second call does nothing."""
    from peft import PEFT_TYPE_TO_TUNER_MAPPING  # peft exports it (its __all__); read only

    if peft_type() not in PEFT_TYPE_TO_TUNER_MAPPING:
        register_peft_method(name=NAME, config_cls=config_cls, model_cls=model_cls, prefix=PREFIX)
