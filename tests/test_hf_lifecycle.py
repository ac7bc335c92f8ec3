"""qlbench.hf: the adapter lifecycle (add, load, delete, unload, low_cpu_mem_usage) against peft LoRA's behaviour.

Each test runs the same call sequence with a peft LoraConfig and with qlbench's QueryableLoraConfig on the same tiny
GPT-2 LM, and compares what LoRA does (which adapters exist, trainable parameter counts, outputs) with the tuner."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from qlbench.hf import QueryableLoraConfig  # noqa: E402
from qlbench.hf.layer import QueryableLoraLayer  # noqa: E402

KINDS = ("lora", "queryable")
X = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(1))


def base():
    torch.manual_seed(0)
    c = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(c).eval()


def config(kind: str):
    if kind == "lora":
        return peft.LoraConfig(target_modules=["c_attn"], r=4)
    return QueryableLoraConfig(target_modules=["c_attn"], r=4, n_atoms=4, top_k=2, n_blocks=2)


def wrapped(kind: str, seed: int = 3):
    """A peft model with the adapter `default`, its B drawn non-zero so that the update shows."""
    model = peft.get_peft_model(base(), config(kind)).eval()
    perturb(model, "default", seed)
    return model


def perturb(model, adapter: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ("lora_B" in n or "queryable_B" in n or "queryable_memory" in n) and f".{adapter}." in n + ".":
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def out(model) -> torch.Tensor:
    with torch.no_grad():
        return model(X).logits


def memory_names(model) -> list[str]:
    return sorted(getattr(model.base_model, "queryable_memory", {}).keys())


def adapter_names(model) -> set[str]:
    """Every adapter name that some adapter parameter (layer or memory) is held under."""
    names = set()
    for n, _ in model.named_parameters():
        parts = n.split(".")
        for i, part in enumerate(parts[:-1]):
            if part in ("lora_A", "lora_B", "queryable_A", "queryable_B", "queryable_eta", "queryable_memory"):
                names.add(parts[i + 1])
    return names


def add_and_route(kind: str) -> dict:
    model = wrapped(kind)
    one = trainable(model)
    y_default = out(model)
    model.add_adapter("b", config(kind))
    after_add = trainable(model)
    perturb(model, "b", seed=5)
    model.set_adapter("b")
    y_b = out(model)
    perturb(model, "default", seed=7)  # the other adapter's weights and memory: b's output must not move
    y_b_again = out(model)
    return {
        "adapters": sorted(model.peft_config),
        "held": sorted(adapter_names(model)),
        "after_add": after_add / one,
        "after_set": trainable(model) / one,
        "b_differs_from_default": not torch.allclose(y_b, y_default),
        "b_own_weights": torch.equal(y_b, y_b_again),
    }


def test_add_adapter_and_set_adapter_route_with_the_new_adapters_memory():
    lora, queryable = add_and_route("lora"), add_and_route("queryable")
    assert queryable == lora
    assert lora["b_own_weights"] and lora["b_differs_from_default"]


def test_add_adapter_routes_with_its_own_memory():
    model = wrapped("queryable")
    model.add_adapter("b", config("queryable"))
    perturb(model, "b", seed=5)
    model.set_adapter("b")
    assert memory_names(model) == ["b", "default"]
    y = out(model)
    with torch.no_grad():
        model.base_model.queryable_memory["b"].atoms.mul_(3.0)
    assert not torch.allclose(out(model), y)  # b's forward reads b's memory
    assert set(model.base_model.routing.last) >= {"b"}


def load(kind: str, tmp_path) -> dict:
    model = wrapped(kind)
    one = trainable(model)
    y = out(model)
    model.save_pretrained(tmp_path / kind)
    model.load_adapter(tmp_path / kind, "b")
    after_load = trainable(model)
    model.set_adapter("b")
    y_b = out(model)
    inference = peft.PeftModel.from_pretrained(base(), tmp_path / kind, is_trainable=False)
    training = peft.PeftModel.from_pretrained(base(), tmp_path / kind, is_trainable=True)
    return {
        "adapters": sorted(model.peft_config),
        "after_load": after_load / one,
        "loaded_equals_saved": torch.allclose(y_b, y, atol=1e-6),
        "from_pretrained_inference": trainable(inference),
        "from_pretrained_inference_equals_saved": torch.allclose(out(inference.eval()), y, atol=1e-6),
        "from_pretrained_trainable": trainable(training) / one,
    }


def test_load_adapter_for_inference_leaves_nothing_trainable(tmp_path):
    lora, queryable = load("lora", tmp_path), load("queryable", tmp_path)
    assert queryable == lora
    assert lora["from_pretrained_inference"] == 0 and lora["after_load"] == 1.0


def delete(kind: str) -> dict:
    model = wrapped(kind)
    total = sum(p.numel() for p in model.parameters())
    model.add_adapter("b", config(kind))
    model.delete_adapter("b")
    after_b = {
        "adapters": sorted(model.peft_config),
        "held": sorted(adapter_names(model)),
        "parameters_back": sum(p.numel() for p in model.parameters()) == total,
        "forward": out(model).shape,
    }
    model.add_adapter("c", config(kind))
    model.set_adapter("c")
    model.delete_adapter("default")  # the adapter get_peft_model made (its memory made in the tuner's __init__)
    return after_b | {
        "adapters_c": sorted(model.peft_config),
        "held_c": sorted(adapter_names(model)),
        "parameters_c": sum(p.numel() for p in model.parameters()) == total,
        "forward_c": out(model).shape,
    }


def test_delete_adapter_removes_its_memory_and_layer_weights():
    lora, queryable = delete("lora"), delete("queryable")
    assert queryable == lora
    assert lora["held"] == ["default"] and lora["parameters_back"]
    assert lora["held_c"] == ["c"] and lora["parameters_c"]


def unload(kind: str) -> dict:
    y_base = out(base())
    model = wrapped(kind)
    model.add_adapter("b", config(kind))
    y_adapted = out(model)
    clean = model.unload()
    return {
        "type": type(clean).__name__,
        "adapted_differs": not torch.allclose(y_adapted, y_base),
        "equals_base": torch.equal(out(clean), y_base),
        "tuner_layers": sum(isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer) for m in clean.modules()),
        "forward_pre_hooks": sum(len(m._forward_pre_hooks) for m in clean.modules()),
        "peft_config": hasattr(clean, "peft_config"),
    }


def test_unload_returns_the_clean_base_model():
    lora, queryable = unload("lora"), unload("queryable")
    assert queryable == lora
    assert lora["equals_base"] and lora["tuner_layers"] == 0 and lora["forward_pre_hooks"] == 0


def test_merge_and_unload_is_refused_clearly():
    model = wrapped("queryable")
    with pytest.raises(NotImplementedError, match="cannot be merged"):
        model.merge_and_unload()
    assert any(isinstance(m, QueryableLoraLayer) for m in model.modules())  # nothing was unloaded


def test_add_weighted_adapter_is_refused_in_one_line_that_says_why():
    """Through PeftModel (which hands the call to the tuner), as a LoRA user writes it; LoRA itself combines."""
    lora = wrapped("lora")
    lora.add_adapter("other", lora.peft_config["default"])
    lora.add_weighted_adapter(["default", "other"], [0.5, 0.5], "mix", combination_type="linear")
    assert "mix" in lora.peft_config
    model = wrapped("queryable")
    model.add_adapter("other", model.peft_config["default"])
    with pytest.raises(NotImplementedError) as err:
        model.add_weighted_adapter(["default", "other"], [0.5, 0.5], "mix", combination_type="linear")
    message = str(err.value)
    assert "\n" not in message and "depends on the input" in message and "add_weighted_adapter" in message
    assert "mix" not in model.peft_config  # nothing half-made


def low_cpu(kind: str, tmp_path) -> dict:
    model = wrapped(kind)
    one = trainable(model)
    y = out(model)
    model.save_pretrained(tmp_path / kind)
    loaded = peft.PeftModel.from_pretrained(base(), tmp_path / kind, low_cpu_mem_usage=True).eval()
    y_loaded = out(loaded)
    loaded.load_adapter(tmp_path / kind, "b", low_cpu_mem_usage=True)
    loaded.set_adapter("b")
    return {
        "from_pretrained_equals_saved": torch.allclose(y_loaded, y, atol=1e-6),
        "trainable": trainable(loaded) / one,
        "meta": any(p.is_meta for p in loaded.parameters()),
        "load_adapter_equals_saved": torch.allclose(out(loaded), y, atol=1e-6),
    }


def test_low_cpu_mem_usage_loading(tmp_path):
    lora, queryable = low_cpu("lora", tmp_path), low_cpu("queryable", tmp_path)
    assert queryable == lora
    assert lora["from_pretrained_equals_saved"] and lora["load_adapter_equals_saved"] and not lora["meta"]
