"""qlbench.hf: Queryable LoRA as a peft tuner on tiny random-initialised transformers models (BERT, GPT-2, Llama).

Skipped where the `hf` extra (peft, transformers) is not installed; CI installs it with `[dev]`."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from qlbench.hf import InstructQueryableLoraConfig, QueryableLoraConfig  # noqa: E402
from qlbench.hf.model import layer_index  # noqa: E402

D, LAYERS, VOCAB = 32, 4, 50


def bert():
    c = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=2, intermediate_size=64
    )
    return transformers.BertModel(c), ["query", "value"]


def gpt2():
    c = transformers.GPT2Config(vocab_size=VOCAB, n_embd=D, n_layer=LAYERS, n_head=2, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Model(c), ["c_attn"]


def llama():
    c = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=64,
    )  # fmt: skip
    return transformers.LlamaModel(c), ["q_proj", "v_proj"]


MODELS = {"bert": bert, "gpt2": gpt2, "llama": llama}


def wrapped(name: str, seed: int = 0, **config):
    """(peft model, its base model's fresh copy's factory): B drawn non-zero so that the update shows."""
    torch.manual_seed(seed)
    base, targets = MODELS[name]()
    state = {k: v.clone() for k, v in base.state_dict().items()}
    kw = dict(r=4, n_atoms=8, top_k=2, n_blocks=2) | config
    cls = InstructQueryableLoraConfig if kw.pop("instruct", False) else QueryableLoraConfig
    model = peft.get_peft_model(base, cls(target_modules=targets, **kw))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "queryable_B" in n:
                p.normal_(0, 0.2)

    def fresh():
        other, _ = MODELS[name]()
        other.load_state_dict(state)
        return other

    return model, fresh


def inputs(batch: int = 3, tokens: int = 7, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(1, VOCAB, (batch, tokens), generator=g)}


def hidden(model, **kw) -> torch.Tensor:
    return model(**kw).last_hidden_state


@pytest.mark.parametrize("name", MODELS)
def test_trainable_parameters_are_the_hand_count(name):
    """A (r x d_in), B (d_out x r) and eta (1) per adapted layer, plus the memory: atoms M r^2, keys M d_k, block
    priors B d_k and the router's Q_cur, Q_dep, Q_dep_k (d_k r each) and Q_dep_q (d_k^2); nothing of the backbone."""
    model, _ = wrapped(name)
    r, M, d_k, blocks = 4, 8, 16, 2
    shapes = {"bert": [(D, D)] * 2, "gpt2": [(D, 3 * D)], "llama": [(D, D)] * 2}[name]  # (d_in, d_out) per layer
    per_layer = sum(r * d_in + d_out * r + 1 for d_in, d_out in shapes)
    memory = M * r * r + M * d_k + blocks * d_k + 3 * d_k * r + d_k * d_k
    trainable, _ = model.get_nb_trainable_parameters()
    assert trainable == LAYERS * per_layer + memory
    assert all("queryable_" in n for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("name", MODELS)
def test_forward_and_backward_reach_every_adapter_parameter(name):
    """Three blocks: the third attends over two completed blocks (over one, the depth attention is constant)."""
    model, fresh = wrapped(name, n_blocks=3)
    y = hidden(model, **inputs())
    assert y.shape == (3, 7, D) and torch.isfinite(y).all()
    assert not torch.allclose(y, hidden(fresh(), **inputs()))  # the update shows
    y.pow(2).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    assert missing == []


@pytest.mark.parametrize("name", MODELS)
def test_save_and_load_round_trip_gives_identical_outputs(name, tmp_path):
    model, fresh = wrapped(name)
    model.eval()
    before = hidden(model, **inputs())
    model.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(fresh(), tmp_path).eval()
    assert torch.equal(hidden(loaded, **inputs()), before)
    assert loaded.peft_config["default"].peft_type == "QUERYABLE_LORA"


def test_blocks_follow_the_layer_order():
    model, _ = wrapped("bert", n_blocks=2)
    blocks = {n: m.block["default"] for n, m in model.named_modules() if hasattr(m, "queryable_A")}
    assert len(blocks) == 2 * LAYERS
    for n, b in blocks.items():
        assert b == (0 if layer_index(n) < LAYERS // 2 else 1), n
    assert layer_index("base_model.model.encoder.layer.3.attention.self.query") == 3
    assert layer_index("lm_head") is None


def test_too_many_blocks_is_a_clear_error():
    with pytest.raises(ValueError, match="n_blocks=5 exceeds the 4 layers"):
        wrapped("bert", n_blocks=5)


def test_padding_does_not_change_the_real_tokens():
    """The rank state's token average skips the mask's padding: a padded batch gives its real tokens the outputs of
    the unpadded one (BERT masks padding in attention too). Planted bug: a plain mean over all tokens fails it."""
    model, _ = wrapped("bert")
    model.eval()
    x = inputs(batch=2, tokens=5)["input_ids"]
    padded = torch.cat([x, torch.zeros(2, 3, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(2, 5), torch.zeros(2, 3)], 1).long()
    plain = hidden(model, input_ids=x)
    same = lambda: torch.allclose(hidden(model, input_ids=padded, attention_mask=mask)[:, :5], plain, atol=1e-5)
    assert same()
    routing = model.base_model.routing
    pooled = routing.pooled
    routing.pooled = lambda s: s.mean(1) if s.dim() == 3 else s  # the planted bug
    try:
        assert not same()
    finally:
        routing.pooled = pooled


def test_the_instruction_is_given_per_adapter_or_per_call_and_changes_the_routes():
    model, _ = wrapped("bert", instruct=True)
    model.eval()
    g = torch.Generator().manual_seed(3)
    e1, e2 = (torch.nn.functional.normalize(torch.randn(384, generator=g), dim=0) for _ in range(2))
    with pytest.raises(ValueError, match="routes on an instruction"):
        hidden(model, **inputs())
    model.base_model.set_instruction(e1)
    bound = hidden(model, **inputs())
    assert torch.equal(hidden(model, **inputs(), instruction=e1), bound)
    assert not torch.allclose(hidden(model, **inputs(), instruction=e2), bound)
    per_sample = hidden(model, **inputs(), instruction=torch.stack([e1, e2, e1]))
    assert torch.allclose(per_sample[0], bound[0], atol=1e-6) and not torch.allclose(per_sample[1], bound[1])
    with pytest.raises(ValueError, match="wants"):
        hidden(model, **inputs(), instruction=torch.zeros(7))


def test_bad_configs_are_clear_errors():
    with pytest.raises(ValueError, match="top_k must be an integer in"):
        QueryableLoraConfig(target_modules=["query"], n_atoms=4, top_k=5)
    with pytest.raises(ValueError, match="target_modules is required"):
        QueryableLoraConfig()
    with pytest.raises(ValueError, match="needs an instruction embedding"):
        QueryableLoraConfig(target_modules=["query"], tau_lang=1.0)


def test_the_core_package_does_not_import_peft():
    code = "import sys, qlbench, qlbench.cli, qlbench.adapters, qlbench.experiment; print('peft' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
