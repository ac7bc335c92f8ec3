"""Methods written for one plain model, stacked by qlbench: peft's tuners and methods from outside packages.

qlbench's own adapters are written for the stack (every weight (E, ...), every layer batched over members). A
`MemberMethod` is written for ONE member instead, as PyTorch code usually is: `adapt_member(model, config, targets)`
receives one member of the backbone as a plain module whose target linears are `nn.Linear` (at the dotted paths in
`targets`), changes it in place or wraps it, and returns the model to train (peft's `get_peft_model` does exactly
this). qlbench builds that once per member, each under its own seed, and trains the E results as one stack:

- stacked: every member's tensors are stacked into (E, ...) parameters (torch.func.stack_module_state's layout) and
  the forward is `vmap` over a functional call of one member's module (`MemberStack._call`), one batched computation;
- looped: the same (E, ...) parameters, and a Python loop makes the functional call with member e's slices. Used when
  vmap cannot run the method's code, in any `Way` below and with the method's `rewrites`, or gives other
  numbers than the loop on a probe batch; the reason is kept (`MemberStack.path`) and recorded
  (run_info.settings.member_path).

vmap is asked to run a method's code plainly first, then as each failure asks (`Way.after`, `MemberStack.probe`):
with random ops, each member drawing its own numbers (randomness "different") or, where a draw steers Python control
flow, every member taking the same draw ("same"); with `.data` read as `.detach()` (the same values; vmap refuses
`.data`). A method may also name `rewrites`: functional versions of the few methods of its modules that vmap cannot
run (an in-place index write, an autograd.Function without a vmap rule), used on the stacked path only. The looped
path always runs the method's own code, so the probe checks every way and rewrite against it, with the trainable
tensors moved off their start (a zero-initialised update would hide a wrong rewrite).

Both paths hold one set of (E, ...) parameters, so the engine, snapshots, checkpoints and gradient diagnostics see a
model like any other stack, and member e's numbers depend only on member e.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import types
import warnings
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.func import vmap
from torch.overrides import TorchFunctionMode

from qlbench import stacked
from qlbench.adapters.base import Method

# vmap runs the CPU's fused attention kernel member by member (no batching rule yet) and warns at every forward;
# that is the stacked Transformer's cost, measured by `qlbench bench`, not news at each step
warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented")

PROBE_TOLERANCE = 1e-5  # relative: how far vmap's probe output may lie from the loop's before the loop is used


@dataclasses.dataclass(frozen=True)
class Way:
    """How vmap is asked to run a method's code: its randomness flag, whether `.data` is read as `.detach()`, and
    whether an autograd.Function that vmap cannot run (no setup_context) runs its forward as plain code."""

    randomness: str = "error"
    detach_data: bool = False
    plain_functions: bool = False
    batched_factories: bool = False

    def after(self, failure: str) -> Way | None:
        """The way to try after this one failed with `failure` (vmap's error text): the one thing that error asks
        for added, or None when nothing answers it."""
        if "random operation" in failure and self.randomness == "error":
            return dataclasses.replace(self, randomness="different")
        if "data-dependent control flow" in failure and self.randomness == "different":
            return dataclasses.replace(self, randomness="same")  # a draw steers control flow
        if "setup_context" in failure and not self.plain_functions:
            return dataclasses.replace(self, plain_functions=True)
        if "`data`" in failure and not self.detach_data:
            return dataclasses.replace(self, detach_data=True)
        if "index_put_" in failure and not self.batched_factories:
            return dataclasses.replace(self, batched_factories=True)
        return None

    def python_mode(self) -> bool:
        """Whether every op of the forward passes through a Python TorchFunctionMode (the costlier ways)."""
        return self.detach_data or self.batched_factories

    def note(self) -> str:
        """ "" for the plain way, else what was needed, as recorded after "stacked: "."""
        words = []
        if self.randomness == "different":
            words.append("random ops drawn per member (vmap randomness 'different')")
        if self.randomness == "same":
            words.append("random ops drawn once for every member (vmap randomness 'same': a draw steers control flow)")
        if self.detach_data:
            words.append("`.data` read as `.detach()`")
        if self.plain_functions:
            words.append("autograd.Functions without a vmap rule differentiated through their forward's own math")
        if self.batched_factories:
            words.append(
                "tensors created in the forward carry the member dimension, so a member's values can be "
                "written into them in place"
            )
        return "; ".join(words)


# floating-point tensors these create inside a member's forward are unbatched under vmap (Way.batched_factories)
FACTORIES = (torch.zeros, torch.ones, torch.empty, torch.full, torch.eye)


class _VmapMode(TorchFunctionMode):
    """Inside one member's forward under vmap: `t.data` gives `t.detach()` (the same values, cut from autograd as
    `.data` is; vmap refuses `.data`) where `detach_data`; a floating tensor made by one of FACTORIES gets `zero`, a
    batched 0 of the member dimension, added where `zero` is given (so in-place writes of batched values into it
    work)."""

    def __init__(self, detach_data: bool, zero: torch.Tensor | None):
        super().__init__()
        self.detach_data, self.zero = detach_data, zero

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        if self.detach_data and getattr(func, "__name__", None) == "__get__":
            if getattr(func, "__self__", None) is torch.Tensor.data:
                return args[0].detach()
        out = func(*args, **(kwargs or {}))
        if self.zero is not None and func in FACTORIES and out.is_floating_point():
            return out + self.zero.to(out.dtype)
        return out


class _Context:
    """What an old-style autograd.Function's forward is handed as `ctx` when called as plain code: it keeps
    attributes and ignores what only its backward would use."""

    needs_input_grad = ()

    def save_for_backward(self, *tensors):
        pass

    def mark_dirty(self, *tensors):
        pass

    def mark_non_differentiable(self, *tensors):
        pass

    def set_materialize_grads(self, value):
        pass


@contextlib.contextmanager
def _plain_functions():
    """Inside: `F.apply(*args)` of an autograd.Function F with an old-style forward(ctx, ...) (no setup_context,
    which vmap requires) calls F.forward(ctx, *args) as plain code, so autograd differentiates the forward's own
    math; every other Function applies as usual. The probe checks the gradients against F's backward."""
    original = torch.autograd.Function.__dict__["apply"]
    base = torch.autograd.function._SingleLevelFunction.setup_context

    def apply(cls, *args, **kwargs):
        if cls.setup_context is base:
            return cls.forward(_Context(), *args, **kwargs)
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original


# A rewrite: (module class, method name, function(module, *args, **kwargs)) used as that method on the stacked path
Rewrite = tuple[type, str, Callable]


class PlainTarget(nn.Module):
    """One member's target linear as a plain `nn.Linear` (child `linear`), called as the backbone calls its targets,
    `layer(x, ctx)`; the context is dropped, so a wrapper around `linear` sees only x."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        d_out, d_in = weight.shape
        self.linear = nn.Linear(d_in, d_out, bias=bias is not None, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.linear.weight.copy_(weight)
            if bias is not None:
                self.linear.bias.copy_(bias)

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        """x (1, ..., d_in) -> (1, ..., d_out), through `linear` as (1, rows, d_in): a tuner sees the 3-D
        (batch, tokens, features) input it is written for on both backbones (the Transformer's (1, N, 2, d) too)."""
        y = self.linear(x.reshape(1, -1, x.shape[-1]))  # (1, rows, d_out)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def plain_member(backbone: nn.Module, e: int, target_paths: list[str]) -> nn.Module:
    """Member e of a stacked backbone as a one-member backbone on the CPU: x (1, N, 2) -> (1, N), every weight
    member e's, each target a `PlainTarget` (so its `nn.Linear` sits at `<path>.linear`)."""
    like = next(backbone.parameters())
    with stacked.shapes_only():  # the architecture with one member, nothing drawn
        member = type(backbone)([torch.Generator()], backbone.config, device="meta", dtype=like.dtype)
    member = member.to_empty(device="cpu")
    source = {**dict(backbone.named_parameters()), **dict(backbone.named_buffers())}  # name -> (E, ...)
    with torch.no_grad():
        for name, t in [*member.named_parameters(), *member.named_buffers()]:
            if like.device.type == "meta":
                t.zero_()  # a shapes-only build (planning.dry_build): the values are never used
            else:
                t.copy_(source[name][e : e + 1])
    for path in target_paths:
        parent, _, child = path.rpartition(".")
        layer = member.get_submodule(path)
        setattr(member.get_submodule(parent), child, PlainTarget(layer.weight[0], layer.bias[0]))
    for p in member.parameters():
        p.requires_grad_(False)
    return member


def _register(root: nn.Module, dotted: str, value: torch.Tensor, parameter: bool) -> None:
    """Register `value` under the dotted name in `root`, creating empty container modules along the path."""
    *path, leaf = dotted.split(".")
    module = root
    for part in path:
        if part not in module._modules:
            module.add_module(part, nn.Module())
        module = module._modules[part]
    if parameter:
        module.register_parameter(leaf, nn.Parameter(value, requires_grad=value.requires_grad))
    else:
        module.register_buffer(leaf, value)


class MemberStack(nn.Module):
    """E members of one plain model, trained as a stack: x (E, N, 2) -> (E, N).

    `template` is member 0's module, kept out of the module tree (its own tensors are never used: each forward
    swaps in the stacked ones); every tensor of the members lives here as (E, *shape) under the member module's
    own name (a one-member backbone part keeps its leading 1: (E, 1, ...)), trainable where the member's is."""

    def __init__(self, members: list[nn.Module], strip: str, n_layers: int, targets: list, rewrites=()):
        super().__init__()
        self.__dict__["template"], self.__dict__["_cached"], self.__dict__["_slots"] = members[0], None, None
        self.__dict__["rewrites"], self.__dict__["way"] = tuple(rewrites), Way()
        self.n_layers, self._targets, self.shared = n_layers, targets, nn.ModuleDict()
        self.names: list[tuple[str, str]] = []  # (name here, name in the template)
        tensors = lambda m: {**dict(m.named_parameters()), **dict(m.named_buffers())}
        n_params = len(list(members[0].named_parameters()))
        every = [tensors(m) for m in members]
        for i, (name, t) in enumerate(every[0].items()):
            values = torch.stack([m[name].detach() for m in every])  # (E, *shape)
            values.requires_grad_(t.requires_grad)
            here = name.removeprefix(strip)
            _register(self, here, values, parameter=i < n_params)
            self.names.append((here, name))
        self.path = "looped: not probed"

    def adapter_targets(self, roles=None) -> list:
        return self._targets

    def _state(self) -> dict[str, torch.Tensor]:
        """template name -> stacked tensor, looked up once and kept (every forward reads it) until `_apply` moves
        or casts the tensors (buffers are then new objects)."""
        if self._cached is None:
            mine = {**dict(self.named_parameters()), **dict(self.named_buffers())}
            self.__dict__["_cached"] = {theirs: mine[here] for here, theirs in self.names}
        return self._cached

    def _places(self) -> list[list[tuple[dict, str]]]:
        """Per name in `names` (its order), every slot of the template that holds that tensor: (the owning module's
        `_parameters` or `_buffers` dict, key). A tensor shared by two modules (tied) has two slots, and both take
        the member's value, as torch.func.functional_call unties. Found once, not at every forward."""
        if self._slots is None:
            where: dict[int, dict[tuple[int, str], tuple[dict, str]]] = {}  # tensor -> its distinct slots
            for module in self.template.modules():  # each module once, however often it is reachable
                for table in (module._parameters, module._buffers):
                    for key, t in table.items():
                        if t is not None:
                            where.setdefault(id(t), {})[id(table), key] = (table, key)
            mine = {**dict(self.template.named_parameters()), **dict(self.template.named_buffers())}
            self.__dict__["_slots"] = [list(where[id(mine[theirs])].values()) for _, theirs in self.names]
        return self._slots

    def _call(self, values: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The template's forward with `values` (one per name in `names`, member-shaped) in its slots: what
        `functional_call` does, without finding the slots again at every call (a member stack calls it at every
        step, under vmap). The template's own tensors are back in place when it returns or raises."""
        places = self._places()
        saved = [[table[key] for table, key in slots] for slots in places]
        try:
            for slots, v in zip(places, values):
                for table, key in slots:
                    table[key] = v
            return self.template(x)
        finally:
            for slots, old in zip(places, saved):
                for (table, key), t in zip(slots, old):
                    table[key] = t

    def forward(self, x: torch.Tensor, instruction=None, ctx=None, task=None) -> torch.Tensor:
        """x (E, N, 2) -> (E, N); instructions and tasks are not read (a member method is one static model)."""
        return self.stacked(x) if self.path.startswith("stacked") else self.looped(x)

    def stacked(
        self, x: torch.Tensor, values: list[torch.Tensor] | None = None, way: Way | None = None
    ) -> torch.Tensor:
        """x (E, N, d_in) -> (E, N): vmap over the members, in `way` (default: the probed one), with the rewrites;
        `values` (in `names` order, each (E, ...)) default to the stack's own tensors."""
        values = list(self._state().values()) if values is None else values
        way = self.way if way is None else way
        shared = self._shared()
        dims = [None if i in shared else 0 for i in range(len(values))]
        values = [v[0] if i in shared else v for i, v in enumerate(values)]

        call, args, in_dims = self._call, [values, x.unsqueeze(1)], [dims, 0]  # xe (1, N, d_in) -> (1, N)
        if way.python_mode():  # the costlier ways: every op of the member's forward seen by _VmapMode

            def call(values, x, zero):  # zero: () batched, the member dimension for tensors made in the forward
                with _VmapMode(way.detach_data, zero if way.batched_factories else None):
                    return self._call(values, x)

            args.append(torch.zeros(len(x), dtype=x.dtype, device=x.device))  # (E,)
            in_dims.append(0)
        with self._rewritten(), _plain_functions() if way.plain_functions else contextlib.nullcontext():
            out = vmap(call, in_dims=tuple(in_dims), randomness=way.randomness)(*args)
        return out.squeeze(1)  # (E, N)

    def _shared(self) -> set[int]:
        """Positions in `names` of the tensors passed to vmap once, unbatched: integer and boolean tensors equal in
        every member (index tables, sizes), which a method may read as Python values or use as masks, as vmap allows
        for an unbatched tensor only. Found once, from the stack's tensors."""
        if self.__dict__.get("_shared_at") is None:
            values = list(self._state().values())
            self.__dict__["_shared_at"] = {
                i
                for i, v in enumerate(values)
                if not (v.is_floating_point() or v.is_complex()) and bool((v == v[:1]).all())
            }
        return self._shared_at

    def looped(self, x: torch.Tensor, values: list[torch.Tensor] | None = None) -> torch.Tensor:
        """x (E, N, d_in) -> (E, N): one functional call per member, the method's own code (no rewrite)."""
        values = list(self._state().values()) if values is None else values
        return torch.cat([self._call([v[e] for v in values], x[e : e + 1]) for e in range(len(x))])  # (E, N)

    @contextlib.contextmanager
    def _rewritten(self):
        """The template's modules with the method's rewrites bound in place of their own methods (instance
        attributes, removed on exit)."""
        if not self.rewrites:
            yield
            return
        if self.__dict__.get("_bound", (None,))[0] is not self.template:  # found once per template
            bound = [
                (module, name, types.MethodType(fn, module))
                for module in self.template.modules()
                for cls, name, fn in self.rewrites
                if isinstance(module, cls)
            ]
            self.__dict__["_bound"] = (self.template, bound)
        bound = self._bound[1]
        for module, name, fn in bound:
            module.__dict__[name] = fn
        try:
            yield
        finally:
            for module, name, _ in bound:
                module.__dict__.pop(name, None)

    def train(self, mode: bool = True):
        self.template.train(mode)
        return super().train(mode)

    def _apply(self, fn, recurse=True):
        template = self.template._apply(fn, recurse)
        self.__dict__["template"], self.__dict__["_cached"], self.__dict__["_slots"] = template, None, None
        return super()._apply(fn, recurse)

    def probe(self, d_in: int) -> str:
        """Choose the path: "stacked" (or "stacked: <what was needed>") for the way in which vmap runs
        forward and backward in training mode and gives the loop's outputs and gradients (within PROBE_TOLERANCE of
        each tensor's largest entry), else "looped: <why the plain way fails>".

        The comparison runs on the first two members, in float64 where the method's code allows (so that float32
        rounding, grown through 32 layers, is not mistaken for a wrong rewrite), with the trainable tensors moved off
        their start, and in evaluation mode where the way draws random numbers (a loop and vmap draw different
        ones). Gradients are taken with autograd.grad, so no .grad is left behind."""
        full = list(self._state().values())  # (E, ...) each
        template, training = self.template, self.template.training

        def inputs(dtype):  # x (2, 3, d_in) and the first two members' tensors, (2, ...) each, in dtype
            g = torch.Generator().manual_seed(0)
            x = torch.randn(min(len(full[0]), 2), 3, d_in, generator=g, dtype=torch.float64)
            moved = []
            with torch.no_grad():  # off the start: peft's zero-initialised updates would hide a wrong rewrite
                for t in full:
                    v = t[:2]
                    if v.is_floating_point():
                        noise = torch.randn(v.shape, generator=g, dtype=torch.float64) if t.requires_grad else 0
                        v = (v.to(torch.float64) + 0.1 * noise).to(dtype)
                    moved.append(v.detach().requires_grad_(t.requires_grad))
            return x.to(full[0].device, dtype), moved

        wide, (x, moved) = template, inputs(next(self.parameters()).dtype)
        try:  # float64, where the method's own code runs in it
            wide64, (x64, moved64) = copy.deepcopy(template).to(torch.float64), inputs(torch.float64)
            self.__dict__["template"], self.__dict__["_slots"] = wide64, None
            with torch.no_grad():
                self.looped(x64, moved64)
            wide, x, moved = wide64, x64, moved64
        except Exception:  # noqa: BLE001 - code that cannot run in float64 is probed in its own dtype
            pass
        finally:
            self.__dict__["template"], self.__dict__["_slots"] = template, None
        leaves = [v for v in moved if v.requires_grad]

        def outputs(forward, *args) -> list[torch.Tensor]:
            out = forward(*args)
            grads = torch.autograd.grad((out**2).sum(), leaves, allow_unused=True)
            return [out.detach(), *(torch.zeros_like(v) if d is None else d for v, d in zip(leaves, grads))]

        why, last, way = None, None, Way()  # the plain way's failure, the last way's and what it was
        try:
            while way is not None:
                # vmap runs on a copy: a failed run may leave batched tensors in module state
                self.__dict__["template"], self.__dict__["_slots"] = copy.deepcopy(wide), None
                self.template.train(True)
                try:
                    got = outputs(self.stacked, x, moved, way)
                except Exception as err:  # noqa: BLE001 - any failure of vmap on the method's code: another way
                    first = str(err).splitlines()[0].split(". ")[0][:100] if str(err) else ""
                    why = why or f"vmap failed ({type(err).__name__}: {first})"
                    last, way = (way, f"{type(err).__name__}: {first}"), way.after(str(err))
                    continue
                if way.randomness != "error":  # compare without the draws
                    self.template.train(False)
                    got = outputs(self.stacked, x, moved, way)
                self.__dict__["template"], self.__dict__["_slots"] = wide, None
                self.template.train(way.randomness == "error")
                want = outputs(self.looped, x, moved)
                gap = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in zip(got, want))
                if gap <= PROBE_TOLERANCE:
                    self.__dict__["way"] = way
                    return "stacked" + (f": {way.note()}" if way.note() else "")
                mismatch = f"outputs or gradients differ from the loop's by {gap:.1e} (relative) on a probe batch"
                why = why or f"vmap's {mismatch}"
                last = (way, mismatch)  # a way that runs but computes otherwise: the loop
                break
        finally:
            self.__dict__["template"], self.__dict__["_slots"] = template, None
            self.template.train(training)
        if last is not None and last[1] not in why:  # then what stopped the last way tried
            why += f"; {last[0].note()}: {last[1]}"
        return f"looped: {why}"


class MemberMethod(Method):
    """A method written for one plain model (module docstring). Subclasses set `name`, `summary`, `kind` and
    `config_cls` and implement `adapt_member`."""

    kind = "static"
    strip = ""  # a prefix adapt_member's module adds to every name (peft's tuner: "model.")

    def adapt_member(self, model: nn.Module, config, targets: list[str]) -> nn.Module:
        """One member's model to train: `model` is one member of the backbone (x (1, N, 2) -> (1, N)), frozen, on
        the CPU, with `nn.Linear` layers at `targets`; randomness drawn here comes from torch's global generator,
        seeded per member. Return the module to train (the same or a wrapper), its trainable tensors marked
        requires_grad."""
        raise NotImplementedError

    def rewrites(self) -> tuple[Rewrite, ...]:
        """Functional versions of the methods of the member module's classes that vmap cannot run (module
        docstring), used on the stacked path only; none by default."""
        return ()

    def build(self, backbone, config, generators, y_train):
        like = next(backbone.parameters())
        targets = backbone.adapter_targets(getattr(config, "targets", None))
        paths = [t.path for t in targets]
        linears = [f"{p}.linear" for p in paths]
        members = []
        for e, g in enumerate(generators):
            seed = int(torch.randint(0, 2**62, (1,), generator=g))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                members.append(self.adapt_member(plain_member(backbone, e, paths), config, linears))
        stack = MemberStack(members, self.strip, backbone.n_layers, targets, self.rewrites())
        if like.device.type == "meta":  # planning's shapes-only build: one forward, so a method that cannot run
            try:  # on this backbone fails before any work
                with torch.no_grad():
                    stack.looped(torch.zeros(len(members), 3, backbone.config.d_in, dtype=like.dtype))
            except Exception as err:  # noqa: BLE001 - whatever the method's code raises, in one line
                raise ValueError(f"cannot run on {type(backbone).__name__}: {type(err).__name__}: {err}") from None
            try:
                return stack.to(device="meta")
            except (AssertionError, RuntimeError):  # a tuner whose tensors torch cannot move (shared views): its
                return stack  # one member on the CPU serves for the shapes (it is built there anyway)
        stack = stack.to(device=like.device, dtype=like.dtype)
        stack.path = stack.probe(backbone.config.d_in)
        return stack


def recorded(model: nn.Module) -> dict:
    """{"member_path": how a method written for one member ran ("stacked" or "looped: why")} for a record's
    run_info.settings, or {} for qlbench's own stacked methods."""
    return {"member_path": model.path} if isinstance(model, MemberStack) else {}
