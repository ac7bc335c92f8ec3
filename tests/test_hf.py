"""qlbench.hf: Queryable LoRA as a peft tuner on tiny random-initialised transformers models (BERT, GPT-2, Llama).

Skipped where the `hf` extra (peft, transformers) is not installed; CI installs it with `[dev]`."""

from __future__ import annotations

import contextlib
import dataclasses
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


@pytest.mark.parametrize("blocks", [1, 2, 3])
@pytest.mark.parametrize("name", MODELS)
def test_trainable_parameters_are_the_hand_count(name, blocks):
    """A (r x d_in), B (d_out x r) and eta (1) per adapted layer, plus the memory: atoms M r^2, keys M d_k, block
    priors B d_k, the router's Q_cur (d_k r), and what a block with earlier blocks uses: Q_dep (d_k r) from B = 2,
    Q_dep_k (d_k r) and Q_dep_q (d_k^2) from B = 3 (below, the depth attention is over one block: constant);
    nothing of the backbone."""
    model, _ = wrapped(name, n_blocks=blocks)
    r, M, d_k = 4, 8, 16
    shapes = {"bert": [(D, D)] * 2, "gpt2": [(D, 3 * D)], "llama": [(D, D)] * 2}[name]  # (d_in, d_out) per layer
    per_layer = sum(r * d_in + d_out * r + 1 for d_in, d_out in shapes)
    memory = M * r * r + M * d_k + blocks * d_k + d_k * r
    memory += (d_k * r if blocks >= 2 else 0) + (d_k * r + d_k * d_k if blocks >= 3 else 0)
    trainable, _ = model.get_nb_trainable_parameters()
    assert trainable == LAYERS * per_layer + memory
    assert all("queryable_" in n for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "config",
    [dict(n_blocks=1), dict(n_blocks=2), dict(n_blocks=3), dict(n_blocks=4, instruct=True), dict(n_blocks=2, r=2)],
    ids=["B1", "B2", "B3", "B4-instruct", "B2-r2"],
)
@pytest.mark.parametrize("name", MODELS)
def test_every_trainable_parameter_gets_a_gradient(name, config):
    """Walks every trainable parameter: each has a nonzero gradient, on configs from one block (no depth attention)
    to four (attention over up to three earlier blocks), with and without the instruction channels."""
    model, fresh = wrapped(name, **config)
    kw = inputs()
    if config.get("instruct"):
        kw["instruction"] = torch.randn(3, 384, generator=torch.Generator().manual_seed(2))
    y = hidden(model, **kw)
    assert y.shape == (3, 7, D) and torch.isfinite(y).all()
    assert not torch.allclose(y, hidden(fresh(), **inputs()))  # the update shows
    y.pow(2).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    assert missing == []


def test_a_router_without_depth_matrices_routes_as_attention_over_one_block():
    """Oracle for the B = 2 tuner, which keeps no Q_dep_q and Q_dep_k: routing.route with them, over one earlier
    block, gives the same route as without them (a softmax over one item is 1), to the bit."""
    from qlbench.adapters import routing

    g = torch.Generator().manual_seed(4)
    E, N, r, d_k, M = 1, 5, 4, 16, 8
    router = routing.Router(
        w=torch.randn(E, d_k, generator=g), Q_cur=torch.randn(E, d_k, r, generator=g),
        Q_dep=torch.randn(E, d_k, r, generator=g), Q_dep_q=torch.randn(E, d_k, d_k, generator=g),
        Q_dep_k=torch.randn(E, d_k, r, generator=g), keys=torch.randn(E, M, d_k, generator=g),
        atoms=torch.randn(E, M, r, r, generator=g), Q_ctx=None, R_ctx=None,
    )  # fmt: skip
    t = routing.Temperatures(top_k=2, t_attn=1.0, t_dep=1.0, t_lang=1.0, tau_lang=0.0, lambda_ctx=0.0, eps=1e-6)
    s, one = torch.randn(E, N, r, generator=g), torch.randn(E, N, 1, r, generator=g)
    full = routing.route(s, one, router, t)
    bare = routing.route(s, one, dataclasses.replace(router, Q_dep_q=None, Q_dep_k=None), t)
    assert torch.equal(full.S, bare.S) and torch.equal(full.q, bare.q)
    with pytest.raises(ValueError, match="over one earlier block, not 2"):
        routing.route(s, torch.cat([one, one], 2), dataclasses.replace(router, Q_dep_q=None, Q_dep_k=None), t)


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


def test_more_blocks_than_adapted_layers_are_clamped_with_a_note():
    with pytest.warns(UserWarning, match="n_blocks=5 is more than the 4 layer"):
        model, _ = wrapped("bert", n_blocks=5)
    assert model.peft_config["default"].n_blocks == 4
    assert model.base_model.queryable_memory["default"].block_prior.shape == (4, 16)
    blocks = {m.block["default"] for m in model.modules() if hasattr(m, "block") and "default" in m.block}
    assert blocks == {0, 1, 2, 3}


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
    routing.pooled = lambda s, *where: s.mean(1) if s.dim() == 3 else s  # the planted bug
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
    code = (
        "import sys, qlbench, qlbench.cli, qlbench.adapters, qlbench.experiments.experiment; "
        "print('peft' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ---------------------------------------------------------------------------------------------------------------
# One implementation of the mathematics: the tuner on the deep-narrow backbone (member 0 as plain nn.Linear layers)
# equals qlbench's own queryable adapter with the same weights, outputs and gradients, in float64.

F64 = torch.float64
SHARED = ("atoms", "keys", "block_prior", "Q_cur", "Q_dep", "Q_dep_q", "Q_dep_k", "Q_ctx", "R_ctx")


class PlainDeepNarrow(torch.nn.Module):
    """Member 0 of a stacked deep-narrow backbone as nn.Linear layers: x (N, 2) -> (N,)."""

    def __init__(self, stacked):
        super().__init__()

        def linear(s):
            s = getattr(s, "base", s)  # an adapted layer's frozen StackedLinear
            lin = torch.nn.Linear(s.weight.shape[2], s.weight.shape[1], dtype=F64)
            with torch.no_grad():
                lin.weight.copy_(s.weight[0])
                lin.bias.copy_(s.bias[0])
            return lin

        self.inp, self.head = linear(stacked.inp), linear(stacked.head)
        self.hidden = torch.nn.ModuleList(linear(layer) for layer in stacked.hidden)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.inp(x))
        for layer in self.hidden:
            h = torch.nn.functional.gelu(layer(h))
        return self.head(h).squeeze(-1)


def twin_models(**config):
    """(qlbench's queryable on a one-member deep-narrow stack, the peft tuner on its plain copy, same weights)."""
    from qlbench import adapters
    from qlbench.backbones import build_backbone
    from qlbench.seeding import generator

    cfg = adapters.get("queryable").config_cls(**config)
    ours = adapters.get("queryable").build(
        build_backbone("deep-narrow", ["hf-twin"], dtype=F64), cfg, [generator("test", "hf-twin")], None
    )
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # non-trivial weights (B and eta start at zero, the atoms small)
        for name, p in ours.named_parameters():
            if not p.requires_grad:
                continue
            z = torch.randn(p.shape, generator=g, dtype=F64)
            leaf = name.rsplit(".", 1)[-1]
            p.copy_(z * {"queryable_B": 0.3, "queryable_eta": 1.5, "atoms": 0.5}.get(leaf, 1 / p.shape[-1] ** 0.5))
    theirs = peft.get_peft_model(
        PlainDeepNarrow(ours),
        QueryableLoraConfig(
            target_modules=[f"hidden.{i}" for i in range(32)], r=cfg.r, lora_alpha=cfg.alpha, n_blocks=cfg.n_blocks,
            n_atoms=cfg.n_atoms, top_k=cfg.top_k, d_k=cfg.d_k, tau_lang=cfg.tau_lang, lambda_ctx=cfg.lambda_ctx,
            instruction_dim=cfg.instruction_dim,
        ),
    ).to(F64)  # fmt: skip
    with torch.no_grad():
        for i, layer in enumerate(ours.hidden):
            twin = theirs.base_model.model.hidden[i]
            twin.queryable_A["default"].copy_(layer.queryable_A[0])
            twin.queryable_B["default"].copy_(layer.queryable_B[0])
            twin.queryable_eta["default"].copy_(layer.queryable_eta[:1])
        memory = theirs.base_model.queryable_memory["default"]
        for name in SHARED:
            if getattr(memory, name) is not None:
                getattr(memory, name).copy_(getattr(ours.shared["queryable"], name)[0])
    return ours, theirs


def adapter_grads(ours, theirs) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    pairs = []
    for i, layer in enumerate(ours.hidden):
        twin = theirs.base_model.model.hidden[i]
        for leaf in ("queryable_A", "queryable_B"):
            pairs.append((f"{i}.{leaf}", getattr(layer, leaf).grad[0], getattr(twin, leaf)["default"].grad))
        pairs.append((f"{i}.eta", layer.queryable_eta.grad[:1], twin.queryable_eta["default"].grad))
    memory = theirs.base_model.queryable_memory["default"]
    for name in SHARED:
        if getattr(memory, name) is not None:
            pairs.append((name, getattr(ours.shared["queryable"], name).grad[0], getattr(memory, name).grad))
    return pairs


@pytest.mark.parametrize(
    "config",
    [dict(n_blocks=4, n_atoms=8, top_k=2), dict(n_blocks=3, n_atoms=6, top_k=3, instruction_dim=8, tau_lang=0.5,
     lambda_ctx=0.7)],
    ids=["state-only", "instruction"],
)  # fmt: skip
def test_the_tuner_equals_qlbenchs_adapter_on_the_deep_narrow_backbone(config):
    ours, theirs = twin_models(**config)
    g = torch.Generator().manual_seed(6)
    x = torch.rand(1, 40, 2, generator=g, dtype=F64) * 4 - 2  # (1, N, 2)
    weights = torch.randn(40, generator=g, dtype=F64)
    e = torch.randn(1, 8, generator=g, dtype=F64) if "instruction_dim" in config else None
    y_ours = ours(x, e)[0]
    y_theirs = theirs(x[0]) if e is None else theirs(x[0], instruction=e[0])
    assert (y_ours - y_theirs).abs().max() < 1e-10 * (1 + y_ours.abs().max())
    (y_ours * weights).sum().backward()
    (y_theirs * weights).sum().backward()
    for name, a, b in adapter_grads(ours, theirs):
        assert (a - b).abs().max() <= 1e-10 * (1 + a.abs().max()), name


def reference_first_block(memory, s: torch.Tensor, k: int, eps: float = 1e-6) -> torch.Tensor:
    """The paper's routing weights of block 0 (no depth term, no instruction), one sample at a time, written out:
    q = w_0 + Q_cur s; zeta_m = <RMSNorm(q), RMSNorm(k_m)> / sqrt(d_k); alpha = softmax over the k largest zeta."""
    rms = lambda v: v / torch.sqrt((v * v).mean() + eps)
    rows = []
    for si in s:
        q = memory.block_prior[0] + memory.Q_cur @ si
        zeta = torch.stack([rms(q) @ rms(key) for key in memory.keys]) / memory.keys.shape[1] ** 0.5
        top = torch.topk(zeta, k).indices
        alpha = torch.zeros_like(zeta)
        alpha[top] = torch.exp(zeta[top] - zeta[top].max()) / torch.exp(zeta[top] - zeta[top].max()).sum()
        rows.append(alpha)
    return torch.stack(rows)


def test_the_tuner_routes_as_the_reference_and_a_planted_bug_fails_it(monkeypatch):
    """Block 0's routing weights on BERT-free ground: the deep-narrow twin, against the reference above; then with
    the routing weights not renormalised over the top-k (softmax over all M atoms, zero outside the k largest)."""
    from qlbench.adapters import routing

    _, theirs = twin_models(n_blocks=4, n_atoms=8, top_k=2)
    x = torch.rand(25, 2, generator=torch.Generator().manual_seed(7), dtype=F64) * 4 - 2
    hf_routing = theirs.base_model.routing

    def block0_alpha():
        with torch.no_grad():
            s = []
            hook = theirs.base_model.model.hidden[0].register_forward_hook(
                lambda mod, inp, out: s.append(inp[0] @ mod.queryable_A["default"].T)
            )
            theirs(x)
            hook.remove()
        return hf_routing.last["default"][0].alpha[0], s[0]

    alpha, s = block0_alpha()
    memory = theirs.base_model.queryable_memory["default"]
    assert torch.allclose(alpha, reference_first_block(memory, s, 2), atol=1e-12)

    def not_renormalised(logits, k):
        top, idx = logits.topk(k, dim=-1)
        return torch.zeros_like(logits).scatter(-1, idx, logits.softmax(dim=-1).gather(-1, idx))

    monkeypatch.setattr(routing, "topk_softmax", not_renormalised)
    alpha, s = block0_alpha()
    assert not torch.allclose(alpha, reference_first_block(memory, s, 2), atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# The paper's bounds from the tuner's live modules (qlbench.hf.verify): on the deep-narrow twin they are the bounds
# qlbench's own checks report on qlbench's adapter with the same weights; on BERT every statement holds.


def summaries(bounds) -> dict:
    return {(b.label, b.quantity): b.summary() for b in bounds}


@pytest.mark.parametrize("instruction", [False, True], ids=["state-only", "instruction"])
def test_the_bounds_of_the_tuner_are_qlbenchs_bounds_on_the_same_weights(instruction):
    from qlbench.hf import verify as hf_verify
    from qlbench.theory import checks

    config = dict(n_blocks=4, n_atoms=8, top_k=2)
    if instruction:
        config |= dict(instruction_dim=8, tau_lang=0.5, lambda_ctx=0.7)
    ours, theirs = twin_models(**config)
    g = torch.Generator().manual_seed(8)
    x = torch.rand(1, 30, 2, generator=g, dtype=F64) * 4 - 2
    e = torch.randn(1, 8, generator=g, dtype=F64) if instruction else None
    a, b = summaries(checks.check_model(ours, x, e)), summaries(hf_verify.check(theirs, x, e))
    assert a.keys() == b.keys() and len(a) >= 10
    for key, row in a.items():
        other = b[key]
        assert (row["items"], row["status"]) == (other["items"], other["status"]), key
        for field in ("max_observed", "ratio"):  # the worst item's values: ties in the ratio may pick another item
            if row[field] is not None:
                assert other[field] == pytest.approx(row[field], rel=1e-9, abs=1e-12), (key, field)


def test_every_statement_holds_on_a_wrapped_bert():
    from qlbench.hf import verify as hf_verify

    model, _ = wrapped("bert", instruct=True, n_blocks=3)
    model.eval()
    batch = inputs(batch=6, tokens=9)
    x = torch.stack([batch["input_ids"], torch.ones_like(batch["input_ids"])], 1).unsqueeze(0)  # (1, N, 2, L)
    e = torch.nn.functional.normalize(torch.randn(1, 384, generator=torch.Generator().manual_seed(9)), dim=1)
    call = lambda m, xc, e_: m(input_ids=xc[:, 0].long(), attention_mask=xc[:, 1].long(), instruction=e_)
    rows = [b.summary() for b in hf_verify.check(model, x, e, call=call)]
    assert {r["label"] for r in rows} >= {"prop:app_convex_hull_bound", "cor:app_query_norm_bound"}
    assert [r for r in rows if r["status"] == "VIOLATED"] == []
    assert sum(r["items"] for r in rows) > 100


# Dtypes and checkpointing (issue 43): language-model heads, so that a loss and a training step are the real ones.


def lm(name: str, dtype: torch.dtype = torch.float32, seed: int = 0, **peft_kw):
    """A tiny GPT-2 or Llama causal LM in `dtype`, wrapped (B drawn non-zero; three blocks, so that the depth
    attention is not constant), in training mode."""
    torch.manual_seed(seed)
    if name == "gpt2":
        c = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=D, n_layer=LAYERS, n_head=2, bos_token_id=0, eos_token_id=0
        )
        base, targets = transformers.GPT2LMHeadModel(c), ["c_attn"]
    else:
        c = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=2,
            intermediate_size=64,
        )  # fmt: skip
        base, targets = transformers.LlamaForCausalLM(c), ["q_proj", "v_proj"]
    config = QueryableLoraConfig(target_modules=targets, r=4, n_atoms=8, top_k=2, n_blocks=3)
    model = peft.get_peft_model(base.to(dtype), config, **peft_kw)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "queryable_B" in n:
                p.normal_(0, 0.2)
    return model.train()


def memory_parameters(model) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in model.named_parameters() if "queryable_memory" in n]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_half_precision_base_model_trains_and_infers(dtype):
    """peft's autocast-adapter-dtype rule (on by default) upcasts the adapter to float32: the memory too, so that the
    layers' float32 rank states meet float32 atoms; with the rule off everything stays in the base's dtype. Either
    way a training step moves the memory and the loss stays finite."""
    x = inputs()["input_ids"]
    for autocast, want in [(True, torch.float32), (False, dtype)]:
        model = lm("gpt2", dtype, autocast_adapter_dtype=autocast)
        assert {p.dtype for n, p in model.named_parameters() if p.requires_grad} == {want}
        assert model.get_base_model().transformer.h[0].attn.c_attn.base_layer.weight.dtype == dtype
        optimiser = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        out = model(input_ids=x, labels=x)
        assert out.logits.dtype == dtype and torch.isfinite(out.loss)
        out.loss.backward()
        memory = memory_parameters(model)
        assert memory and all(p.grad is not None and torch.isfinite(p.grad).all() and p.grad.any() for _, p in memory)
        before = {n: p.detach().clone() for n, p in memory}
        optimiser.step()
        assert any(not torch.equal(p, before[n]) for n, p in memory)
        with torch.no_grad():
            assert torch.isfinite(model.eval()(input_ids=x, labels=x).loss)


def grads_of(model, *batches) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient after the forwards of `batches` and then their backwards."""
    losses = [model(input_ids=x, labels=x, use_cache=False).loss for x in batches]
    for loss in losses:
        loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_gradient_checkpointing_gives_the_gradients_without_it(name, reentrant):
    """Every layer checkpointed: the memory and adapter gradients equal those without checkpointing, also when two
    forwards run before their two backwards (each layer's recomputation routes with its own forward's state)."""
    x, y = inputs(seed=1)["input_ids"], inputs(seed=2)["input_ids"]
    for batches in [(x,), (x, y)]:
        want = grads_of(lm(name), *batches)
        model = lm(name)
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers 5; before, the old name
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        assert model.get_base_model().is_gradient_checkpointing
        with pytest.warns(UserWarning, match="non-reentrant") if reentrant else contextlib.nullcontext():
            got = grads_of(model, *batches)
        assert got.keys() == want.keys() and any("queryable_memory" in n for n in got)
        missing = [n for n, g in got.items() if g is None]
        assert missing == []
        for n, g in got.items():
            torch.testing.assert_close(g, want[n], rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
