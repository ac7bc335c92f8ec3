"""The tuner's per-forward routing: each adapter's memory, the state one forward shares across its layers, the causal
route sums a KV cache keeps, and the replay of that state in a checkpointed segment's recomputation (docs/hf.md)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn

from qlbench.adapters.queryable import memory_shapes, route_with
from qlbench.adapters.routing import Route


def unused(config) -> set[str]:
    """The router matrices no output depends on at `config.n_blocks`: with one block no block has an earlier one
    (Q_dep, Q_dep_q, Q_dep_k); with two, block 1 attends over one earlier block, a softmax over one item (Q_dep_q,
    Q_dep_k). The tuner does not create them, so every parameter it counts trains."""
    return {1: {"Q_dep", "Q_dep_q", "Q_dep_k"}, 2: {"Q_dep_q", "Q_dep_k"}}.get(config.n_blocks, set())


class QueryableMemory(nn.Module):
    """One adapter's atoms C_m (M, r, r), keys k_m (M, d_k), block priors w_b (B, d_k) and router matrices, with
    qlbench's initialisation (qlbench.adapters.queryable.QueryableMemory, drawn from torch's global generator). The
    matrices `unused` names are drawn (so the others' draws do not depend on n_blocks) but not kept."""

    def __init__(self, config):
        super().__init__()
        self.Q_ctx = self.R_ctx = None  # without instruction channels
        self.Q_dep = self.Q_dep_q = self.Q_dep_k = None
        dead = unused(config)
        for name, (shape, std) in memory_shapes(config).items():
            value = torch.randn(*shape) * std
            if name not in dead:
                setattr(self, name, nn.Parameter(value))
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
    causal routing, each layer's running sums over the tokens so far, which the KV cache the forward returns keeps
    (`RouteSums`) for the forward that continues it."""

    states: dict[str, dict[int, list[torch.Tensor]]] = field(default_factory=dict)  # adapter -> block -> [(N, r)]
    operators: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)  # adapter -> block -> (b, [T,] r, r)
    mask: torch.Tensor | None = None  # (batch, T) attention mask of this forward, if the model was given one
    instruction: torch.Tensor | None = None  # (d_c,) or (batch, d_c) given to this forward
    routers: dict[str, dict[int, str]] = field(default_factory=dict)  # adapter -> block -> key of the routing layer
    # causal routing, (adapter, layer key) -> running sums: of the masked rank states and of the token weights, at
    # the last token of the KV cache this forward continues (b, r), (b, 1), and at each token of this forward
    # (b, T, r), (b, T, 1); `cached`: the tokens of that cache
    carry_in: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    sums: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    cached: int = 0
    # (batch, T) bool: True at a token that starts another sequence packed into its row (no KV cache); None: none
    starts: torch.Tensor | None = None
    own_rows: dict[str, torch.Tensor] = field(default_factory=dict)  # mixed batch: adapter -> (batch,) its rows


@dataclass
class Call:
    """What one call in progress routes with: its forward's state, and whether that forward is being replayed (a
    checkpointed segment recomputed in backward); `token` restores the calls around it when it ends."""

    state: ForwardState
    recomputing: bool = False
    token: contextvars.Token | None = None
    key: int | None = None  # the model forward that began it (the id of its keywords), for the hook that ends it


# The calls in progress, per context: Routing -> its innermost Call. A context variable, so each thread (and each
# asyncio task) sees only its own calls, and a call made inside another (reentrant) restores the outer one when it
# ends. Nothing of a call is left on the tuner or its modules (issue: routing state that cannot leak).
CALLS: contextvars.ContextVar[dict] = contextvars.ContextVar("queryable_lora_calls", default=None)
# Per context, Routing -> the adapter of each row of the mixed batch in progress (peft's adapter_names=)
ROWS: contextvars.ContextVar[dict] = contextvars.ContextVar("queryable_lora_rows", default=None)
# Per context, Routing -> the instruction of the generate(..., instruction=e) call in progress
GENERATING: contextvars.ContextVar[dict] = contextvars.ContextVar("queryable_lora_generating", default=None)


def now(var: contextvars.ContextVar) -> dict:
    """The mapping a context variable of this module holds in this context (empty where it was never set)."""
    return var.get() or {}


@contextlib.contextmanager
def bound(var: contextvars.ContextVar, routing: Routing, value):
    """`routing` -> `value` in `var` for this context while the block runs, the mapping before it back after."""
    token = var.set({**now(var), routing: value})
    try:
        yield
    finally:
        var.reset(token)


class Routing:
    """What the adapted layers of a tuner share: the memories, each adapter's bound instruction, and where to find
    the state of the call in progress (`state`: this context's, `CALLS`). A plain object (not an nn.Module), so that
    no layer registers the memories again."""

    def __init__(self, memories: nn.ModuleDict):
        self.memories = memories
        self.instructions: dict[str, torch.Tensor] = {}
        self.disabled = False  # the adapters are off (`disable_adapter()`): the base model runs, nothing routes
        # the last forward that ended, detached, for inspection (tests, verify): adapter -> block -> Route, and
        # -> [(N, r)]; with forwards in several threads, whichever ended last
        self.last: dict[str, dict] = {}
        self.last_states: dict[str, dict[int, list[torch.Tensor]]] = {}

    @property
    def call(self) -> Call | None:
        """This context's call in progress, or None (no forward of the model is running here)."""
        return now(CALLS).get(self)

    @property
    def state(self) -> ForwardState | None:
        call = self.call
        return None if call is None else call.state

    @property
    def recomputing(self) -> bool:
        call = self.call
        return call is not None and call.recomputing

    @property
    def rows(self) -> list[str] | None:
        """A mixed-adapter batch in progress in this context: each row's adapter ("__base__": none), else None."""
        return now(ROWS).get(self)

    def begin(self, state: ForwardState, recomputing: bool = False, key: int | None = None) -> Call:
        """A call starts in this context with `state` (the calls around it come back at its `end`)."""
        call = Call(state, recomputing, key=key)
        call.token = CALLS.set({**now(CALLS), self: call})
        return call

    def finish(self, call: Call) -> None:
        """`call` ends: the calls around it come back."""
        CALLS.reset(call.token)

    @contextlib.contextmanager
    def alone(self):
        """A call of its own for an adapted layer called outside any forward of the model (an inner module called
        directly): it routes from its own input, and nothing of it outlives it."""
        call = self.begin(ForwardState())
        try:
            yield
        finally:
            self.finish(call)

    def causal(self, adapter: str) -> bool:
        return bool(self.memories[adapter].config.causal)

    def pooled(self, s: torch.Tensor, adapter: str, layer: str) -> torch.Tensor:
        """A rank state per sequence: s (batch, T, r) averaged over its tokens (the mask's padding skipped, when the
        forward had a mask of the same shape), or s (batch, r) itself. With causal routing, one per token
        (batch, T, r): the average over the tokens up to it, the tokens of the KV cache it continues included (the
        running sums that cache keeps, `RouteSums`)."""
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
        starts = self.state.starts
        if starts is not None and starts.shape == s.shape[:2]:  # packed sequences: each one's own running sums
            t = torch.arange(T, device=s.device)
            first = torch.cummax(torch.where(starts.to(s.device), t, 0), 1).values  # (batch, T): its sequence's start
            before = (first - 1).clamp_min(0).unsqueeze(-1)  # (batch, T, 1): the token before that start
            opened = (first > 0).unsqueeze(-1).to(s.dtype)  # 0 for the row's first sequence
            total = total - opened * total.gather(1, before.expand_as(total))
            weight = weight - opened * weight.gather(1, before)
        if self.state.cached:
            if (adapter, layer) not in self.state.carry_in:
                raise ValueError(
                    f"queryable_lora (causal routing): the KV cache this forward continues holds no route sums of "
                    f"adapter {adapter!r} at {layer}: it was made with other adapters active; continue it with those"
                )
            before, seen = self.state.carry_in[adapter, layer]
            total, weight = total + before.unsqueeze(1), weight + seen.unsqueeze(1)
        if not self.recomputing:
            self.state.sums[adapter, layer] = total, weight
        return total / weight.clamp_min(1.0)

    def operator(self, adapter: str, block: int, s: torch.Tensor, layer: str) -> torch.Tensor:
        """S_b (batch, r, r) for this adapter's block, routed by the first layer of the block to run in this forward
        (from its rank state s and the summaries of the blocks before it); every layer's pooled state is recorded.
        `layer` names the calling layer (its module path): in a checkpoint's recomputation the layer that routed the
        block routes it again, as it did in the forward, and nothing is recorded (the forward's state stands)."""
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

    def rows_of(self, adapter: str, device: torch.device) -> torch.Tensor:
        """(batch,) bool: the rows of a mixed batch that `adapter` serves (`rows`), made once per forward."""
        if adapter not in self.state.own_rows:
            self.state.own_rows[adapter] = torch.tensor([a == adapter for a in self.rows], device=device)
        return self.state.own_rows[adapter]

    def end(self, call: Call) -> None:
        """After a forward: nothing of it is kept but detached copies of its routes and pooled states (`last`,
        `last_states`), so no graph outlives the forward and the model deep-copies; the calls around it come back."""
        self.last = {a: {b: detached(r) for b, r in routes.items()} for a, routes in self.last.items()}
        self.last_states = {
            a: {b: [p.detach() for p in ps] for b, ps in blocks.items()} for a, blocks in call.state.states.items()
        }
        self.finish(call)

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


def detached(route: Route) -> Route:
    """A Route with every tensor detached."""
    return dataclasses.replace(
        route,
        **{
            f.name: getattr(route, f.name).detach()
            for f in dataclasses.fields(route)
            if torch.is_tensor(getattr(route, f.name))
        },
    )


class RouteSums:
    """Mixed into a KV cache (a transformers Cache) that a causal-routed forward returns: `queryable_sums`, for each
    (adapter, layer key), the running sums of the masked rank states (b, L, r) and of the token weights (b, L, 1) at
    each of the cache's L tokens. They live with the cache, so any forward that continues it routes as the full
    forward would: a deep copy keeps its own, beam search reorders them with the keys and values, and a cache
    cropped after rejected draft tokens is continued from the sums at its new length."""

    queryable_sums: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.queryable_sums = {
            k: tuple(t.index_select(0, beam_idx.to(t.device)) for t in v) for k, v in self.queryable_sums.items()
        }

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.queryable_sums = {
            k: tuple(t.repeat_interleave(repeats, 0) for t in v) for k, v in self.queryable_sums.items()
        }

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.queryable_sums = {k: tuple(t[indices] for t in v) for k, v in self.queryable_sums.items()}


def route_sums(cache):
    """`cache` with RouteSums mixed into its class (a class per cache class, named in this module so that a cache
    pickles); an empty `queryable_sums` if it had none."""
    cls = type(cache)
    if not isinstance(cache, RouteSums):
        name = f"Routed{cls.__name__}"
        routed = globals().get(name)
        if routed is None or routed.__bases__ != (RouteSums, cls):
            routed = type(name, (RouteSums, cls), {"__module__": __name__, "__qualname__": name})
            globals()[name] = routed
        cache.__class__ = routed
    if not hasattr(cache, "queryable_sums"):
        cache.queryable_sums = {}
    return cache


class Recompute:
    """The context a checkpointed segment is recomputed in (torch.utils.checkpoint's `context_fn`): the routing
    state of the forward that ran the segment (captured when it ran, so forwards may run before their backwards),
    with `recomputing` set. Composed with a `context_fn` the caller gave."""

    def __init__(self, routing: Routing, inner: contextlib.AbstractContextManager):
        self.routing, self.state, self.inner = routing, routing.state, inner

    def __enter__(self):
        self.call = self.routing.begin(self.state, recomputing=True)
        return self.inner.__enter__()

    def __exit__(self, *exc):
        self.routing.finish(self.call)
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


def as_instruction(e) -> torch.Tensor | None:
    """An instruction embedding as a tensor: a tensor as it is, a list or numpy array of numbers as a float32
    tensor (ValueError in one line for anything else)."""
    if e is None or torch.is_tensor(e):
        return e
    try:
        return torch.as_tensor(np.asarray(e, dtype=np.float32))
    except (TypeError, ValueError):
        raise ValueError(
            f"instruction must be a tensor, a numpy array or a list of numbers, got {type(e).__name__}"
        ) from None
