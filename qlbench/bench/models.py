"""What `qlbench bench` times: qlbench's stacks of E members and their batches, the plain PyTorch loop a user would
write (deep-narrow + LoRA on nn.Linear), and the kernel floor of a stacked LoRA step (its kernels and nothing
else)."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from qlbench import adapters, zoo
from qlbench.adapters.base import adamw
from qlbench.backbones import build_backbone
from qlbench.bench.timing import BATCH
from qlbench.engine.budgets import BUDGETS
from qlbench.seeding import generator
from qlbench.stacked import bmm_add, stacked_linear

# Not a method: the backbones' source pretraining (engine.cache.pretrain: every weight trained with AdamW at the paper
# budget's pretraining rate), which a paper table runs once per arch, for every member, before any method adapts. It is
# timed as a stack of its own, so that the paper-table estimate counts it (its `pretraining` row).
PRETRAINING = "pretraining"


def stacked_model(
    arch: str, method_name: str, members: int, device, tasks: int = 1, **overrides
) -> tuple[nn.Module, object]:
    """A randomly initialised stack with the method `method_name` built on it, and its optimizer (throughput does
    not depend on the values; `run` flushes denormals so tiny values do not slow the CPU). `tasks`: a
    task-conditioned method's task count (a suite's); `overrides`: config fields, where the method has them."""
    return stacked_copies(arch, method_name, members, device, 1, tasks, **overrides)[0]


def stacked_copies(
    arch: str, method_name: str, members: int, device, n: int, tasks: int = 1, **overrides
) -> list[tuple[nn.Module, object]]:
    """n equal stacks as `stacked_model` builds them, each with its own optimizer: drawn once and copied (drawing a
    Transformer stack of 45 members takes seconds on the host, member by member; a copy, far less)."""
    keys = [("bench", e) for e in range(members)]
    if method_name == PRETRAINING:  # the backbone itself, every weight trained, as engine.cache.pretrain does
        phase = BUDGETS[arch]["paper"].pretrain
        models = [build_backbone(arch, keys, device=device)]
        models += [copy.deepcopy(models[0]) for _ in range(n - 1)]
        return [(m, adamw(m.parameters(), phase.lr, phase.weight_decay)) for m in models]
    method = adapters.get(method_name)
    config = method.make_config(**({"tasks": tasks} if method.kind == "task" else {}), **overrides)
    y = torch.zeros(members, BATCH, device=device)
    model = method.build(
        build_backbone(arch, keys, device=device), config, [generator("init", "bench", method_name, k) for k in keys], y
    )
    # what depends on the members beyond their data (instruct-queryable's e(c)): a real function's, member by member
    functions = [zoo.names()[e % len(zoo.names())] for e in range(members)]
    method.bind(model, [(f, e) for f, (_, e) in zip(functions, keys)], config)
    models = [model] + [copy.deepcopy(model) for _ in range(n - 1)]
    return [(m, method.optimizer(m, config, 5e-4, 0.01) if method.trains else None) for m in models]


def batches(members: int, device, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.rand(members, BATCH, 2, generator=g).to(device), torch.rand(members, BATCH, generator=g).to(device))
        for _ in range(n)
    ]


class PlainLoraLinear(nn.Module):
    """The textbook LoRA layer on nn.Linear (loralib style), for the plain PyTorch loop."""

    def __init__(self, base: nn.Linear, r: int = 8, alpha: float = 16.0):
        super().__init__()
        self.base, self.scale = base, alpha / r
        self.A = nn.Parameter(torch.empty(r, base.in_features).uniform_(-1, 1) / math.sqrt(base.in_features))
        self.B = nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x):
        return self.base(x) + self.scale * F.linear(F.linear(x, self.A), self.B)


def plain_deep_narrow_lora() -> tuple[nn.Module, torch.optim.Optimizer]:
    """deep-narrow + LoRA written the usual way: nn.Sequential of nn.Linear, PyTorch's default AdamW."""
    layers = [nn.Linear(2, 32), nn.GELU()]
    for _ in range(32):
        layers += [PlainLoraLinear(nn.Linear(32, 32)), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(32, 1))
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith((".A", ".B")))
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-4)


def plain_step(model, opt):
    def step(xb, yb):  # xb (1, b, 2): one member
        loss = (model(xb[0]).squeeze(-1) - yb[0]).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def lora_floor_step(model: nn.Module, opt: torch.optim.Optimizer, *, compile: bool = False):
    """The kernels a training step of a stacked deep-narrow LoRA model must run, and nothing else: the forward and
    its backward written out as tensor ops (merged weights W0 + s B A, as the engine merges them), then one fused
    AdamW update with `opt`'s settings. No autograd graph and no per-parameter optimizer bookkeeping (one shared step
    count instead of one per tensor); with `compile`, the forward and backward are one torch.compile'd function, so
    Inductor fuses them as it fuses the engine's compiled step. It updates `model`'s LoRA factors exactly as
    `engine.make_step` with `opt` does (tests/test_bench.py), so its rate is what an engine on these kernels
    would reach if the kernels were its only cost: the "kernel floor" of the stacks measured against the plain
    loop (measured, not a proven bound). step(xb (E, b, 2), yb (E, b)); returns nothing."""
    layers = list(model.hidden)
    params = [p for layer in layers for p in (layer.lora_A, layer.lora_B)]  # A_0, B_0, A_1, ...
    (group,) = opt.param_groups
    state = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]  # exp_avg, exp_avg_sq
    count = torch.zeros((), dtype=torch.float32, device=params[0].device)  # the shared step count

    def gradients(xb: torch.Tensor, yb: torch.Tensor) -> list[torch.Tensor]:  # [dL/dA_0, dL/dB_0, dL/dA_1, ...]
        inp, head = model.inp, model.head
        h = [F.gelu(stacked_linear(xb, inp.weight, inp.bias))]  # (E, b, 32)
        pre, W = [], []
        for layer in layers:
            W.append(bmm_add(layer.base.weight, layer.lora_B, layer.lora_A, alpha=layer.scale))  # (E, 32, 32)
            pre.append(stacked_linear(h[-1], W[-1], layer.base.bias))
            h.append(F.gelu(pre[-1]))
        out = stacked_linear(h[-1], head.weight, head.bias)  # (E, b, 1)
        g = (out.squeeze(-1) - yb).mul(2.0 / yb.shape[1]).unsqueeze(-1)  # d(sum of member means)/d out
        g = torch.bmm(g, head.weight)  # (E, b, 32)
        grads = [None] * len(params)
        for i in reversed(range(len(layers))):
            g = torch.ops.aten.gelu_backward(g, pre[i])
            gW = torch.bmm(g.transpose(1, 2), h[i]).mul(layers[i].scale)  # s dL/dW
            grads[2 * i] = torch.bmm(layers[i].lora_B.transpose(1, 2), gW)  # dL/dA = s B^T dL/dW
            grads[2 * i + 1] = torch.bmm(gW, layers[i].lora_A.transpose(1, 2))  # dL/dB = s dL/dW A^T
            if i:
                g = torch.bmm(g, W[i])
        return grads

    if compile:
        torch._dynamo.reset()  # as engine.compiled: a fresh in-process cache, below the recompile limit
        gradients = torch.compile(gradients, dynamic=False)

    @torch.no_grad()
    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        grads = gradients(xb, yb)
        count.add_(1)
        torch._fused_adamw_(
            params, grads, *state, [], [count] * len(params),
            lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1], weight_decay=group["weight_decay"],
            eps=group["eps"], amsgrad=False, maximize=False,
        )  # fmt: skip

    return step


def hf_step(method: str, device):
    """One training step of the causal-LM experiment's decoder (qlbench/experiments/real_lm.py) with `method`'s peft
    adapter (lora, queryable, instruct-queryable): forward with the labels (transformers' next-token loss), backward,
    AdamW, on a fixed batch of 32 sequences of 13 tokens; the loop a peft user writes, as the plain PyTorch loop above
    is."""
    from qlbench import instructions
    from qlbench.experiments import real_lm

    ids = real_lm.sequences("reverse", 32, 0, "train").to(device)
    model = real_lm.adapted(method, real_lm.decoder(0), real_lm.LMConfig()).to(device).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    e = instructions.embed(list(real_lm.INSTRUCTIONS[:1])).to(device).expand(len(ids), -1)  # (32, 384)
    kw = {"instruction": e} if method == "instruct-queryable" else {}

    def step() -> None:
        model(input_ids=ids, labels=ids, use_cache=False, **kw).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def hf_generate(method: str, device):
    """Greedy decoding with the KV cache on the causal-LM experiment's decoder with `method`'s peft adapter, as
    real-lm scores its answers: the 32 prompts BOS x SEP (7 tokens) of `hf_step`'s batch, 6 new tokens (the answer
    and EOS), no grad."""
    from qlbench import instructions
    from qlbench.experiments import real_lm

    prompts = real_lm.sequences("reverse", 32, 0, "train")[:, : real_lm.LENGTH + 2].to(device)  # (32, 7)
    model = real_lm.adapted(method, real_lm.decoder(0), real_lm.LMConfig()).to(device).eval()
    e = instructions.embed(list(real_lm.INSTRUCTIONS[:1])).to(device).expand(len(prompts), -1)  # (32, 384)
    kw = {"instruction": e} if method == "instruct-queryable" else {}
    tokens = dict(max_new_tokens=real_lm.LENGTH + 1, min_new_tokens=real_lm.LENGTH + 1, do_sample=False)

    def generate() -> None:
        with torch.no_grad():
            model.generate(input_ids=prompts, pad_token_id=real_lm.PAD, use_cache=True, **tokens, **kw)

    return generate
