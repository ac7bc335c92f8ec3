"""One stack, a learning rate per member (engine/rates.py): each member of a grid stack equals, bit for bit on CPU,
the same member trained in a stack of its own rate; a rate handed to the wrong members fails that check."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from qlbench import adapters, engine
from qlbench.engine import rates

SMOKE = engine.budget("smoke", "deep-narrow")
MEMBERS = [("matyas", 1), ("levy", 3)]
GRID = (1.5e-3, 5e-3, 2e-2)


def at(lr: float) -> engine.Budget:
    return dataclasses.replace(SMOKE, adapt=dataclasses.replace(SMOKE.adapt, lr=lr))


@functools.cache
def pretrained(members: tuple[engine.Member, ...]) -> engine.Pretrained:
    return engine.pretrain(engine.Backbones("deep-narrow", SMOKE.pretrain), list(members), device="cpu")


def trained(method: str, members: list[engine.Member], lrs: list[float] | None, budget=SMOKE) -> list[torch.Tensor]:
    """Per member: its train curve, test curve and final trainable weights, concatenated."""
    pre = pretrained(tuple(members))
    config = adapters.get(method).make_config()
    adaptation = engine.Adaptation(method, config, budget, lrs=None if lrs is None else tuple(lrs))
    res = engine.adapt(pre, adaptation, engine.Runtime("cpu"), diagnostics=False)
    weights = [p.detach() for p in res.model.parameters() if p.requires_grad]
    return [
        torch.cat([res.curves.train_mse[i], res.curves.test_mse[i]] + [w[i].flatten() for w in weights])
        for i in range(len(members))
    ]


def grid_against_alone(method: str) -> list[tuple[float, float]]:
    """The largest difference of each grid member from its rate's own stack, and from the other rates' stacks."""
    stack = [m for _ in GRID for m in MEMBERS]  # rate-major: each rate's members consecutive
    grid = trained(method, stack, [lr for lr in GRID for _ in MEMBERS])
    alone = {lr: trained(method, MEMBERS, None, at(lr)) for lr in GRID}
    out = []
    for k, lr in enumerate(GRID):
        for j in range(len(MEMBERS)):
            got = grid[k * len(MEMBERS) + j]
            other = min((got - alone[o][j]).abs().max().item() for o in GRID if o != lr)
            out.append(((got - alone[lr][j]).abs().max().item(), other))
    return out


@pytest.mark.parametrize("method", ["lora", "dora", "queryable", "replora", "peft:lora"])
def test_a_member_of_a_grid_stack_equals_its_rates_own_stack_bit_for_bit(method):
    for own, other in grid_against_alone(method):
        assert own == 0.0 and other > 0.0, (own, other)


def test_a_rate_handed_to_the_wrong_members_fails_the_check(monkeypatch):
    right = rates.runs
    monkeypatch.setattr(rates, "runs", lambda lrs: right(list(reversed(lrs))))  # planted: rates in reverse order
    assert any(own > 0.0 for own, _ in grid_against_alone("lora"))


def test_one_rate_for_every_member_is_the_methods_own_optimiser():
    model = torch.nn.Linear(2, 3)
    opt = rates.member_rates(lambda lr: torch.optim.AdamW(model.parameters(), lr=lr), [1e-3] * 3)
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["lr"] == 1e-3


def test_full_soap_is_refused_with_its_reason():
    with pytest.raises(ValueError, match=r"optimiser \(StackedSoap\) takes one learning rate per stack"):
        trained("full-soap", MEMBERS, [1e-3, 5e-3])


def test_a_parameter_not_stacked_per_member_is_refused():
    shared = torch.nn.Parameter(torch.zeros(5))
    with pytest.raises(ValueError, match="not stacked per member"):
        rates.member_rates(lambda lr: torch.optim.AdamW([shared], lr=lr), [1e-3, 5e-3])


def test_as_many_rates_as_members():
    with pytest.raises(ValueError, match="3 learning rates for a stack of 2 members"):
        trained("lora", MEMBERS, [1e-3, 5e-3, 1e-2])


def test_runs_are_the_consecutive_members_of_one_rate():
    assert rates.runs([1.0, 1.0, 2.0, 1.0]) == [(1.0, 0, 2), (2.0, 2, 3), (1.0, 3, 4)]


# ---------------------------------------------------------------------------------------------------------------
# The grid workload (experiments/grid.py): records of a grid stack are those of each rate's own run


def grid_plans(out, methods=("lora", "full-soap", "frozen"), lrs=(1.5e-3, 5e-3)):
    from qlbench.experiments import experiment

    from helpers import settings

    kw = dict(functions=["matyas", "levy"], methods=list(methods), budget="smoke", seeds=2, out_dir=out)
    return [experiment.plan(**settings(**kw, lr=lr)) for lr in lrs]


def read(path) -> dict:
    import json

    return json.loads(path.read_text())


def per_seed(paths) -> dict:
    out = {}
    for p in paths:
        rec = read(p)
        for s in rec["train_info"]["per_seed"]:
            key = (rec["run_info"]["config_hash"], s["seed"])
            out[key] = (s["train_curve"], s["test_curve"], s.get("val_at_best_train"), s["test_at_best_train"])
    return out


def test_a_grid_run_writes_each_rates_own_records_and_resumes_from_them(tmp_path):
    from qlbench.experiments import experiment, grid, runner

    plans = grid_plans(tmp_path / "grid")
    logged = []
    paths = runner.run(grid.Grid(plans), progress=False, log=logged.append)
    assert len(paths) == 2 * 3 * 2  # rates x methods x functions
    for p in grid_plans(tmp_path / "alone"):  # each rate on its own: the same config hashes and the same numbers
        runner.run(p, progress=False, log=logged.append)
    alone = [path for p in grid_plans(tmp_path / "alone") for path in experiment.record_paths(p)]
    assert per_seed(paths) == per_seed(alone)
    stacked = {(r["run_info"]["config"]["method"], r["train_info"]["stacked_members"]) for r in map(read, paths)}
    assert stacked == {("lora", 8), ("full-soap", 4), ("frozen", 4)}  # lora's two rates in one stack, SOAP's apart
    again = []
    runner.run(grid.Grid(grid_plans(tmp_path / "grid")), progress=False, log=again.append)
    assert again == ["12 cell(s) already have a finished record of the same config: skipped (--force re-runs them)"]


def test_only_a_method_with_torchs_adamw_trains_its_grid_as_one_stack():
    from qlbench.experiments import grid

    assert grid.one_stack("lora") and grid.one_stack("peft:lora") and grid.one_stack("queryable")
    assert not grid.one_stack("full-soap") and not grid.one_stack("frozen")


def test_a_grid_stack_stopped_mid_way_resumes_to_the_numbers_of_one_never_stopped(tmp_path):
    """The per-member rates' optimiser state (a step count per run of one rate) goes into the snapshot and back."""

    class Stop(Exception):
        pass

    members = [m for _ in GRID for m in MEMBERS]
    pre = pretrained(tuple(members))
    config = adapters.get("lora").make_config()
    adaptation = engine.Adaptation("lora", config, SMOKE, lrs=tuple(lr for lr in GRID for _ in MEMBERS))

    def run(snapshots=None, stop=None):
        epochs = [0]

        def progress(steps):
            epochs[0] += 1
            if epochs[0] == stop:
                raise Stop

        res = engine.adapt(pre, adaptation, engine.Runtime("cpu"), progress=progress, snapshots=snapshots)
        weights = [p.detach().clone() for p in res.model.parameters() if p.requires_grad]
        return res.curves.train_mse, weights, res.curves.resumed_epoch

    whole = run()
    saved = engine.Snapshots(tmp_path / "s.pt", "key", every_s=0.0)
    with pytest.raises(Stop):
        run(saved, stop=SMOKE.adapt.epochs - 1)
    assert (tmp_path / "s.pt").is_file()
    resumed = run(saved)
    assert whole[2] is None and resumed[2] is not None  # it went on from the snapshot, not from the start
    assert torch.equal(whole[0], resumed[0]) and all(torch.equal(a, b) for a, b in zip(whole[1], resumed[1]))
