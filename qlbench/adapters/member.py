"""Methods written for one plain model, stacked by qlbench: peft's tuners and methods from outside packages.

qlbench's own adapters are written for the stack (every weight (E, ...), every layer batched over members). A
`MemberMethod` is written for ONE member instead, as PyTorch code usually is: `adapt_member(model, config, targets)`
receives one member of the backbone as a plain module whose target linears are `nn.Linear` (at the dotted paths in
`targets`), changes it in place or wraps it, and returns the model to train (peft's `get_peft_model` does exactly
this). qlbench builds that once per member, each under its own seed, and trains the E results as one stack:

- stacked: every member's tensors are stacked into (E, ...) parameters (torch.func.stack_module_state's layout) and
  the forward is `vmap` over a functional call of one member's module (`MemberStack._call`), one batched computation;
- looped: the same (E, ...) parameters, and a Python loop makes the functional call with member e's slices. Used when
  vmap cannot run the method's code (random ops, in-place index writes, `.data`, an autograd.Function without a
  vmap rule) or gives other numbers than the loop on a probe batch; the reason is kept (`MemberStack.path`) and
  recorded (run_info.settings.member_path).

Both paths hold one set of (E, ...) parameters, so the engine, snapshots, checkpoints and gradient diagnostics see a
model like any other stack, and member e's numbers depend only on member e.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn as nn
from torch.func import vmap

from qlbench import stacked
from qlbench.adapters.base import Method

# vmap runs the CPU's fused attention kernel member by member (no batching rule yet) and warns at every forward;
# that is the stacked Transformer's cost, measured by `qlbench bench`, not news at each step
warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented")

PROBE_TOLERANCE = 1e-5  # relative: how far vmap's probe output may lie from the loop's before the loop is used


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

    def __init__(self, members: list[nn.Module], strip: str, n_layers: int, targets: list):
        super().__init__()
        self.__dict__["template"], self.__dict__["_cached"], self.__dict__["_slots"] = members[0], None, None
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
        return self.stacked(x) if self.path == "stacked" else self.looped(x)

    def stacked(self, x: torch.Tensor) -> torch.Tensor:
        values = list(self._state().values())  # in `names` order, each (E, ...)
        return vmap(self._call)(values, x.unsqueeze(1)).squeeze(1)  # xe (1, N, 2) -> (1, N); out (E, N)

    def looped(self, x: torch.Tensor) -> torch.Tensor:
        values = list(self._state().values())
        return torch.cat([self._call([v[e] for v in values], x[e : e + 1]) for e in range(len(x))])  # (E, N)

    def train(self, mode: bool = True):
        self.template.train(mode)
        return super().train(mode)

    def _apply(self, fn, recurse=True):
        template = self.template._apply(fn, recurse)
        self.__dict__["template"], self.__dict__["_cached"], self.__dict__["_slots"] = template, None, None
        return super()._apply(fn, recurse)

    def probe(self, d_in: int) -> str:
        """Choose the path: "stacked" when vmap runs forward and backward on a probe batch and gives the loop's
        output (within PROBE_TOLERANCE), else "looped: <why>". Gradients are taken with autograd.grad, so no
        .grad is left behind."""
        g = torch.Generator().manual_seed(0)
        like = next(self.parameters())
        x = torch.randn(like.shape[0], 3, d_in, generator=g, dtype=torch.float64).to(like.device, like.dtype)
        trainable = [p for p in self.parameters() if p.requires_grad]
        template = self.template  # vmap runs on a copy: a failed run may leave batched tensors in module state
        self.__dict__["template"], self.__dict__["_slots"] = copy.deepcopy(template), None
        try:
            got = self.stacked(x)
            torch.autograd.grad(got.sum(), trainable, allow_unused=True)
        except Exception as err:  # noqa: BLE001 - any failure of vmap on the method's code means: loop
            first = str(err).splitlines()[0].split(". ")[0][:100] if str(err) else ""
            return f"looped: vmap failed ({type(err).__name__}: {first})"
        finally:
            self.__dict__["template"], self.__dict__["_slots"] = template, None
        with torch.no_grad():
            want = self.looped(x)
        gap = float((got.detach() - want).abs().max() / want.abs().max().clamp_min(1e-12))
        if not gap <= PROBE_TOLERANCE:
            return f"looped: vmap's output differs from the loop's by {gap:.1e} (relative) on a probe batch"
        return "stacked"


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
        stack = MemberStack(members, self.strip, backbone.n_layers, targets)
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
