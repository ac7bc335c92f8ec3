"""A Pareto grid's points that differ in k alone train as one stack (qlbench/experiments/pareto_stack.py): each point's
record equals the one its own plan writes alone, bit for bit, under the same path; a grid resumes point by point."""

from __future__ import annotations

import json

import pytest
import torch

from qlbench import cli
from qlbench.adapters.routing import topk_softmax
from qlbench.experiments import pareto, pareto_stack, runner
from qlbench.records import results

from helpers import settings


def test_a_k_per_member_routes_each_member_as_its_k_alone():
    """Weights and gradients of member e with k_e equal, bit for bit, those of the members of k_e routed apart; a
    planted bug (the rows of two ks swapped) does not."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, 6, generator=g, dtype=torch.float32)
    upstream = torch.randn(5, 7, 6, generator=g)
    ks = (1, 3, 1, 2, 3)

    def grads(fn, rows=slice(None)):
        x = logits.clone().requires_grad_()
        out = fn(x)
        (out * upstream[rows]).sum().backward()
        return out.detach(), x.grad

    got, got_grad = grads(lambda x: topk_softmax(x, ks))
    for k in set(ks):
        rows = [e for e, v in enumerate(ks) if v == k]
        want, want_grad = grads(lambda x, k=k, rows=rows: topk_softmax(x[rows], k), rows)
        assert torch.equal(got[rows], want) and torch.equal(got_grad[rows], want_grad[rows]), k
        assert (got[rows] > 0).sum(-1).eq(k).all()
    swapped = topk_softmax(logits, (3, 1, 1, 2, 3))
    assert not torch.equal(swapped[:2], got.detach()[:2])
    assert torch.equal(topk_softmax(logits, (2,) * 5), topk_softmax(logits, 2))  # one k: the plain path
    with pytest.raises(ValueError, match="one k per member"):
        topk_softmax(logits, (1, 2))


def per_seed(paths) -> dict:
    out = {}
    for path in paths:
        rec = results.read_record(path)
        assert rec["train_info"]["status"] == "ok", rec["train_info"]["message"]
        out[path.name] = rec["train_info"]["per_seed"]
    return out


@pytest.mark.parametrize("method", ["queryable", "moe-lora"])
def test_stacked_points_write_the_records_each_point_writes_alone(tmp_path, method):
    """Three k of one (r, M) on matyas, two seeds: one stack of six members writes the three records that the three
    points' plans write one by one, under the same paths and with the same per-seed numbers, curves and gradient
    diagnostics bit for bit."""
    grid = pareto.parse_grid("r=2 M=4 k=1,2,4")
    kw = dict(function="matyas", arch="deep-narrow", seeds=2, budget="smoke", threads=1)
    alone, _ = pareto.plans(method, grid, **settings(**kw, out_dir=tmp_path / "alone"))
    stacked, _ = pareto.plans(method, grid, **settings(**kw, out_dir=tmp_path / "stacked"))
    (group,) = pareto_stack.groups(stacked)
    assert [pt.values["k"] for pt, _ in group] == [1, 2, 4]
    paths_alone = [path for _, p in alone for path in runner.run(p, progress=False, log=lambda m: None)]
    w = pareto_stack.StackedPoints([p for _, p in group], [pt.values["k"] for pt, _ in group])
    paths_stacked = runner.run(w, progress=False, log=lambda m: None)
    assert [p.relative_to(tmp_path / "stacked") for p in paths_stacked] == [
        p.relative_to(tmp_path / "alone") for p in paths_alone
    ]
    a, s = per_seed(paths_alone), per_seed(paths_stacked)
    assert a == s
    assert len({json.dumps(v) for v in a.values()}) == 3  # the three k trained differently
    stacked_members = {results.read_record(p)["train_info"]["stacked_members"] for p in paths_stacked}
    assert stacked_members == {6}


def test_a_stacked_grid_resumes_point_by_point(tmp_path, capsys):
    """`qlbench pareto` stacks the k of each (r, M); run again after one point's record was removed, it trains that
    point alone and leaves the others' records as they were."""
    argv = ["pareto", "--function", "matyas", "--methods", "queryable", "--grid", "r=2 M=2 k=1,2", "--seeds", "2",
            "--budget", "smoke", "--out", str(tmp_path), "--threads", "1", "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    assert "points 1-2/2: queryable r=2 M=2 k=1, r=2 M=2 k=2 (one stack)" in capsys.readouterr().err
    records = sorted((tmp_path / "records").rglob("*.json"))
    assert len(records) == 2
    before = {p: (p.stat().st_mtime_ns, per_seed([p])) for p in records}
    records[0].unlink()
    assert cli.main(argv) == 0
    assert "1 grid point(s) already have a finished record" in capsys.readouterr().err
    assert records[1].stat().st_mtime_ns == before[records[1]][0]
    assert per_seed([records[0]]) == before[records[0]][1]  # trained alone: the numbers it had in the stack
