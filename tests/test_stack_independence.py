"""A cell's numbers do not depend on what else is in its stack: a member trained alone, inside a wider stack, in a
two-function sweep, or after an interrupted sweep resumes gives the same per-seed results, bit for bit, on CPU in
float32 (engine.MIN_STACK; the Ray executor's `--group-size` in tests/test_ray_executor.py)."""

from __future__ import annotations

import pytest
import torch

from qlbench import adapters, cli, engine, results
from qlbench.store import Store

SMOKE = engine.budget("smoke", "deep-narrow")
LONE = ("matyas", 1)
WIDE = [("dropwave", 0), LONE, ("levy", 0)]


def trained(members: list[engine.Member], method: str) -> tuple[torch.Tensor, ...]:
    """(source-pretrained weights, train curve, test curve, final trainable weights) of LONE in a stack of
    `members` (float32, smoke budget, no store: nothing cached between calls)."""
    i = members.index(LONE)
    pre = engine.pretrain("deep-narrow", members, SMOKE.pretrain, device="cpu")
    config = adapters.get(method).make_config()
    res = engine.adapt(pre, method, config, SMOKE, device="cpu")
    trainable = [p.detach()[i].flatten() for p in res.model.parameters() if p.requires_grad]
    return (
        torch.cat([v[i].flatten() for v in pre.state.values()]),
        res.curves.train_mse[i],
        res.curves.test_mse[i],
        torch.cat(trainable) if trainable else torch.zeros(0),
    )


@pytest.mark.parametrize("method", adapters.names())
def test_a_member_alone_equals_the_same_member_in_a_wider_stack(method):
    alone, wide = trained([LONE], method), trained(WIDE, method)
    for name, a, b in zip(("backbone", "train curve", "test curve", "adapter"), alone, wide):
        assert torch.equal(a, b), (name, (a - b).abs().max().item())


def test_without_padding_a_lone_member_differs(monkeypatch):
    """Why MIN_STACK exists (measured on this project's CPUs): a one-member stack takes another matmul path for the
    one-output head, and its training drifts in the last bits. If this starts passing with padding off, the
    padding may be dropped (docs/speed.md)."""
    monkeypatch.setattr(engine, "MIN_STACK", 1)
    alone, wide = trained([LONE], "lora"), trained(WIDE, "lora")
    assert not torch.equal(alone[0], wide[0])


def test_padded_repeats_the_first_member_up_to_the_minimum():
    assert engine.padded([("a", 0)]) == [("a", 0), ("a", 0)]
    assert engine.padded(WIDE) == WIDE
    assert engine.padded([]) == []


def per_seed(out, function: str, method: str) -> list[dict]:
    (record,) = Store(out).records(function=function, method=method)
    return results.read_record(record)["train_info"]["per_seed"]


RUN = ["--budget", "smoke", "--seeds", "1", "--methods", "lora,queryable", "--no-progress"]


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
