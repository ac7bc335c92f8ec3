"""qlbench.hf: causal routing on decoder language models (issue 43).

With causal routing (the default for causal LMs) the route at token t is made from the rank states of tokens 0..t
only. Oracles: the running average against a plain loop over its equation; the first block's route at t against the
route sequence mode (one route per sequence) makes for the prefix 0..t, which is the same quantity computed another
way. Then the properties a causal LM needs: a later token never moves earlier logits; greedy and beam search give
the same tokens with and without the KV cache, and the cached step logits equal a full forward (caches continued
after other forwards, copied, cropped by assisted generation: tests/test_hf_cache.py).
"""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from qlbench.hf import QueryableLoraConfig  # noqa: E402
from qlbench.hf.routing import ForwardState  # noqa: E402

from helpers import peft_decoder as wrapped  # noqa: E402

IDS = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(1))
E = torch.randn(2, 8, generator=torch.Generator().manual_seed(5))  # one instruction per row


def set_causal(model, causal: bool) -> None:
    model.base_model.queryable_memory["default"].config.causal = causal


def logits(model, ids, **kw) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, instruction=E[: len(ids)], use_cache=False, **kw).logits


def test_causal_routing_is_the_default_for_causal_language_models():
    assert wrapped("gpt2").peft_config["default"].causal is True
    assert wrapped("llama", task_type=None).peft_config["default"].causal is True  # LlamaForCausalLM
    assert wrapped("gpt2", causal=False).peft_config["default"].causal is False
    c = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    config = QueryableLoraConfig(target_modules=["query", "value"], r=4, n_atoms=4, top_k=2, n_blocks=2)
    assert peft.get_peft_model(transformers.BertModel(c), config).peft_config["default"].causal is False


def _inject(model, targets, **kw):
    config = QueryableLoraConfig(target_modules=targets, r=4, n_atoms=4, top_k=2, n_blocks=2, **kw)
    return peft.get_peft_model(model, config).peft_config["default"].causal


def test_causality_comes_from_what_the_model_can_do_not_its_class_name():
    """A generating model under a name no list knows (a custom head on LlamaForCausalLM, no task_type) routes
    causally: a class-name rule (`...ForCausalLM`) would call it non-causal. A decoder config does too; a module that
    is not a transformers model is routed non-causally with a warning that says so and how to change it."""
    c = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=2, vocab_size=100)  # fmt: skip

    class Chatty(transformers.LlamaForCausalLM):  # a custom head: generates, under its own name
        pass

    assert Chatty.can_generate() and not type(Chatty(c)).__name__.endswith(("ForCausalLM", "LMHeadModel"))
    assert _inject(Chatty(c), ["q_proj", "v_proj"]) is True
    bert = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    assert _inject(transformers.BertModel(bert), ["query", "value"]) is False
    bert.is_decoder = True  # BERT as a decoder: causal
    assert _inject(transformers.BertModel(bert), ["query", "value"]) is True
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.warns(UserWarning, match="cannot tell whether Sequential is causal.*set causal=True"):
        assert _inject(plain, ["0", "1"]) is False


def test_a_vision_language_model_without_task_type_routes_causally():
    """A tiny Llava (LlavaForConditionalGeneration from a config, text-only inputs), wrapped without task_type: it
    generates, so it routes causally, and a later token never moves earlier logits. Planted bug: the same model
    routed non-causally, where changing the last token moves every earlier position's logits."""
    text = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=2, vocab_size=101)  # fmt: skip
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=16, patch_size=8)  # fmt: skip
    torch.manual_seed(0)
    llava = transformers.LlavaForConditionalGeneration(
        transformers.LlavaConfig(
            text_config=text, vision_config=vision, image_token_index=100
        )  # no text token is the image's
    ).eval()
    config = QueryableLoraConfig(target_modules=r".*language_model.*\.(q_proj|v_proj)", r=4, n_atoms=4, top_k=2,
                                 n_blocks=2, instruction_dim=8)  # fmt: skip
    model = peft.get_peft_model(llava, config)
    assert model.peft_config["default"].causal is True
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "queryable" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))  # routes that differ
    later = IDS.clone()
    later[:, -1] = (later[:, -1] + 7) % 99 + 1  # another last token

    def moved(model) -> tuple[float, float]:  # (largest change of an earlier position's logits, of the last one's)
        a, b = logits(model, IDS), logits(model, later)
        return (a[:, :-1] - b[:, :-1]).abs().max().item(), (a[:, -1] - b[:, -1]).abs().max().item()

    earlier, last = moved(model)
    assert earlier == 0.0 and last > 1e-3
    set_causal(model, False)  # planted: the class-name rule's answer for a VLM
    assert moved(model)[0] > 1e-3


def test_a_non_causal_router_refuses_to_continue_a_kv_cache():
    """causal=False on a decoder, then generate: refused in one line at the first cached step (each token would be
    routed on its whole forward, so cached and uncached tokens would differ); without the cache it generates."""
    model = wrapped("gpt2", causal=False)
    kw = dict(instruction=E, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with pytest.raises(ValueError, match=r"causal=False .* KV cache of 6 tokens.*set causal=True.*use_cache=False"):
        model.generate(input_ids=IDS, **kw)
    assert model.generate(input_ids=IDS, use_cache=False, **kw).shape == (2, 9)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_first_blocks_route_at_t_is_the_sequence_route_of_the_prefix(kind):
    """Block 0 is routed by the first adapted layer, whose input no adapter has touched: its causal route at token t
    (one row per token) is the route sequence mode makes for the prefix 0..t (one row per sequence)."""
    model = wrapped(kind)
    routing = model.base_model.routing
    logits(model, IDS)
    causal = routing.last["default"][0].logits[0].reshape(2, IDS.shape[1], -1)  # (batch, T, M)
    set_causal(model, False)
    for t in range(IDS.shape[1]):
        logits(model, IDS[:, : t + 1])
        torch.testing.assert_close(causal[:, t], routing.last["default"][0].logits[0], rtol=1e-5, atol=1e-6)
    # the check can fail: the whole sequence's route is not the first token's
    assert not torch.allclose(routing.last["default"][0].logits[0], causal[:, 0], atol=1e-4)


def test_the_running_average_is_the_masked_mean_of_the_tokens_so_far():
    """Routing.pooled against a plain loop over the equation: pooled_t = sum_{i<=t} m_i s_i / sum_{i<=t} m_i (a
    padded position before any token: 0), over a forward of 4 tokens and the cached forward of 2 more after it."""
    model = wrapped("gpt2")
    routing = model.base_model.routing
    g = torch.Generator().manual_seed(9)
    s, mask = torch.randn(2, 6, 4, generator=g), torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    call = routing.begin(ForwardState(mask=mask[:, :4]))
    first = routing.pooled(s[:, :4], "default", layer="L")
    total, weight = routing.state.sums["default", "L"]  # (2, 4, r), (2, 4, 1): what the cache keeps
    routing.finish(call)
    carried = {("default", "L"): (total[:, -1], weight[:, -1])}
    call = routing.begin(ForwardState(mask=mask, carry_in=carried, cached=4))  # generate's mask covers the cache
    second = routing.pooled(s[:, 4:], "default", layer="L")
    routing.finish(call)
    got = torch.cat([first, second], 1)
    for b in range(2):
        for t in range(6):
            m = mask[b, : t + 1].float()
            want = (m[:, None] * s[b, : t + 1]).sum(0) / max(m.sum().item(), 1.0)
            torch.testing.assert_close(got[b, t], want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_later_token_leaves_earlier_logits_unchanged(kind):
    other = IDS.clone()
    other[:, -1] = (other[:, -1] + 7) % 100
    model = wrapped(kind)
    torch.testing.assert_close(logits(model, other)[:, :-1], logits(model, IDS)[:, :-1], rtol=0, atol=1e-6)
    set_causal(model, False)  # one route per sequence: the later token leaks into every position
    assert not torch.allclose(logits(model, other)[:, :-1], logits(model, IDS)[:, :-1], atol=1e-4)


GREEDY = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_greedy_generation_is_the_same_with_and_without_the_cache(kind):
    model = wrapped(kind)
    cached = model.generate(input_ids=IDS, instruction=E, use_cache=True, **GREEDY)
    plain = model.generate(input_ids=IDS, instruction=E, use_cache=False, **GREEDY)
    assert torch.equal(cached.sequences, plain.sequences)
    steps = torch.stack(cached.logits, 1)  # (2, 4, V): the cached steps' logits
    torch.testing.assert_close(steps, torch.stack(plain.logits, 1), rtol=1e-5, atol=1e-5)
    # and a full forward of the generated sequence gives the same logits at the positions that produced them
    full = logits(model, cached.sequences[:, :-1])[:, IDS.shape[1] - 1 :]
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_beam_search_runs_and_is_the_same_with_and_without_the_cache(kind):
    model = wrapped(kind)
    beams = dict(max_new_tokens=4, do_sample=False, num_beams=3, pad_token_id=0)
    cached = model.generate(input_ids=IDS, instruction=E, use_cache=True, **beams)
    assert torch.equal(cached, model.generate(input_ids=IDS, instruction=E, use_cache=False, **beams))
    assert cached.shape == (2, IDS.shape[1] + 4)


def test_left_padding_is_skipped_by_the_running_average():
    """A row left-padded to a longer batch routes and generates as it does alone."""
    model = wrapped("llama")
    short = IDS[:1, 2:]
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), short], 1)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    alone = model.generate(input_ids=short, instruction=E[:1], **GREEDY)
    both = model.generate(input_ids=padded, attention_mask=mask, instruction=E[:1], **GREEDY)
    assert torch.equal(both.sequences[:, 2:], alone.sequences)
    torch.testing.assert_close(torch.stack(both.logits, 1), torch.stack(alone.logits, 1), rtol=1e-4, atol=1e-4)


def test_causal_gradients_are_the_same_with_gradient_checkpointing():
    grads = []
    for checkpointing in (False, True):
        model = wrapped("llama").train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        out = model(input_ids=IDS, instruction=E, labels=IDS, use_cache=False)
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and any("queryable_memory" in n for n in grads[0])
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7, msg=n)


# cu_seq_lens_q on Llama only: its offsets are tested with positions that go on (0..6), which move GPT-2's input
# (learned position embeddings) but not Llama's (rotary, inside attention)
@pytest.mark.parametrize(
    ("kind", "given"), [("gpt2", "position_ids"), ("llama", "position_ids"), ("llama", "cu_seq_lens_q")]
)
def test_each_packed_sequence_routes_as_it_does_alone(kind, given):
    """Two sequences packed into one row (padding-free training: position_ids that restart, or flash attention's
    cu_seq_lens_q): each token of the second routes (block 0) as in that sequence alone, the first's as the first
    alone. Planted: the same row with no sign of the packing routes the second sequence's tokens on the first's."""
    model = wrapped(kind)
    routing = model.base_model.routing
    a, b = IDS[0, :4], IDS[1, :3]
    packed = torch.cat([a, b])[None]  # (1, 7)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])

    def route(ids, **kw):  # block 0's route logits per token, (T, M)
        with torch.no_grad():
            model(input_ids=ids, instruction=E[:1], use_cache=False, **kw)
        return routing.last["default"][0].logits[0].reshape(ids.shape[1], -1)

    marks = {"position_ids": dict(position_ids=positions)}
    marks["cu_seq_lens_q"] = dict(position_ids=positions, cu_seq_lens_q=torch.tensor([0, 4, 7]), max_length_q=4)
    alone = torch.cat([route(a[None]), route(b[None])])
    if given == "cu_seq_lens_q":  # the offsets alone (positions that go on) still mark the second sequence
        marks[given]["position_ids"] = torch.arange(7)[None]
    torch.testing.assert_close(route(packed, **marks[given]), alone, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(route(packed, position_ids=torch.arange(7)[None])[4:], alone[4:], atol=1e-4)


def test_a_non_causal_router_refuses_packed_rows():
    model = wrapped("gpt2", causal=False)
    with pytest.raises(ValueError, match="causal=False makes one route per row.*set causal=True"):
        model(input_ids=IDS[:1], instruction=E[:1], position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]), use_cache=False)
