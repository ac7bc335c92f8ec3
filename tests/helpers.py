"""Helpers shared by the test modules (imported as `helpers`: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import types

import torch

from qlbench import adapters, backbones, cli
from qlbench.adapters.base import Site
from qlbench.backbones import DeepNarrowConfig, Target, TransformerConfig
from qlbench.seeding import generator
from qlbench.stacked import ForwardContext, StackedLinear

F64 = torch.float64
TINY_DEEP_NARROW = DeepNarrowConfig(depth=4)
TINY_TRANSFORMER = TransformerConfig(d_model=32, n_layers=4, n_heads=4, d_ff=64)


def gens(*tag, members=2) -> list[torch.Generator]:
    """One seeded generator per member: `members` an int n (members 0..n-1) or the member keys."""
    keys = range(members) if isinstance(members, int) else members
    return [generator("test", *tag, e) for e in keys]


def one_line_error(capsys, argv: list[str]) -> str:
    """Run the CLI, check it failed with exit code 2 and one stderr line (no traceback); return that line."""
    code = cli.main(argv)
    _, err = capsys.readouterr()
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def fail_adapting(monkeypatch, failing: str) -> None:
    """Make `engine.adapt` raise RuntimeError("planted failure") for the method `failing`; the others train."""
    from qlbench import engine

    adapt = engine.adapt

    def planted(pre, adaptation, *args, **kwargs):
        if adaptation.method == failing:
            raise RuntimeError("planted failure")
        return adapt(pre, adaptation, *args, **kwargs)

    monkeypatch.setattr(engine, "adapt", planted)


# ---------------------------------------------------------------------------------------------------------------
# Layer-level comparisons (peft, per-sample references): a few adapted layers of one (role, shape) outside a backbone.


class PeftNet(torch.nn.Module):
    """`layers.{i}.fc`, tanh between: one target suffix and one shape, so peft's shared tuners (VB-LoRA's bank,
    Lily's experts) serve all the layers."""

    def __init__(self, d: int, n_layers: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(n_layers))
        for block in self.layers:
            block.fc = torch.nn.Linear(d, d, dtype=F64)

    def forward(self, x):
        for block in self.layers:
            x = torch.tanh(block.fc(x))
        return x


def adapted_layers(name: str, d: int, linears, **overrides):
    """The registered method's shared module and layers, as inject builds them, around E = 1 float64
    StackedLinears holding `linears` [(W, b), ...] (role "hidden", layers 0..n-1). Returns (shared, layers, forward),
    forward: x (..., d) -> (..., d) through the layers with tanh between (PeftNet's function)."""
    method = adapters.get(name)
    config, n = method.make_config(**overrides), len(linears)
    gens1 = [torch.Generator().manual_seed(1)]
    bases = torch.nn.ModuleDict({f"l{i}": StackedLinear(d, d, gens1, dtype=F64) for i in range(n)})
    sites = [Site(Target(f"l{i}", "hidden", i), i, n) for i in range(n)]
    shared = torch.nn.ModuleDict()
    if method.shared_cls is not None:
        shared[method.family] = method.shared_cls(bases, sites, config, gens1, bases["l0"].weight)
    layers = [method.layer_cls(bases[f"l{i}"], sites[i], config, gens1) for i in range(n)]
    with torch.no_grad():
        for layer, (W, b) in zip(layers, linears):
            layer.base.weight.copy_(W.unsqueeze(0))
            layer.base.bias.copy_(b.unsqueeze(0))

    def forward(x):
        h, ctx = x.unsqueeze(0), ForwardContext(shared)
        for layer in layers:
            h = torch.tanh(layer(h, ctx))
        return h[0]

    return shared, layers, forward


def outputs_and_gradients(forward, params: dict, x: torch.Tensor, upstream: torch.Tensor):
    """forward(x), the gradient of <forward(x), upstream> with respect to x and to each of `params`."""
    x = x.clone().requires_grad_(True)
    for p in params.values():
        p.grad = None
    y = forward(x)
    (y * upstream).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in params.items()}


def trainable_ratio_to_lora(name: str, arch: str) -> float:
    """The method's default trainable count over LoRA r = 8's, on the full-size backbone."""
    counts = []
    for method in (adapters.get(name), adapters.get("lora")):
        model = method.build(backbones.build_backbone(arch, [0]), method.make_config(), [torch.Generator()], None)
        counts.append(adapters.trainable_parameter_count(model))
    return counts[0] / counts[1]


def peft_decoder(kind: str = "gpt2", *, causal=None, task_type="CAUSAL_LM"):
    """A tiny GPT-2 (target c_attn) or Llama (q_proj, v_proj) LM with an instruct-queryable adapter (d_c = 8, r = 4,
    4 atoms, top-2, 2 blocks) that does something: its B and memory drawn at 0.3, not B = 0. Needs the hf extra."""
    import peft
    import transformers

    from qlbench.hf import InstructQueryableLoraConfig

    torch.manual_seed(0)
    if kind == "gpt2":
        c = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0)
        model, targets = transformers.GPT2LMHeadModel(c), ["c_attn"]
    else:
        c = transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            vocab_size=100, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        model, targets = transformers.LlamaForCausalLM(c), ["q_proj", "v_proj"]
    config = InstructQueryableLoraConfig(target_modules=targets, r=4, n_atoms=4, top_k=2, n_blocks=2,
                                         instruction_dim=8, task_type=task_type, causal=causal)  # fmt: skip
    model = peft.get_peft_model(model, config).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "queryable_B" in n or "queryable_memory" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


class ReplayByRerun:
    """A CPU stand-in for CUDA graphs (engine/step.py `CudaGraphs`): a recording runs the body on a snapshot of what
    it changes and restores it (a CUDA recording records kernels without running them: it does not train), and each
    replay runs the body again and writes its outputs into the recorded ones, as a graph's replay rewrites the
    recording's memory. It checks the captured step's bookkeeping (warm-up per batch shape, the recorded gradients,
    the update recorded or eager after the replay, release at the end of a stage), not CUDA itself."""

    def __init__(self, device):
        self.recorded = 0

    def warm_up(self):
        return contextlib.nullcontext()

    def record(self, body, params, optimizer):
        self.recorded += 1
        saved = [p.detach().clone() for p in params]
        state = copy.deepcopy(optimizer.state_dict()) if isinstance(optimizer, torch.optim.Optimizer) else None
        # soap.StackedSoap: its tensors restored in place (a recorded update reads them), its step count kept
        tensors = optimizer.tensors() if hasattr(optimizer, "tensors") else []
        kept = [t.clone() for t in tensors]
        out = body()
        with torch.no_grad():
            for p, v in zip(params + tensors, saved + kept):
                p.copy_(v)
        if state is not None:
            optimizer.load_state_dict(state)

        def replay():
            loss, grads = body()
            if loss is not None:  # a recording with no output of its own (the eigenbases refresh)
                out[0].copy_(loss)
            for old, new in zip(out[1], grads):
                if old is not None:
                    old.copy_(new)

        return types.SimpleNamespace(replay=replay), out


# `python -c SYNCING DEVICE on|off`: a tiny stack whose forward reads a value back to the host (`.item()`), which a
# CUDA graph cannot record, trained for 5 epochs (recorded at epoch 4 when capture is on). Exit 3 and the error's
# message on stdout when training raises a RuntimeError, 0 when it trains. tests/test_cuda.py runs it captured on
# CUDA; tests/test_engine.py runs it eagerly on the CPU, so the script itself cannot rot unseen.
SYNCING = """
import sys
import torch
from qlbench import engine
from qlbench.adapters.base import adamw

device, capture = sys.argv[1], sys.argv[2] == "on"


class Syncing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2, 1, 2, device=device))

    def forward(self, x, instruction=None, task=None):
        return (x * self.w).sum(-1) * (1.0 if self.w.sum().item() > 0 else -1.0)


model = Syncing()
data = engine.StackedData(*(torch.rand(2, 100, *s, device=device) for s in ((2,), (), (2,), ())))
optimizer = lambda: adamw(model.parameters(), 1e-3, 0.0)
order = [torch.Generator().manual_seed(e) for e in range(2)]
stage = engine.Stage(data, engine.Phase(5, 1e-3), optimizer, order, eval_every=5)
try:
    engine.fit(model, [stage], capture=capture)
except RuntimeError as err:
    print(err)
    raise SystemExit(3)
"""


def settings(**kw) -> dict:
    """A plan's keywords from flat ones: the fields of Protocol go into protocol=, those of Execution into
    execution=, the rest (functions, methods, overrides, ...) pass through (for tests that vary a few settings)."""
    from qlbench.settings import Execution, Protocol

    if given := {"protocol", "execution"} & kw.keys():
        raise TypeError(f"settings() takes the settings flat, not {' or '.join(sorted(given))}=")
    protocol, execution = ({f.name for f in dataclasses.fields(c)} for c in (Protocol, Execution))
    return {k: v for k, v in kw.items() if k not in protocol | execution} | dict(
        protocol=Protocol(**{k: v for k, v in kw.items() if k in protocol}),
        execution=Execution(**{k: v for k, v in kw.items() if k in execution}),
    )


def table_differences(made: str, committed: str, suffix: str) -> list[str]:
    """Where a rebuilt table's text differs from the committed one's, one phrase each ([] when they agree). Markdown
    and LaTeX compare byte for byte (they show a few digits); a CSV compares cell by cell, its numbers to the digits
    that it states (text.CSV_DIGITS significant digits: a relative difference below 1e-9, and inf and NaN alike), so
    that a table that one machine wrote is rebuilt on another whose floating-point paths differ in the last bits."""
    if suffix != ".csv":
        return [] if made == committed else ["text differs"]
    import io
    import math

    import pandas as pd

    read = lambda s: pd.read_csv(io.StringIO(s), dtype=str, keep_default_na=False)
    a, b = read(made), read(committed)
    if list(a.columns) != list(b.columns) or a.shape != b.shape:
        return [f"columns or shape differ: {list(a.columns)} {a.shape} vs {list(b.columns)} {b.shape}"]
    out = []
    for col in a.columns:
        for i, (x, y) in enumerate(zip(a[col], b[col])):
            if x == y:
                continue
            try:
                fx, fy = float(x), float(y)
            except ValueError:
                out.append(f"row {i} {col}: {x!r} vs {y!r}")
                continue
            same = (math.isnan(fx) and math.isnan(fy)) or math.isclose(fx, fy, rel_tol=1e-9, abs_tol=1e-300)
            if not same:
                out.append(f"row {i} {col}: {x} vs {y}")
    return out
