"""A method written for one member, stacked (adapters/member.py): the stack's output equals each member module called
on its own, on both paths; tied tensors take the member's value in every module that holds them."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from qlbench.adapters import member


class Tied(nn.Module):
    """x (1, N, 2) -> (1, N): two linears that share one weight (tied, as an embedding and its head are), and a
    buffer; every tensor differs per member."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
        self.b.weight = self.a.weight
        self.register_buffer("shift", torch.randn(2))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)) + self.shift).sum(-1)


def _stack(n: int = 3) -> tuple[member.MemberStack, list[Tied]]:
    members = [Tied(seed) for seed in range(n)]
    return member.MemberStack(members, "", n_layers=1, targets=[]), members


@pytest.mark.parametrize("path", ["stacked", "looped"])
def test_each_member_of_the_stack_is_that_member_called_alone_tied_weights_too(path):
    stack, members = _stack()
    x = torch.randn(3, 5, 2, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = torch.cat([m(x[e : e + 1]) for e, m in enumerate(members)])  # (E, N), the oracle: plain calls
        got = getattr(stack, path)(x)
    torch.testing.assert_close(got, want)
    # the template's own tensors are back in place after the call
    assert stack.template.b.weight is stack.template.a.weight and isinstance(stack.template.a.weight, nn.Parameter)


def test_a_swap_that_misses_the_tied_slot_fails_the_oracle(monkeypatch):
    """Planted bug: only the first slot of each tensor takes the member's value (b keeps the template's weight)."""
    stack, members = _stack()
    places = stack._places()
    monkeypatch.setitem(stack.__dict__, "_slots", [slots[:1] for slots in places])
    x = torch.randn(3, 5, 2, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = torch.cat([m(x[e : e + 1]) for e, m in enumerate(members)])
        got = stack.looped(x)
    assert any(len(slots) > 1 for slots in places)
    assert not torch.allclose(got[1:], want[1:])


def test_the_gradient_reaches_the_stacked_tensor_through_both_tied_slots():
    stack, members = _stack()
    x = torch.randn(3, 5, 2, generator=torch.Generator().manual_seed(1))
    stack.stacked(x).sum().backward()
    for e, m in enumerate(members):
        m(x[e : e + 1]).sum().backward()
        torch.testing.assert_close(stack.a.weight.grad[e], m.a.weight.grad)


def test_a_forward_that_raises_leaves_the_templates_tensors_in_place():
    stack, _ = _stack()
    before = [(name, id(t)) for name, t in stack.template.named_parameters(remove_duplicate=False)]
    with pytest.raises(RuntimeError):
        stack.looped(torch.randn(3, 5, 7))  # wrong width: the linear raises inside the swapped call
    assert [(name, id(t)) for name, t in stack.template.named_parameters(remove_duplicate=False)] == before


class Scatter(nn.Module):
    """x (1, N, 2) -> (1, N), written as a tuner may be: a size read in Python from an integer buffer, and a member's
    weights written in place into a tensor made in the forward (vmap runs neither with every tensor batched)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.register_buffer("size", torch.tensor([2, 2]))  # equal in every member
        self.register_buffer("where", torch.tensor([0, 3]))  # equal in every member
        self.values = nn.Parameter(torch.randn(2))

    def forward(self, x):
        rows, cols = self.size.tolist()
        w = torch.zeros(rows * cols)
        w[self.where] = self.values
        return (x @ w.reshape(rows, cols)).sum(-1)


def test_a_size_read_in_python_and_an_in_place_write_stack_and_give_each_member_alone():
    """The plain way fails on Scatter; the probe finds the way that runs it (tensors made in the forward carry the
    member dimension; the equal integer buffers are passed once), and member e of the stack is member e called
    alone. Planted: members whose `where` differs are not passed once, and then no way runs them."""
    members = [Scatter(seed) for seed in range(3)]
    stack = member.MemberStack(members, "", n_layers=1, targets=[])
    stack.path = stack.probe(2)
    assert stack.path.startswith("stacked: tensors created in the forward"), stack.path
    x = torch.randn(3, 5, 2, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = torch.cat([m(x[e : e + 1]) for e, m in enumerate(members)])
    torch.testing.assert_close(stack(x), want)
    members[1].size.copy_(torch.tensor([1, 4]))  # planted: one member's size differs, so the table is batched
    differs = member.MemberStack(members, "", n_layers=1, targets=[])
    assert differs.probe(2).startswith("looped: vmap failed"), differs.probe(2)
