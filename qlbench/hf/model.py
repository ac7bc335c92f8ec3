"""The peft tuner: shared memory and router per adapter, blocks in the model's layer order, the forward's hooks.

What peft's API does not express, and how this tuner does it (docs/hf.md):
- *State carried across layers.* peft's layers are independent modules; Queryable LoRA's block b routes from its
  entry rank state and from summaries of the blocks before it. Every adapted layer of an adapter shares the tuner's
  `Routing` (routing.py); the state of one forward is that forward's call, kept in a context variable (per thread,
  nested calls restored), begun by a forward pre-hook on the wrapped model and ended by a forward hook, which hands
  causal routing's running sums to the KV cache the forward returns.
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
import inspect
import re
import warnings

import torch
import torch.nn as nn
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from transformers.cache_utils import Cache

from qlbench.adapters.queryable import block_of
from qlbench.hf.layer import Linear, QueryableLoraLayer, features
from qlbench.hf.routing import (
    GENERATING,
    ROWS,
    ForwardState,
    QueryableMemory,
    Routing,
    as_instruction,
    bound,
    now,
    route_sums,
    routed_checkpoint,
)

CACHE_KEYWORDS = ("cache", "past_key_values")  # transformers 5's name for a KV cache, and the older one


@functools.cache
def _signature(forward_type: type) -> inspect.Signature | None:
    try:
        return inspect.signature(forward_type.forward)
    except (TypeError, ValueError):  # a forward without a signature Python can read
        return None


def inputs_of(module: nn.Module, args: tuple, kwargs: dict) -> dict:
    """The wrapped model's forward arguments by name, positional ones included (a model called as
    `model(ids, mask)` names its mask as `model(input_ids=ids, attention_mask=mask)` does); the keywords alone where
    the forward's signature cannot be read or does not take these arguments."""
    signature = _signature(type(module))
    if signature is None or not args:
        return kwargs
    try:
        bound = signature.bind_partial(module, *args, **kwargs).arguments  # `self` first: the unbound forward's
    except TypeError:
        return kwargs
    return {**bound.pop("kwargs", {}), **bound}


def is_causal_lm(model: nn.Module, config) -> bool | None:
    """Whether causal routing is the default, from what the model can do rather than its class name: True for peft's
    task_type CAUSAL_LM, for a model that generates (transformers' `can_generate()`: causal LMs, vision-language
    models' `...ForConditionalGeneration`, a custom head on GenerationMixin) and for a decoder config (`is_decoder`);
    False for a transformers model that does neither (encoders, classifiers); None where it cannot be told (a module
    that is not a transformers model)."""
    if str(getattr(config, "task_type", None)) in ("CAUSAL_LM", "TaskType.CAUSAL_LM"):
        return True
    if getattr(getattr(model, "config", None), "is_decoder", False):
        return True
    can_generate = getattr(model, "can_generate", None)
    if not callable(can_generate):
        return None
    return bool(can_generate())


def layer_index(module_name: str) -> int | None:
    """The layer a module belongs to: the first integer component of its path (`encoder.layer.3.attention` -> 3)."""
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", module_name)
    return None if match is None else int(match.group(1))


class QueryableLoraModel(BaseTuner):
    """Queryable LoRA over a transformers model (or any nn.Module with nn.Linear layers); see the module docstring."""

    prefix: str = "queryable_"
    uses_shared_state = True  # the memory lives on the tuner: peft refuses inject_adapter_in_model, which drops it
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
            causal = is_causal_lm(model, config)
            if causal is None:
                warnings.warn(
                    f"queryable_lora cannot tell whether {type(model).__name__} is causal (no task_type, and it is "
                    "not a transformers model): every token is routed on its whole sequence (causal=False); set "
                    "causal=True for a decoder",
                    stacklevel=2,
                )
            config.causal = bool(causal)
        if not hasattr(self, "queryable_memory"):
            self.queryable_memory = nn.ModuleDict({})
            self.routing = Routing(self.queryable_memory)
        if getattr(self, "_hook", None) is None:
            self._hook = model.register_forward_pre_hook(self._begin_forward, with_kwargs=True)
            # always_call: a forward that raises ends its call too, so nothing of it is left to the next one
            self._end_hook = model.register_forward_hook(self._end_forward, with_kwargs=True, always_call=True)
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
        """peft runs PeftModel.forward and .generate inside this context.
        - `adapter_names=` (a mixed-adapter batch, as peft's LoRA takes it: each row's adapter, "__base__" for none;
          repeated for beam search's beams): every adapter named runs on the whole batch and adds its update to its
          own rows only, so each row routes and continues its cache as with its adapter alone. Inference only.
        - `instruction=`: a `generate(..., instruction=e)` call would reach transformers' generate, which refuses
          keywords its model's forward does not name: for the context's duration the model's `generate` takes it
          out and every forward of the generation routes on it (a (batch, d_c) one repeated for beams and returned
          sequences)."""
        rows = kwargs.get("adapter_names")
        if rows is not None:
            rows = self._mixed_rows(rows, kwargs.get("num_beams"))
        instruction = kwargs.get("instruction")
        model = self.model
        if instruction is not None:

            def generate(*a, instruction=None, **kw):
                with bound(GENERATING, self.routing, as_instruction(instruction)):
                    return type(model).generate(model, *a, **kw)

            model.generate = generate
        try:
            with bound(ROWS, self.routing, rows):
                yield
        finally:
            if instruction is not None:
                del model.generate

    def _enable_adapter_layers(self, enabled: bool = True) -> None:
        """peft's switch of every adapted layer (`disable_adapter()`, `enable_adapter_layers`): with the adapters off
        the base model runs and nothing routes, so a forward over a KV cache neither reads nor extends route sums."""
        super()._enable_adapter_layers(enabled)
        self.routing.disabled = not enabled

    def _mixed_rows(self, rows, num_beams) -> list[str]:
        """The adapter of each row of a mixed batch (ValueError in one line: in training, a name that is no
        adapter, not a list of names)."""
        if isinstance(rows, str) or not all(isinstance(r, str) for r in rows):
            raise ValueError(f"adapter_names must be a list of adapter names, one per row, got {rows!r}")
        if self.training:
            raise ValueError("queryable_lora: adapter_names= (a mixed-adapter batch) is for inference; call .eval()")
        if unknown := sorted(set(rows) - set(self.queryable_memory) - {"__base__"}):
            raise ValueError(
                f"adapter_names: no adapter named {', '.join(unknown)}; valid: "
                f"{', '.join([*self.queryable_memory, '__base__'])}"
            )
        beams = num_beams if isinstance(num_beams, int) and num_beams > 1 else 1
        return [r for r in rows for _ in range(beams)]

    def _begin_forward(self, module, args, kwargs):
        """Before every forward of the wrapped model: a fresh routing state, this call's instruction (taken out of
        the keywords, else the running generate call's) and attention mask; with causal routing and a KV cache of
        earlier tokens, the running sums that cache keeps (`_continue_cache`)."""
        instruction = as_instruction(kwargs.pop("instruction", None))
        named = inputs_of(module, args, kwargs)  # every argument by its name, those given by position too
        given = (named.get("input_ids"), named.get("inputs_embeds"), args[0] if args else None)
        ids = next((v for v in given if v is not None), None)  # (batch, T) ids or (batch, T, d) embeddings
        if instruction is None and now(GENERATING).get(self.routing) is not None:
            instruction = now(GENERATING)[self.routing]
            if instruction.dim() == 2 and ids is not None and ids.shape[0] % instruction.shape[0] == 0:
                instruction = instruction.repeat_interleave(ids.shape[0] // instruction.shape[0], 0)
        if self.routing.rows is not None and ids is not None and len(self.routing.rows) != ids.shape[0]:
            raise ValueError(f"adapter_names names {len(self.routing.rows)} rows, but this forward has {ids.shape[0]}")
        state = ForwardState(mask=named.get("attention_mask"), instruction=instruction)
        cache = next((named[k] for k in CACHE_KEYWORDS if named.get(k) is not None), None)
        self._continue_cache(cache, state, None if ids is None else ids.shape[0])
        if ids is not None and not state.cached:
            state.starts = self._packed_starts(named, ids.shape[:2])
        self.routing.begin(state, key=id(kwargs))  # this context's call, until _end_forward (CALLS)
        if module.training and torch.is_grad_enabled():
            self._route_checkpointing(module)
        return args, kwargs

    def _packed_starts(self, named: dict, shape) -> torch.Tensor | None:
        """(batch, T) bool, True at a token that starts a sequence packed into its row after another one (padding-
        free batches): where `position_ids` fall back to 0, or at the offsets of flash attention's `cu_seq_lens_q`
        (one row of concatenated sequences, as transformers' DataCollatorWithFlattening makes); None for rows that
        each hold one sequence. ValueError in one line where the routing cannot keep packed sequences apart."""
        batch, T = shape
        starts = None
        positions = named.get("position_ids")
        if isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[-1] == T:
            restart = positions[:, 1:] <= positions[:, :-1]  # (b, T - 1): a position that does not go on
            if bool(restart.any()):
                starts = torch.cat([torch.zeros_like(restart[:, :1]), restart], 1).expand(batch, T)
        offsets = named.get("cu_seq_lens_q")
        if isinstance(offsets, torch.Tensor) and batch == 1 and offsets.numel() > 2:
            starts = torch.zeros(1, T, dtype=torch.bool, device=offsets.device)
            starts[0, offsets[1:-1].long().clamp_max(T - 1)] = True
        if starts is not None and not all(self.routing.causal(a) for a in self.queryable_memory):
            raise ValueError(
                "queryable_lora with causal=False makes one route per row, so sequences packed into one row "
                "(position_ids that restart, or cu_seq_lens_q) would share it: set causal=True, or pass one sequence "
                "per row"
            )
        return starts

    def _continue_cache(self, cache, state: ForwardState, batch: int | None) -> None:
        """Causal routing over a KV cache of L tokens: the running sums at its L-th token, from the sums the cache
        keeps (RouteSums), whatever ran in between; ValueError in one line for a cache that cannot be continued
        (not a transformers Cache, made without this model's forwards, other rows)."""
        if cache is None or self.routing.disabled:
            return
        if not any(self.routing.causal(a) for a in self.queryable_memory):
            cached = cache.get_seq_length() if isinstance(cache, Cache) else 0
            if cached:
                raise ValueError(
                    f"queryable_lora with causal=False routes every token on its whole sequence, so this forward, "
                    f"which continues a KV cache of {cached} tokens, would route otherwise than the sequence run "
                    "without the cache: set causal=True (decoders), or pass use_cache=False"
                )
            return
        if not isinstance(cache, Cache):
            raise ValueError(
                f"queryable_lora (causal routing) continues a transformers Cache, which keeps the route sums; "
                f"got a {type(cache).__name__}"
            )
        cached = cache.get_seq_length()
        if not cached:
            return
        sums = getattr(cache, "queryable_sums", None)
        if not sums:
            raise ValueError(
                f"queryable_lora (causal routing): this forward continues a KV cache of {cached} tokens that holds "
                "no route sums; make the cache with this model's forwards (use_cache=True)"
            )
        for key, (total, weight) in sums.items():
            if total.shape[1] < cached:
                raise ValueError(
                    f"queryable_lora (causal routing): the KV cache holds {cached} tokens but route sums of "
                    f"{total.shape[1]}: it was extended without this model's forwards"
                )
            if batch is not None and total.shape[0] != batch:
                raise ValueError(
                    f"queryable_lora (causal routing): the KV cache holds {total.shape[0]} rows, this forward {batch}"
                )
            state.carry_in[key] = total[:, cached - 1], weight[:, cached - 1]
        state.cached = cached

    def _end_forward(self, module, args, kwargs, output):
        """After every forward: the causal running sums kept by the KV cache it returns (RouteSums: those of the
        cache it continued up to its length, then this forward's), and the routing state dropped (`Routing.end`)."""
        call = self.routing.call
        if call is None or call.key != id(kwargs):  # the forward raised before its call began: nothing to end
            return output
        state = call.state
        if state.sums and output is not None:
            values = output.values() if isinstance(output, dict) else output if isinstance(output, tuple) else ()
            cache = next((v for v in values if isinstance(v, Cache)), None)
            if cache is not None:
                kept = getattr(cache, "queryable_sums", {}) if state.cached else {}
                sums = {}
                for key, (total, weight) in state.sums.items():
                    if state.cached:
                        t0, w0 = kept[key]
                        total = torch.cat([t0[:, : state.cached], total], 1)
                        weight = torch.cat([w0[:, : state.cached], weight], 1)
                    sums[key] = total, weight
                route_sums(cache).queryable_sums = sums
        self.routing.end(call)
        return output

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
        if config.n_blocks > n_layers:  # qlbench interpretation: clamped (peft's tuners adapt any model), with a note
            warnings.warn(
                f"queryable_lora: n_blocks={config.n_blocks} is more than the {n_layers} layer(s) holding adapted "
                f"modules; using n_blocks={n_layers}",
                stacklevel=2,
            )
            config.n_blocks = n_layers
            self.queryable_memory[adapter_name] = QueryableMemory(config)  # drawn again at the blocks that exist
        for (name, layer), k in zip(layers, rank):
            layer.block[adapter_name] = block_of(k, n_layers, config.n_blocks)
            layer.routing_key[adapter_name] = name
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
            self.routing.instructions[name] = as_instruction(e).detach()

    def add_weighted_adapter(self, *args, **kwargs):
        """Refused in one line: LoRA's weighted sum of adapters combines fixed weight updates; a Queryable LoRA
        update depends on the input through its route, so no weighted sum of adapters' weights equals their mix."""
        raise NotImplementedError(
            "queryable_lora's update depends on the input (its routes): adapters cannot be combined by weights "
            "(add_weighted_adapter); train one adapter on the tasks together, or switch with set_adapter"
        )

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
            self._end_hook.remove()
            self._hook = self._end_hook = None
        for m in model.modules():
            f = m.__dict__.get("_gradient_checkpointing_func")
            if getattr(f, "queryable_routing", None) is self.routing:
                m._gradient_checkpointing_func = f.queryable_original
        return model
