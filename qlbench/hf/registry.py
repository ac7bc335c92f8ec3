"""Registration with peft.

peft 0.21's `register_peft_method` accepts only names that already are members of its `PeftType` enum (it checks
`name.upper() in list(PeftType)`), which a project outside peft cannot add by subclassing (an enum with members is
final). qlbench adds the member to the existing enum (its member map, value map and name list, as the enum's own
class creation would) before registering; the member is a `str` like every PeftType, so saved configs
(`"peft_type": "QUERYABLE_LORA"`) load through peft's own mappings. docs/hf.md says why.
"""

from __future__ import annotations

from peft.utils.peft_types import PeftType, register_peft_method

NAME = "queryable_lora"  # peft's method name; PeftType.QUERYABLE_LORA
PREFIX = "queryable_"  # every adapter parameter's name holds it (peft marks those trainable)


def peft_type() -> PeftType:
    """PeftType.QUERYABLE_LORA, added to peft's enum the first time."""
    key = NAME.upper()
    if key not in PeftType.__members__:
        member = str.__new__(PeftType, key)
        member._name_, member._value_ = key, key
        PeftType._member_map_[key] = member
        PeftType._value2member_map_[key] = member
        PeftType._member_names_.append(key)
        type.__setattr__(PeftType, key, member)
    return PeftType[key]


def register(config_cls: type, model_cls: type) -> None:
    """Register the tuner (QueryableLoraConfig, QueryableLoraModel) with peft; a second call does nothing."""
    from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING

    if peft_type() not in PEFT_TYPE_TO_TUNER_MAPPING:
        register_peft_method(name=NAME, config_cls=config_cls, model_cls=model_cls, prefix=PREFIX)
