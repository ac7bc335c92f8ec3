"""qlbench.hf in a real decoding stack, side by side with peft's LoRA (issue 70), on tiny Llama, Qwen2, Mistral and
GPT-2 models.

The oracle is the model itself: a continued KV cache must give the logits a full forward of the whole sequence
gives, assisted and prompt-lookup generation the tokens greedy generation gives, and each row of a mixed-adapter
batch what its adapter gives alone. peft's LoRA, run on the same base weights, passes each check too, so a failure
is the tuner's. The causal route sums live with the cache (RouteSums); the planted bugs put them back where they
were (shared by the model's forwards) or drop the row adapters, and each check fails them.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from qlbench.hf import QueryableLoraConfig  # noqa: E402

VOCAB = 64
KINDS = ("llama", "qwen2", "mistral", "gpt2")
METHODS = ("queryable", "lora")


def base(kind: str):
    """A tiny causal LM of `kind` (2 layers, width 32), the same weights on every call, and its target modules."""
    torch.manual_seed(0)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
    if kind == "gpt2":
        c = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(c), ["c_attn"]
    config = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
    }
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "mistral": transformers.MistralForCausalLM}  # fmt: skip
    return cls[kind](config[kind](**sizes)), ["q_proj", "v_proj"]


def adapter_config(method: str, targets, **kw):
    if method == "queryable":
        return QueryableLoraConfig(target_modules=targets, r=4, n_atoms=4, top_k=2, n_blocks=2, task_type="CAUSAL_LM",
                                   **kw)  # fmt: skip
    return peft.LoraConfig(target_modules=targets, r=4, task_type="CAUSAL_LM", **kw)


def drawn(model):
    """`model` in eval mode with every adapter's B (and Queryable LoRA's memory) drawn non-zero, seeded."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if any(k in n for k in ("queryable_B", "queryable_memory", "lora_B")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def wrapped(kind: str, method: str, adapters: tuple[str, ...] = ("default",)):
    """`kind`'s tiny LM with `method`'s adapters, each doing something (`drawn`)."""
    model, targets = base(kind)
    model = peft.get_peft_model(model, adapter_config(method, targets))
    for name in adapters[1:]:
        model.add_adapter(name, adapter_config(method, targets))
    return drawn(model)


def ids(batch: int = 2, tokens: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model, x, **kw) -> torch.Tensor:
    return model(input_ids=x, **kw).logits


def close(a, b, tol=1e-5) -> bool:
    return torch.allclose(a, b, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------------------------
# 1. A KV cache continues as the full forward, whatever ran in between.


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_cache_continues_as_the_full_forward_after_other_forwards(kind, method):
    model, x = wrapped(kind, method), ids()
    full = logits(model, x, use_cache=False)
    with torch.no_grad():
        past = model(input_ids=x[:, :5], use_cache=True).past_key_values
        model(input_ids=ids(seed=7)[:, :5], use_cache=True)  # same shape: scoring another batch
        model(input_ids=ids(batch=3, tokens=4, seed=8), use_cache=True)  # another shape
        step = model(input_ids=x[:, 5:], past_key_values=past, use_cache=True).logits
    assert close(step, full[:, 5:])


def test_the_check_fails_when_the_route_sums_are_the_last_forwards():
    """Planted bug: the first cache continued with the route sums of the forward run in between (module-owned
    state, as before): the continuation leaves the full forward."""
    model, x = wrapped("llama", "queryable"), ids()
    full = logits(model, x, use_cache=False)
    with torch.no_grad():
        past = model(input_ids=x[:, :5], use_cache=True).past_key_values
        other = model(input_ids=ids(seed=7)[:, :5], use_cache=True).past_key_values
        past.queryable_sums = other.queryable_sums
        step = model(input_ids=x[:, 5:], past_key_values=past, use_cache=True).logits
    assert not close(step, full[:, 5:], tol=1e-3)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_deep_copied_prompt_cache_continues_each_way(kind, method):
    """A prompt's cache copied and each copy continued with other tokens: both equal their full forwards."""
    model, x, y = wrapped(kind, method), ids(), ids(seed=5)
    with torch.no_grad():
        prompt = model(input_ids=x[:, :5], use_cache=True).past_key_values
        copied = copy.deepcopy(prompt)
        a = model(input_ids=x[:, 5:], past_key_values=prompt).logits
        b = model(input_ids=y[:, 5:], past_key_values=copied).logits
    both = torch.cat([x[:, :5], y[:, 5:]], 1)
    assert close(a, logits(model, x, use_cache=False)[:, 5:])
    assert close(b, logits(model, both, use_cache=False)[:, 5:])


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_static_cache_generates_the_dynamic_caches_tokens(kind, method):
    model, x = wrapped(kind, method), ids()
    want = model.generate(input_ids=x, **GREEDY)
    assert torch.equal(model.generate(input_ids=x, cache_implementation="static", **GREEDY), want)


@pytest.mark.parametrize("method", METHODS)
def test_a_sliding_window_cache_continues_as_the_full_forward(method):
    """Mistral with a 4-token window: the cache keeps 4 tokens' keys and values, the route sums cover every token
    (the route is not windowed), and the continuation equals the full forward."""
    torch.manual_seed(0)
    c = transformers.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=VOCAB, sliding_window=4)  # fmt: skip
    model = drawn(peft.get_peft_model(transformers.MistralForCausalLM(c), adapter_config(method, ["q_proj", "v_proj"])))
    x = ids()
    full = logits(model, x, use_cache=False)
    with torch.no_grad():
        past = model(input_ids=x[:, :6], use_cache=True).past_key_values
        assert "Sliding" in type(past.layers[0]).__name__
        step = model(input_ids=x[:, 6:], past_key_values=past).logits
    assert close(step, full[:, 6:])


def test_a_cache_made_elsewhere_or_of_other_rows_is_refused_in_one_line():
    model, plain = wrapped("llama", "queryable"), base("llama")[0].eval()
    x = ids()
    with torch.no_grad():
        foreign = plain(input_ids=x[:, :5], use_cache=True).past_key_values
        with pytest.raises(ValueError, match="holds no route sums"):
            model(input_ids=x[:, 5:], past_key_values=foreign)
        past = model(input_ids=x[:, :5], use_cache=True).past_key_values
        with pytest.raises(ValueError, match="holds 2 rows, this forward 1"):
            model(input_ids=x[:1, 5:], past_key_values=past)


GREEDY = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)


def repetitive(seed: int = 2) -> torch.Tensor:
    """A prompt that repeats itself, so that prompt lookup drafts tokens (and some are rejected)."""
    part = ids(batch=1, tokens=4, seed=seed)
    return torch.cat([part, part, part[:, :2]], 1)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", KINDS)
def test_assisted_and_prompt_lookup_generation_give_the_greedy_tokens(kind, method):
    """Assisted generation (a draft model's tokens, verified in one forward, the rejected ones cropped from the
    cache) and prompt lookup give the tokens greedy decoding gives."""
    model, x = wrapped(kind, method), repetitive()
    greedy = model.generate(input_ids=x, **GREEDY)
    assistant = base(kind)[0].eval()  # the base model: its drafts differ from the adapted model's choices
    assert torch.equal(model.generate(input_ids=x, assistant_model=assistant, **GREEDY), greedy)
    assert torch.equal(model.generate(input_ids=x, prompt_lookup_num_tokens=3, **GREEDY), greedy)


def test_the_generation_check_fails_when_a_cropped_cache_keeps_the_rejected_sums():
    """Planted bug: route sums that keep the rejected draft tokens (read at the sums' end, not at the cache's
    length) change assisted generation's tokens or logits."""
    from qlbench.hf import model as hf_model

    model, x = wrapped("llama", "queryable"), repetitive()
    greedy = model.generate(input_ids=x, output_logits=True, return_dict_in_generate=True, **GREEDY)
    original = hf_model.QueryableLoraModel._continue_cache

    def at_the_end(self, cache, state, batch):
        original(self, cache, state, batch)
        for key, (total, weight) in getattr(cache, "queryable_sums", {}).items():
            state.carry_in[key] = total[:, -1], weight[:, -1]

    hf_model.QueryableLoraModel._continue_cache = at_the_end
    try:
        assistant = base("llama")[0].eval()
        got = model.generate(input_ids=x, assistant_model=assistant, output_logits=True, return_dict_in_generate=True,
                             **GREEDY)  # fmt: skip
    finally:
        hf_model.QueryableLoraModel._continue_cache = original
    same = torch.equal(got.sequences, greedy.sequences) and close(torch.stack(got.logits), torch.stack(greedy.logits))
    assert not same


# ---------------------------------------------------------------------------------------------------------------
# 2. Mixed-adapter batches.


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_mixed_batch_gives_each_row_its_adapter_alone(kind, method):
    model, x = wrapped(kind, method, adapters=("default", "b2")), ids(batch=3)
    mixed = logits(model, x, adapter_names=["default", "b2", "__base__"])
    alone = {}
    for name in ("default", "b2"):
        model.set_adapter(name)
        alone[name] = logits(model, x)
    with model.disable_adapter():
        plain = logits(model, x)
    assert close(mixed[0], alone["default"][0]) and close(mixed[1], alone["b2"][1]) and close(mixed[2], plain[2])
    assert not close(alone["default"][1], alone["b2"][1], tol=1e-3)  # the adapters differ


@pytest.mark.parametrize("beams", [1, 3])
@pytest.mark.parametrize("method", METHODS)
def test_generate_with_a_mixed_batch_gives_each_row_its_adapter_alone(method, beams):
    """Greedy and beam search (each row's adapter repeated for its beams, the cache and route sums reordered)."""
    model, x = wrapped("llama", method, adapters=("default", "b2")), ids(batch=2, tokens=5)
    kw = GREEDY | {"num_beams": beams, "max_new_tokens": 5}
    mixed = model.generate(input_ids=x, adapter_names=["default", "b2"], **kw)
    rows = []
    for i, name in enumerate(("default", "b2")):
        model.set_adapter(name)
        rows.append(model.generate(input_ids=x[i : i + 1], **kw))
    assert torch.equal(mixed, torch.cat(rows))


def test_the_mixed_batch_check_fails_when_the_row_adapters_are_ignored(monkeypatch):
    """Planted bug: adapter_names dropped (every row runs the active adapter, as before): row 1 is not b2's."""
    from qlbench.hf import model as hf_model

    model, x = wrapped("llama", "queryable", adapters=("default", "b2")), ids(batch=2)
    model.set_adapter("b2")
    b2 = logits(model, x)
    model.set_adapter("default")
    monkeypatch.setattr(hf_model.QueryableLoraModel, "_mixed_rows", lambda self, rows, beams: None)
    assert not close(logits(model, x, adapter_names=["default", "b2"])[1], b2[1], tol=1e-3)


def test_a_bad_mixed_batch_is_refused_in_one_line():
    model, x = wrapped("llama", "queryable", adapters=("default", "b2")), ids(batch=2)
    with pytest.raises(ValueError, match="no adapter named nope; valid: default, b2, __base__"):
        logits(model, x, adapter_names=["default", "nope"])
    with pytest.raises(ValueError, match="names 3 rows, but this forward has 2"):
        logits(model, x, adapter_names=["default", "b2", "b2"])
    model.train()
    with pytest.raises(ValueError, match="for inference"):
        model(input_ids=x, adapter_names=["default", "b2"])


# ---------------------------------------------------------------------------------------------------------------
# 3. inputs_embeds, with and without a cache.


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_inputs_embeds_route_as_the_ids_do_with_and_without_a_cache(kind, method):
    model, x = wrapped(kind, method), ids()
    embed = model.get_input_embeddings()
    full = logits(model, x, use_cache=False)
    with torch.no_grad():
        assert close(model(inputs_embeds=embed(x), use_cache=False).logits, full)
        past = model(inputs_embeds=embed(x[:, :5]), use_cache=True).past_key_values
        step = model(inputs_embeds=embed(x[:, 5:]), past_key_values=past).logits
        assert close(step, full[:, 5:])
        new = model.generate(inputs_embeds=embed(x), **GREEDY)  # a decoder returns the new tokens only
    assert torch.equal(new, model.generate(input_ids=x, **GREEDY)[:, x.shape[1] :])


# ---------------------------------------------------------------------------------------------------------------
# 5. Config ergonomics; nothing of a forward kept after it.


def test_an_instruction_as_a_list_or_array_routes_as_the_tensor_does():
    from qlbench.hf import InstructQueryableLoraConfig

    model, targets = base("llama")
    config = InstructQueryableLoraConfig(target_modules=targets, r=4, n_atoms=4, top_k=2, n_blocks=2,
                                         instruction_dim=8, task_type="CAUSAL_LM")  # fmt: skip
    model = peft.get_peft_model(model, config).eval()
    e = torch.randn(8, generator=torch.Generator().manual_seed(4))
    x = ids()
    want = logits(model, x, instruction=e)
    assert torch.equal(logits(model, x, instruction=e.tolist()), want)
    assert torch.equal(logits(model, x, instruction=e.numpy()), want)
    model.set_instruction(np.asarray(e))
    assert torch.equal(logits(model, x), want)
    with pytest.raises(ValueError, match="instruction must be a tensor, a numpy array or a list of numbers, got str"):
        logits(model, x, instruction="a mammal?")


def test_lora_dropout_rslora_and_init_weights_have_loras_meaning():
    model, targets = base("llama")
    start = logits(model, ids())
    same = peft.get_peft_model(base("llama")[0], adapter_config("queryable", targets)).eval()
    assert torch.equal(logits(same, ids()), start)  # init_weights True: B = 0, the base model
    moved = peft.get_peft_model(base("llama")[0], adapter_config("queryable", targets, init_weights=False)).eval()
    assert not close(logits(moved, ids()), start, tol=1e-4)
    c = adapter_config("queryable", targets, use_rslora=True, lora_alpha=8)
    assert c.scaling == 8 / 2  # alpha / sqrt(r), r = 4
    drop = peft.get_peft_model(base("llama")[0], adapter_config("queryable", targets, lora_dropout=0.5,
                                                                init_weights=False))  # fmt: skip
    drop.train()
    with torch.no_grad():
        a, b = drop(input_ids=ids()).logits, drop(input_ids=ids()).logits
    assert not close(a, b, tol=1e-4)  # dropout on the adapter path in training
    drop.eval()
    assert torch.equal(logits(drop, ids()), logits(drop, ids()))
    with pytest.raises(ValueError, match=r"lora_dropout must be a number in \[0, 1\), got 1.5"):
        adapter_config("queryable", targets, lora_dropout=1.5)


def test_nothing_of_a_forward_with_gradients_is_kept_and_the_model_deep_copies():
    model = wrapped("llama", "queryable").train()
    out = model(input_ids=ids(), labels=ids())
    out.loss.backward()
    routing = model.base_model.routing
    assert routing.call is None  # no call is left in progress: the next forward starts from nothing
    held = [t for routes in routing.last.values() for r in routes.values() for t in vars(r).values()]
    assert all(not t.requires_grad for t in held if torch.is_tensor(t))
    copied = copy.deepcopy(model).eval()
    model.eval()
    assert torch.equal(logits(copied, ids()), logits(model, ids()))


@pytest.mark.parametrize("kind", KINDS)
def test_generate_with_the_adapters_disabled_gives_the_base_models_tokens(kind):
    """`with model.disable_adapter(): model.generate(...)`, with and without a KV cache, gives the tokens of the base
    model alone (as LoRA does); the adapters on again give the adapted tokens of before."""
    plain = base(kind)[0].eval()
    x = ids(batch=1, tokens=5, seed=4)
    for method in METHODS:
        model = wrapped(kind, method)
        adapted = model.generate(input_ids=x, **GREEDY)
        for cache in (True, False):
            with model.disable_adapter():
                got = model.generate(input_ids=x, use_cache=cache, **GREEDY)
            assert torch.equal(got, plain.generate(input_ids=x, use_cache=cache, **GREEDY)), (method, cache)
        assert torch.equal(model.generate(input_ids=x, **GREEDY), adapted), method
        assert not close(logits(model, x), logits(plain, x))  # the adapters do change the model


def test_the_disabled_generation_check_fails_when_the_switch_is_not_seen(monkeypatch):
    """Planted bug: the tuner ignores peft's switch (routing.disabled stays False): the cached generation raises."""
    from qlbench.hf import model as hf_model

    monkeypatch.setattr(
        hf_model.QueryableLoraModel, "_enable_adapter_layers", peft.tuners.tuners_utils.BaseTuner._enable_adapter_layers
    )
    model, x = wrapped("llama", "queryable"), ids(batch=1, tokens=5, seed=4)
    with pytest.raises(ValueError, match="holds no route sums"), model.disable_adapter():
        model.generate(input_ids=x, use_cache=True, **GREEDY)
