"""The peft tuner: shared memory and router per adapter, blocks in the model's layer order, per-forward state.

What peft's API does not express, and how this tuner does it (docs/hf.md):
- *State carried across layers.* peft's layers are independent modules; Queryable LoRA's block b routes from its
  entry rank state and from summaries of the blocks before it. The tuner keeps a per-forward `Routing` state that
  every adapted layer of an adapter shares, reset by a forward pre-hook on the wrapped model before each forward.
- *The instruction per call.* That pre-hook also takes an `instruction=` keyword (a (d_c,) or (batch, d_c) tensor)
  out of the model's keywords before the model sees it, and the attention mask, whose padding the token average of
  a rank state skips. `set_instruction` binds one per adapter.
- *A memory shared by all layers.* Each adapter's atoms, keys and router parameters are one `QueryableMemory` in
  the tuner's `queryable_memory` ModuleDict (saved once, as peft saves tuner-level containers). peft's
  autocast-adapter-dtype rule (float16/bfloat16 adapter weights upcast to float32) covers it as it covers A and B.
- *Checkpointing.* A block's operator and the layers' pooled states cross the model's layers, so they cross the
  checkpointed segments: the pre-hook runs transformers' checkpointing non-reentrant (reentrant checkpointing
  cannot differentiate through a tensor that one segment makes and another uses) and recomputes each segment in
  the routing state of its own forward, the layer that routed a block routing it again (`Recompute`).
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer

from qlbench.adapters.queryable import block_of, memory_shapes, route_with
from qlbench.adapters.routing import Route
from qlbench.hf.layer import Linear, QueryableLoraLayer, features


class QueryableMemory(nn.Module):
    """One adapter's atoms C_m (M, r, r), keys k_m (M, d_k), block priors w_b (B, d_k) and router matrices, with
    qlbench's initialisation (qlbench.adapters.queryable.QueryableMemory, drawn from torch's global generator)."""

    def __init__(self, config):
        super().__init__()
        self.Q_ctx = self.R_ctx = None  # without instruction channels
        for name, (shape, std) in memory_shapes(config).items():
            setattr(self, name, nn.Parameter(torch.randn(*shape) * std))
        self.config = config


class MemoryView:
    """A tuner memory as a one-member stack: every parameter (1, ...) as qlbench's QueryableMemory holds them, its
    config, and `route` (qlbench.adapters.queryable.route_with)."""

    NAMES = ("atoms", "keys", "block_prior", "Q_cur", "Q_dep", "Q_dep_q", "Q_dep_k", "Q_ctx", "R_ctx")

    def __init__(self, memory: QueryableMemory):
        for name in self.NAMES:
            value = getattr(memory, name)
            setattr(self, name, None if value is None else value.unsqueeze(0))
        self.config = memory.config

    def route(self, block: int, s_entry, summaries, instruction) -> Route:
        """s_entry (1, N, r), summaries (1, N, P, r) or None, instruction (1, d_c), (1, N, d_c) or None."""
        return route_with(self, block, s_entry, summaries, instruction)


@dataclass
class ForwardState:
    """One forward's routing scratch, per adapter: each block's pooled rank states and its routed operator; with
    causal routing, each layer's running sums over the tokens so far (what a KV-cached next forward continues)."""

    states: dict[str, dict[int, list[torch.Tensor]]] = field(default_factory=dict)  # adapter -> block -> [(N, r)]
    operators: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)  # adapter -> block -> (b, [T,] r, r)
    mask: torch.Tensor | None = None  # (batch, T) attention mask of this forward, if the model was given one
    instruction: torch.Tensor | None = None  # (d_c,) or (batch, d_c) given to this forward
    routers: dict[str, dict[int, int]] = field(default_factory=dict)  # adapter -> block -> id of the routing layer
    # causal routing: (adapter, layer id) -> (sum of masked rank states (b, r), token weight (b, 1)) before this
    # forward (a KV cache's tokens) and after it; `positions`: the token positions covered after it
    carry_in: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    carry_out: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    positions: int = 0


class Routing:
    """What the adapted layers of a tuner share: the memories, each adapter's bound instruction, and the state of the
    forward in progress. A plain object (not an nn.Module), so that no layer registers the memories again."""

    def __init__(self, memories: nn.ModuleDict):
        self.memories = memories
        self.instructions: dict[str, torch.Tensor] = {}
        self.state = ForwardState()
        self.recomputing = False  # a checkpointed segment is being recomputed (backward): the forward is replayed
        self.last: dict[str, dict] = {}  # adapter -> block -> Route of the last forward (inspection, tests)

    def causal(self, adapter: str) -> bool:
        return bool(self.memories[adapter].config.causal)

    def pooled(self, s: torch.Tensor, adapter: str, layer: int) -> torch.Tensor:
        """A rank state per sequence: s (batch, T, r) averaged over its tokens (the mask's padding skipped, when the
        forward had a mask of the same shape), or s (batch, r) itself. With causal routing, one per token
        (batch, T, r): the average over the tokens up to it, a KV cache's earlier tokens included (the running sums
        this layer left after the previous forward of the generation)."""
        if s.dim() == 2:
            return s
        mask = self.state.mask
        if not self.causal(adapter):
            if mask is None or mask.shape != s.shape[:2]:
                return s.mean(1)
            w = mask.to(s.dtype).unsqueeze(-1)  # (batch, T, 1)
            return (s * w).sum(1) / w.sum(1).clamp_min(1.0)
        T = s.shape[1]
        fits = mask is not None and mask.dim() == 2 and mask.shape[0] == s.shape[0] and mask.shape[1] >= T
        w = mask[:, -T:].to(s.dtype).unsqueeze(-1) if fits else torch.ones_like(s[..., :1])  # (batch, T, 1)
        total, weight = (s * w).cumsum(1), w.cumsum(1)  # (batch, T, r), (batch, T, 1)
        if (adapter, layer) in self.state.carry_in:
            before, seen = self.state.carry_in[adapter, layer]
            total, weight = total + before.unsqueeze(1), weight + seen.unsqueeze(1)
        if not self.recomputing:
            self.state.carry_out[adapter, layer] = total[:, -1], weight[:, -1]
        return total / weight.clamp_min(1.0)

    def reorder(self, rows: torch.Tensor) -> None:
        """Reorder the running sums' rows as a beam search reorders its KV cache."""
        carry = self.state.carry_out
        for key, (total, weight) in carry.items():
            carry[key] = total.index_select(0, rows.to(total.device)), weight.index_select(0, rows.to(weight.device))

    def operator(self, adapter: str, block: int, s: torch.Tensor, layer: int) -> torch.Tensor:
        """S_b (batch, r, r) for this adapter's block, routed by the first layer of the block to run in this forward
        (from its rank state s and the summaries of the blocks before it); every layer's pooled state is recorded.
        `layer` names the calling layer (its id): in a checkpoint's recomputation the layer that routed the block
        routes it again, as it did in the forward, and nothing is recorded (the forward's state stands)."""
        memory = self.memories[adapter]
        state = self.state
        pooled = self.pooled(s, adapter, layer).to(memory.atoms.dtype)  # (batch, [T,] r), the memory's dtype
        shape = pooled.shape[:-1]  # (batch,), or (batch, T): a route per token
        pooled = pooled.reshape(-1, pooled.shape[-1])  # (N, r), the rows routed
        states = state.states.setdefault(adapter, {})
        operators = state.operators.setdefault(adapter, {})
        routers = state.routers.setdefault(adapter, {})
        per = lambda S: S.reshape(*shape, *S.shape[-2:])  # (N, r, r) -> (batch, [T,] r, r)
        if self.recomputing:
            return (
                per(self.route(adapter, block, pooled, shape[0]).S[0])
                if routers.get(block) == layer
                else operators[block]
            )
        if block not in operators:
            r = self.route(adapter, block, pooled, shape[0])
            operators[block], routers[block] = per(r.S[0]), layer  # (batch, [T,] r, r)
            self.last.setdefault(adapter, {})[block] = r
        states.setdefault(block, []).append(pooled)
        return operators[block]

    def route(self, adapter: str, block: int, pooled: torch.Tensor, batch: int) -> Route:
        """The block's Route from the routing layer's pooled states (N, r) (N = batch, or batch x T tokens with
        causal routing) and the summaries of the blocks before it (each the mean of its layers' pooled states)."""
        states = self.state.states.get(adapter, {})
        earlier = [b for b in range(block) if b in states]
        summaries = (
            torch.stack([torch.stack(states[b]).mean(0) for b in earlier], dim=1).unsqueeze(0) if earlier else None
        )  # (1, N, P, r)
        instruction = self.instruction(adapter, pooled, batch)
        return MemoryView(self.memories[adapter]).route(block, pooled.unsqueeze(0), summaries, instruction)

    def instruction(self, adapter: str, pooled: torch.Tensor, batch: int) -> torch.Tensor | None:
        """(1, d_c) or (1, N, d_c): the forward's instruction, else the adapter's bound one, else None (an error
        when the adapter's instruction channels are on); a (batch, d_c) one repeated for each row's tokens."""
        c = self.memories[adapter].config
        e = self.state.instruction if self.state.instruction is not None else self.instructions.get(adapter)
        if e is None:
            if c.tau_lang or c.lambda_ctx:
                raise ValueError(
                    f"adapter {adapter!r} routes on an instruction: pass instruction=e (a ({c.instruction_dim},) or "
                    f"(batch, {c.instruction_dim}) tensor) to the forward, or call set_instruction"
                )
            return None
        e = e.to(device=pooled.device, dtype=pooled.dtype)
        if e.shape[-1] != c.instruction_dim or e.dim() > 2 or (e.dim() == 2 and e.shape[0] != batch):
            raise ValueError(
                f"instruction of shape {tuple(e.shape)}: adapter {adapter!r} wants ({c.instruction_dim},) or "
                f"({batch}, {c.instruction_dim})"
            )
        if e.dim() == 2 and pooled.shape[0] != batch:  # a route per token: each token its row's instruction
            e = e.repeat_interleave(pooled.shape[0] // batch, 0)
        return e.unsqueeze(0)


class Recompute:
    """The context a checkpointed segment is recomputed in (torch.utils.checkpoint's `context_fn`): the routing
    state of the forward that ran the segment (captured when it ran, so forwards may run before their backwards),
    with `recomputing` set. Composed with a `context_fn` the caller gave."""

    def __init__(self, routing: Routing, inner: contextlib.AbstractContextManager):
        self.routing, self.state, self.inner = routing, routing.state, inner

    def __enter__(self):
        self.saved = self.routing.state, self.routing.recomputing
        self.routing.state, self.routing.recomputing = self.state, True
        return self.inner.__enter__()

    def __exit__(self, *exc):
        self.routing.state, self.routing.recomputing = self.saved
        return self.inner.__exit__(*exc)


def routed_checkpoint(routing: Routing, checkpoint: functools.partial) -> functools.partial:
    """transformers' checkpoint function (a partial of torch's `checkpoint`), made non-reentrant and replaying the
    routing state of its forward in the recomputation."""
    keywords = dict(checkpoint.keywords)
    user = keywords.get("context_fn")

    def context_fn():
        forward, recompute = user() if user is not None else (contextlib.nullcontext(), contextlib.nullcontext())
        return forward, Recompute(routing, recompute)

    keywords.update(use_reentrant=False, context_fn=context_fn)
    wrapped = functools.partial(checkpoint.func, *checkpoint.args, **keywords)
    wrapped.queryable_routing, wrapped.queryable_original = routing, checkpoint
    return wrapped


CACHE_KEYWORDS = ("cache", "past_key_values")  # transformers 5's name for a KV cache, and the older one


def is_causal_lm(model: nn.Module, config) -> bool:
    """Whether causal routing is the default: peft's task_type CAUSAL_LM, or a transformers causal-LM class
    (`...ForCausalLM`, GPT-2's `GPT2LMHeadModel`)."""
    name = type(model).__name__
    return str(getattr(config, "task_type", None)) in ("CAUSAL_LM", "TaskType.CAUSAL_LM") or name.endswith(
        ("ForCausalLM", "LMHeadModel")
    )


def layer_index(module_name: str) -> int | None:
    """The layer a module belongs to: the first integer component of its path (`encoder.layer.3.attention` -> 3)."""
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", module_name)
    return None if match is None else int(match.group(1))


class QueryableLoraModel(BaseTuner):
    """Queryable LoRA over a transformers model (or any nn.Module with nn.Linear layers); see the module docstring."""

    prefix: str = "queryable_"
    tuner_layer_cls = QueryableLoraLayer
    target_module_mapping = {}  # no defaults: target_modules is required

    def _pre_injection_hook(self, model: nn.Module, config, adapter_name: str) -> None:
        """The adapter's memory (once: peft calls this hook from __init__, and `inject_adapter` calls it for adapters
        added later), and the tuner's forward pre-hook. Encoder-decoder models are refused (see docs/hf.md)."""
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            raise ValueError(
                "queryable_lora does not support encoder-decoder models: one routing state per forward spans "
                "the layers in order, while the decoder runs without the encoder at each generated token "
                "(use a decoder-only or encoder-only model)"
            )
        if config.causal is None:  # qlbench interpretation: causal routing is the default for causal LMs
            config.causal = is_causal_lm(model, config)
        if not hasattr(self, "queryable_memory"):
            self.queryable_memory = nn.ModuleDict({})
            self.routing = Routing(self.queryable_memory)
        if getattr(self, "_hook", None) is None:
            self._hook = model.register_forward_pre_hook(self._begin_forward, with_kwargs=True)
        if adapter_name not in self.queryable_memory:
            self.queryable_memory[adapter_name] = QueryableMemory(config)

    def inject_adapter(self, model: nn.Module, adapter_name: str, **kwargs) -> None:
        """peft's injection, with this tuner's pre- and post-injection hooks around it: peft calls those hooks only
        from __init__, while `add_adapter` and `load_adapter` (a second adapter) call only `inject_adapter`."""
        self._pre_injection_hook(model, self.peft_config[adapter_name], adapter_name)
        try:
            super().inject_adapter(model, adapter_name, **kwargs)
        except Exception:
            if adapter_name in self.queryable_memory:
                del self.queryable_memory[adapter_name]
            raise
        self._post_injection_hook(model, self.peft_config[adapter_name], adapter_name)

    def _sync_memory_grad(self) -> None:
        """Each adapter's memory requires grad exactly when its layers' A does (peft sets the layers' flags by the
        active adapters and inference_mode; the memory, held by the tuner, is not one of peft's layers)."""
        flags: dict[str, bool] = {}
        for m in self.model.modules():
            if isinstance(m, QueryableLoraLayer):
                for name, p in m.queryable_A.items():
                    flags[name] = flags.get(name, False) or p.requires_grad
        for name, memory in getattr(self, "queryable_memory", {}).items():
            memory.requires_grad_(flags.get(name, False))

    def set_adapter(self, adapter_name, inference_mode: bool = False) -> None:
        super().set_adapter(adapter_name, inference_mode=inference_mode)
        self._sync_memory_grad()

    def set_requires_grad(self, adapter_names, requires_grad: bool = True) -> None:
        super().set_requires_grad(adapter_names, requires_grad=requires_grad)
        self._sync_memory_grad()

    def _mark_only_adapters_as_trainable(self, model: nn.Module) -> None:
        super()._mark_only_adapters_as_trainable(model)
        self._sync_memory_grad()

    def delete_adapter(self, adapter_name: str) -> None:
        """peft's deletion (the layers' A, B, gate and block), and the adapter's memory, bound instruction and last
        routes."""
        super().delete_adapter(adapter_name)
        if adapter_name in self.queryable_memory:
            del self.queryable_memory[adapter_name]
        self.routing.instructions.pop(adapter_name, None)
        self.routing.last.pop(adapter_name, None)

    @contextlib.contextmanager
    def _enable_peft_forward_hooks(self, *args, **kwargs):
        """peft runs PeftModel.forward and .generate inside this context. A `generate(..., instruction=e)` call
        would reach transformers' generate, which refuses keywords its model's forward does not name: for the
        context's duration the model's `generate` takes `instruction=` out and every forward of the generation
        routes on it (a (batch, d_c) one repeated for beams and returned sequences)."""
        if kwargs.get("instruction") is None:
            yield
            return
        model = self.model

        def generate(*a, instruction=None, **kw):
            self._generate_instruction = instruction
            try:
                return type(model).generate(model, *a, **kw)
            finally:
                self._generate_instruction = None

        model.generate = generate
        try:
            yield
        finally:
            del model.generate

    def _begin_forward(self, module, args, kwargs):
        """Before every forward of the wrapped model: a fresh routing state, this call's instruction (taken out of
        the keywords, else the running generate call's) and attention mask; with causal routing and a KV cache of
        earlier tokens, the running sums the previous forward left (`_continue_cache`)."""
        instruction = kwargs.pop("instruction", None)
        ids = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
        if instruction is None and getattr(self, "_generate_instruction", None) is not None:
            instruction = self._generate_instruction
            if instruction.dim() == 2 and ids is not None and ids.shape[0] % instruction.shape[0] == 0:
                instruction = instruction.repeat_interleave(ids.shape[0] // instruction.shape[0], 0)
        previous = self.routing.state
        state = ForwardState(mask=kwargs.get("attention_mask"), instruction=instruction)
        state.positions = ids.shape[1] if ids is not None and ids.dim() >= 2 else 0
        self.routing.state = state
        cache = next((kwargs[k] for k in CACHE_KEYWORDS if kwargs.get(k) is not None), None)
        self._continue_cache(cache, previous, state)
        if module.training and torch.is_grad_enabled():
            self._route_checkpointing(module)
        return args, kwargs

    def _continue_cache(self, cache, previous: ForwardState, state: ForwardState) -> None:
        """Causal routing over a KV cache: a forward that continues a cache of L tokens continues the running sums of
        the forward that ended at L tokens (the previous one; ValueError otherwise: the cache was not made by this
        model's forwards in order). The cache's `reorder_cache` (beam search) reorders the sums with it."""
        if cache is None or not any(self.routing.causal(a) for a in self.queryable_memory):
            return
        if hasattr(cache, "reorder_cache") and not getattr(cache, "queryable_reorders", False):
            original, routing = cache.reorder_cache, self.routing

            def reorder_cache(beam_idx):
                original(beam_idx)
                routing.reorder(beam_idx)

            cache.reorder_cache, cache.queryable_reorders = reorder_cache, True
        cached = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
        if not cached:
            return
        if previous.positions != cached:
            raise ValueError(
                f"queryable_lora (causal routing): this forward continues a KV cache of {cached} tokens, but the "
                f"adapter's running route summary covers {previous.positions}; run the earlier tokens through this "
                "model first (a cache made elsewhere, or forwards out of order, cannot be continued)"
            )
        state.carry_in = previous.carry_out
        state.positions += cached

    def _route_checkpointing(self, model: nn.Module) -> None:
        """Every transformers checkpoint function in the model (`_gradient_checkpointing_func`, set by
        activation/gradient_checkpointing_enable) made non-reentrant and routing-aware (`routed_checkpoint`)."""
        for m in model.modules():
            f = m.__dict__.get("_gradient_checkpointing_func")
            if not isinstance(f, functools.partial) or getattr(f, "queryable_routing", None) is self.routing:
                continue
            if f.keywords.get("use_reentrant"):
                warnings.warn(
                    "queryable_lora: reentrant checkpointing cannot differentiate the routing state that crosses "
                    "layers; the tuner runs the model's checkpointing non-reentrant (same gradients)",
                    stacklevel=2,
                )
            m._gradient_checkpointing_func = routed_checkpoint(self.routing, f)

    def _create_and_replace(self, config, adapter_name, target, target_name, parent, current_key, **kwargs):
        if isinstance(target, QueryableLoraLayer):
            target.update_layer(adapter_name, config)
        else:
            base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
            features(base)  # a clear TypeError for an unsupported layer
            new = Linear(target, adapter_name, config)
            if adapter_name not in self.active_adapters:
                new.requires_grad_(False)
            self._replace_module(parent, target_name, new, target)

    def _post_injection_hook(self, model: nn.Module, config, adapter_name: str) -> None:
        """Blocks in layer order; the memory on the adapted layers' device and dtype; the layers see the Routing."""
        layers = [
            (name, m) for name, m in model.named_modules() if isinstance(m, QueryableLoraLayer) and adapter_name in m.r
        ]
        indices = [layer_index(name) for name, _ in layers]
        order = sorted({i for i in indices if i is not None})
        rank = [order.index(i) if i is not None else len(order) for i in indices]  # unnumbered modules: last
        n_layers = len(order) + (None in indices)
        if config.n_blocks > n_layers:
            raise ValueError(f"n_blocks={config.n_blocks} exceeds the {n_layers} layers holding adapted modules")
        for (_, layer), k in zip(layers, rank):
            layer.block[adapter_name] = block_of(k, n_layers, config.n_blocks)
            layer.routing = self.routing
        weight = layers[0][1].get_base_layer().weight
        dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
        memory = self.queryable_memory[adapter_name]
        if not any(p.is_meta for p in memory.parameters()):  # meta (low_cpu_mem_usage): the loaded weights replace it
            memory.to(device=weight.device, dtype=dtype)
        self._sync_memory_grad()

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        """peft's rule (float16 and bfloat16 adapter weights upcast to float32) on the layers and on the memory."""
        super()._cast_adapter_dtype(adapter_name, autocast_adapter_dtype=autocast_adapter_dtype)
        if autocast_adapter_dtype and adapter_name in getattr(self, "queryable_memory", {}):
            memory = self.queryable_memory[adapter_name]
            if any(p.dtype in (torch.float16, torch.bfloat16) for p in memory.parameters()):
                memory.to(torch.float32)

    def set_instruction(self, e: torch.Tensor | None, adapter_name: str | None = None) -> None:
        """Bind the frozen instruction embedding e (d_c,) to an adapter (default: the active one); None unbinds.
        A forward's `instruction=` overrides it. Not saved with the adapter: bind it again after loading."""
        name = adapter_name or self.active_adapters[0]
        if e is None:
            self.routing.instructions.pop(name, None)
        else:
            self.routing.instructions[name] = e.detach()

    def _unload_and_optionally_merge(self, merge: bool = True, *args, **kwargs):
        """`unload()`: the base model as it was (the adapted layers replaced by their base layers, the forward
        pre-hook removed, transformers' checkpoint functions restored). Merging is refused: the update depends on
        the input through its route, so no fixed weight equals it."""
        if merge:
            raise NotImplementedError(
                "queryable_lora's update depends on the input (its routes): it cannot be merged; "
                "unload() returns the base model without the adapters"
            )
        model = super()._unload_and_optionally_merge(*args, merge=False, **kwargs)
        if getattr(self, "_hook", None) is not None:
            self._hook.remove()
            self._hook = None
        for m in model.modules():
            f = m.__dict__.get("_gradient_checkpointing_func")
            if getattr(f, "queryable_routing", None) is self.routing:
                m._gradient_checkpointing_func = f.queryable_original
        return model
