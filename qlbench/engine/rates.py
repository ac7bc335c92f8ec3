"""Learning rates that differ by member: one stack trains a method's whole learning-rate grid.

`member_rates(build, rates)` gives the optimiser of a stack whose member e trains at `rates[e]`. `build(lr)` is the
method's own optimiser at one rate (`Method.optimizer`); it must be torch's AdamW, whose update is element-wise.
The stack's members lie along the first axis of every trainable parameter (E, ...), so the members of one rate are
runs of consecutive indices. `MemberRates.step` applies torch's own AdamW update (`torch.optim.adam.adam`, the
function `AdamW.step` calls) to each run's slices, at the learning rate and weight decay that `build` gives that
rate's optimiser. Every element therefore takes the arithmetic of its separate run. A member trained inside a grid
stack equals, bit for bit on CPU, the member trained in a stack of its rate alone (tests/test_rates.py).

A method whose optimiser is not AdamW (full-soap's SOAP) or whose parameters are not stacked per member is refused
with the reason: its grid then trains rate by rate (experiments/grid.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.optim.adam import adam


def runs(rates: list[float]) -> list[tuple[float, int, int]]:
    """The runs of equal consecutive rates, as (rate, first member, one past the last)."""
    out: list[tuple[float, int, int]] = []
    for e, r in enumerate(rates):
        if out and out[-1][0] == r:
            out[-1] = (r, out[-1][1], e + 1)
        else:
            out.append((r, e, e + 1))
    return out


class MemberRates(torch.optim.AdamW):
    """AdamW whose member e (the first axis of every parameter) trains at its own rate; foreach, not fused, so that
    each slice takes the separate run's CPU arithmetic. `groups[k][i]`: (lr, weight_decay) of param group i in run k
    of `runs(rates)`."""

    def __init__(self, base: torch.optim.AdamW, rates: list[float], groups: list[list[tuple[float, float]]]):
        g0 = base.param_groups[0]
        super().__init__(
            [{"params": g["params"]} for g in base.param_groups],
            lr=g0["lr"],
            betas=g0["betas"],
            eps=g0["eps"],
            weight_decay=g0["weight_decay"],
            foreach=True,
        )
        self.runs, self.groups = runs(rates), groups

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MemberRates.step takes no closure")
        for i, group in enumerate(self.param_groups):
            live = [p for p in group["params"] if p.grad is not None]
            for p in live:
                state = self.state[p]
                if not state:  # as Adam._init_group, with one step count per run of one rate
                    state["step"] = torch.zeros(len(self.runs), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            beta1, beta2 = group["betas"]
            for k, (_, a, b) in enumerate(self.runs):
                lr, weight_decay = self.groups[k][i]
                adam(
                    [p[a:b] for p in live],
                    [p.grad[a:b] for p in live],
                    [self.state[p]["exp_avg"][a:b] for p in live],
                    [self.state[p]["exp_avg_sq"][a:b] for p in live],
                    [],
                    [self.state[p]["step"][k] for p in live],
                    foreach=True,
                    amsgrad=False,
                    has_complex=False,
                    beta1=beta1,
                    beta2=beta2,
                    lr=lr,
                    weight_decay=weight_decay,
                    eps=group["eps"],
                    maximize=False,
                    capturable=False,
                    differentiable=False,
                    fused=None,
                    grad_scale=None,
                    found_inf=None,
                    decoupled_weight_decay=True,
                )


def member_rates(build: Callable[[float], torch.optim.Optimizer], rates: list[float]) -> torch.optim.Optimizer:
    """The optimiser of a stack whose member e trains at rates[e] (E members, padding included): `build(rate)` itself
    where every rate is the same, else `MemberRates` over the parameters `build` gives. ValueError, with the reason,
    where the method's optimiser cannot take a rate per member."""
    distinct = list(dict.fromkeys(rates))
    built = {r: build(r) for r in distinct}
    if len(distinct) == 1:
        return built[distinct[0]]
    first = built[distinct[0]]
    if any(type(o) is not torch.optim.AdamW for o in built.values()):
        name = type(next(o for o in built.values() if type(o) is not torch.optim.AdamW)).__name__
        raise ValueError(f"its optimiser ({name}) takes one learning rate per stack, not one per member")
    params = [p for g in first.param_groups for p in g["params"]]
    for o in built.values():
        if [p for g in o.param_groups for p in g["params"]] != params:
            raise ValueError("its optimiser's parameters differ from rate to rate")
    if any(p.dim() == 0 or p.shape[0] != len(rates) for p in params):
        raise ValueError(f"some of its trainable parameters are not stacked per member (first axis {len(rates)})")
    groups = [[(g["lr"], g["weight_decay"]) for g in built[r].param_groups] for r, _, _ in runs(rates)]
    return MemberRates(first, rates, groups)
