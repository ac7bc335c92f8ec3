"""A cell's numbers do not depend on what else is in its stack: a member trained alone, inside a wider stack, in a
two-function sweep, or after an interrupted sweep resumes gives the same per-seed results, bit for bit, on CPU in
float32 (engine.MIN_STACK; the Ray executor's `--group-size` in tests/test_ray_executor.py)."""

from __future__ import annotations

import functools

import pytest
import torch

from qlbench import adapters, cli, engine, stacked, zoo
from qlbench.adapters import base
from qlbench.records import results
from qlbench.records.store import Store

from helpers import settings

SMOKE = engine.budget("smoke", "deep-narrow")
LONE = ("matyas", 1)
LAST = ("levy", 3)
# 19 members, LONE first and LAST last. A per-member tensor of one element (a gate, the head bias) puts LONE in the
# vectorised part of PyTorch's CPU element-wise loops here (19 >= 16 lanes of two AVX2 vectors) and in the scalar
# tail alone; one of 8 elements puts LAST in the scalar tail here (19 x 8 = 152, not a multiple of 16) and on the
# vector path alone. Stacks of at most 16 members cannot tell the two paths apart (they once hid a difference).
WIDE = [LONE] + [(f, s) for s in (0, 2) for f in zoo.names() if (f, s) != LAST][:17] + [LAST]


@functools.cache
def pretrained(members: tuple[engine.Member, ...]) -> engine.Pretrained:
    """The stack's source-pretrained backbones (smoke budget, no store), computed once for every method's test."""
    return engine.pretrain(engine.Backbones("deep-narrow", SMOKE.pretrain), list(members), device="cpu")


def trained(members: list[engine.Member], method: str) -> dict[engine.Member, tuple[torch.Tensor, ...]]:
    """Per member: (source-pretrained weights, train curve, test curve, final trainable weights) in a stack of
    `members` (float32, smoke budget)."""
    pre = pretrained(tuple(members))
    config = adapters.get(method).make_config()
    res = engine.adapt(pre, engine.Adaptation(method, config, SMOKE), engine.Runtime("cpu"))
    out = {}
    for i, member in enumerate(members):
        trainable = [p.detach()[i].flatten() for p in res.model.parameters() if p.requires_grad]
        out[member] = (
            torch.cat([v[i].flatten() for v in pre.state.values()]),
            res.curves.train_mse[i],
            res.curves.test_mse[i],
            torch.cat(trainable) if trainable else torch.zeros(0),
        )
    return out


@pytest.mark.parametrize("method", adapters.names())
def test_a_member_alone_equals_the_same_member_in_a_wider_stack(method):
    wide = trained(WIDE, method)
    for who in (LONE, LAST):
        alone = trained([who], method)[who]
        for name, a, b in zip(("backbone", "train curve", "test curve", "adapter"), alone, wide[who]):
            assert torch.equal(a, b), (who, name, (a - b).abs().max().item())


def test_without_padding_a_lone_member_differs(monkeypatch):
    """Why MIN_STACK exists (measured on this project's CPUs): a one-member stack takes another matmul path for the
    one-output head, and its training drifts in the last bits. If this starts passing with padding off, the
    padding may be dropped (docs/speed.md)."""
    monkeypatch.setattr(engine.stack, "MIN_STACK", 1)  # the one reader: engine.padded
    pretrained.cache_clear()  # the cached backbones were trained with padding
    alone, wide = trained([LONE], "lora")[LONE], trained(WIDE, "lora")[LONE]
    pretrained.cache_clear()
    assert not torch.equal(alone[0], wide[0])


def test_padded_repeats_the_first_member_up_to_the_minimum():
    assert engine.padded([("a", 0)]) == [("a", 0), ("a", 0)]
    assert engine.padded(WIDE) == WIDE
    assert len(set(WIDE)) == len(WIDE) == 19
    assert engine.padded([]) == []


def per_seed(out, function: str, method: str) -> list[dict]:
    (record,) = Store(out).records(function=function, method=method)
    return results.read_record(record)["train_info"]["per_seed"]


RUN = ["--budget", "smoke", "--seeds", "1", "--methods", "lora,queryable", "--no-progress"]


@pytest.mark.slow  # 17 s on 2 cores: under -m slow (CI), so the default suite stays within about 10 minutes
def test_a_cell_alone_in_a_sweep_and_after_a_resume_gives_the_same_numbers(tmp_path, capsys):
    """One seed: the cell alone is a one-member stack, in a two-function sweep a two-member one; the resumed sweep
    trains levy alone again after matyas's records survived an interruption."""
    alone, sweep, resumed = tmp_path / "alone", tmp_path / "sweep", tmp_path / "resumed"
    assert cli.main(["run", "--function", "levy", *RUN, "--out", str(alone)]) == 0
    assert cli.main(["sweep", "--functions", "matyas,levy", *RUN, "--out", str(sweep)]) == 0
    assert cli.main(["sweep", "--functions", "matyas,levy", *RUN, "--out", str(resumed)]) == 0
    for method in ("lora", "queryable"):  # the interruption: levy's cells lost, matyas's kept
        (record,) = Store(resumed).records(function="levy", method=method)
        record.unlink()
    assert cli.main(["sweep", "--functions", "matyas,levy", *RUN, "--out", str(resumed)]) == 0
    capsys.readouterr()
    for method in ("lora", "queryable"):
        reference = per_seed(sweep, "levy", method)
        assert per_seed(alone, "levy", method) == reference
        assert per_seed(resumed, "levy", method) == reference


# The two kernel-level causes found by the 19-member test above, each with its planted bug. Widths 2 and 80: 80
# members put member 0 on the vector path of any x86 vector unit (AVX2's 16-element step, AVX-512's 32), 2 in the
# scalar tail.
VALUES = torch.linspace(-8, 8, 2001).tolist()


def member0(fn, width: int, x: float) -> torch.Tensor:
    return fn(torch.full((width,), x))[0]


@pytest.mark.parametrize("fn", [torch.sigmoid, torch.nn.functional.softplus], ids=["sigmoid", "softplus"])
def test_memberwise_gives_a_member_the_same_bits_at_any_width(fn, monkeypatch):
    same = lambda: all(
        torch.equal(
            member0(lambda t: stacked.memberwise(fn, t), 2, x), member0(lambda t: stacked.memberwise(fn, t), 80, x)
        )
        for x in VALUES
    )
    assert same()
    monkeypatch.setattr(stacked, "LANES", 1)  # planted bug: no padding, the plain kernel
    assert not same()


def test_memberwise_pads_on_the_cpu_only():
    """Off the CPU (a meta tensor stands in for a CUDA one) fn runs on its own: CUDA's element-wise kernels have no
    scalar tail to pad away, and the pad and slice kernels cost the routed layers' step time there."""
    from qlbench.bench.dispatch import KernelCount

    ops = {}
    for device in ("cpu", "meta"):
        gates = torch.zeros(3, device=device)
        with KernelCount() as seen:
            stacked.memberwise(torch.sigmoid, gates)
        ops[device] = seen.counts
    assert ops["cpu"]["constant_pad_nd"] == 1
    assert ops["meta"] == {"sigmoid": 1}


def adam_trajectory(width: int, optimizer) -> torch.Tensor:
    """Member 0's value over 50 AdamW steps of a stacked (width, 1) parameter with small gradients (as a head
    bias gets them), the other members' values and gradients drawn from the same generator at every width."""
    g = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter((torch.randn(80, 1, generator=g) * 0.01)[:width].clone())
    opt = optimizer([p])
    out = []
    for _ in range(50):
        p.grad = (torch.randn(80, 1, generator=g) * 1e-3)[:width].clone()
        opt.step()
        out.append(p.detach()[0].clone())
    return torch.cat(out)


def test_adamw_gives_a_member_the_same_update_at_any_width():
    qlbench_adamw = lambda params: base.adamw(params, 3e-3, 0.01)
    assert torch.equal(adam_trajectory(2, qlbench_adamw), adam_trajectory(80, qlbench_adamw))
    # planted bug: PyTorch's fused CPU kernel, which adamw() avoids off CUDA
    fused = lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01, fused=True)
    assert not torch.equal(adam_trajectory(2, fused), adam_trajectory(80, fused))


def test_a_plan_wider_than_the_memory_trains_in_narrower_stacks_with_the_same_numbers(tmp_path, monkeypatch):
    """With memory for two functions' stacks of three, a sweep trains a stack of two functions, then one: every
    cell's per-seed numbers equal those of the one-stack sweep, bit for bit; with memory for less than one
    function's seeds the plan is refused in one line."""
    from qlbench.experiments import experiment, planning, runner

    kw = dict(functions=["matyas", "levy", "dropwave"], methods=["lora"], budget="smoke", seeds=2)
    whole = experiment.plan(**settings(**kw, threads=1, out_dir=tmp_path / "whole"))
    assert whole.stack_functions is None
    runner.run(whole, progress=False, log=lambda m: None)
    one = planning.plan_bytes(planning.dry_build("deep-narrow", whole.configs), 2, "float32")  # one function's seeds
    monkeypatch.setattr(planning, "available_bytes", lambda device: 2 * one + one // 2)
    split = experiment.plan(**settings(**kw, threads=1, out_dir=tmp_path / "split"))
    assert split.stack_functions == 2
    said = []
    runner.run(split, progress=False, log=said.append)
    assert any(m.startswith("stack 2 of 2: dropwave") for m in said), said
    for f in kw["functions"]:
        a, b = (results.read_record(p.record_path(f, "lora"))["train_info"] for p in (whole, split))
        assert a["per_seed"] == b["per_seed"], f
        assert (a["stacked_members"], b["stacked_members"]) == (6, 2 if f == "dropwave" else 4)
    monkeypatch.setattr(planning, "available_bytes", lambda device: one - 1)
    with pytest.raises(ValueError, match="needs at least"):
        experiment.plan(**settings(**kw, out_dir=tmp_path / "none"))
