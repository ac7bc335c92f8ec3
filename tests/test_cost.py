"""What an adapter costs (qlbench/cost.py): the CPU memory accounting against a hand count on a model whose every
tensor is known, the adapter file size against the parameter bytes, and the cost fields in records and tables."""

import json

import numpy as np
import pytest
import torch
import torch.nn as nn

from qlbench import adapters, cost, report
from qlbench.experiments import experiment, runner
from qlbench.records import results
from qlbench.report import tables
from qlbench.settings import Execution, Protocol

pytestmark = pytest.mark.xdist_group("cost")  # its module fixture trains once: its tests, one worker

F32 = torch.float32


class OneLinear(nn.Module):
    """y = g (x W) + b per member: E members, d_in -> 1, the `model(x, instruction)` signature of qlbench's stacks.
    Autograd saves x (for W's gradient), h = x W (for g's) and the parameter g itself (for h's)."""

    def __init__(self, E: int, d_in: int, frozen_bias: bool = False):
        super().__init__()
        self.W = nn.Parameter(torch.randn(E, d_in, 1))
        self.g = nn.Parameter(torch.ones(E, 1, 1))
        self.b = nn.Parameter(torch.zeros(E, 1, 1), requires_grad=not frozen_bias)

    def forward(self, x, instruction=None):
        return (torch.bmm(x, self.W) * self.g + self.b).squeeze(-1)  # (E, n)


@pytest.mark.parametrize("frozen_bias", [False, True])
def test_cpu_peak_memory_is_the_hand_count(frozen_bias):
    """On CPU the peak of a step is parameters + gradients + optimiser state + saved activations. For one bmm, an
    add and the squared error everything is known: bmm saves x (W is a parameter, counted once); the square saves
    its input (out - y); AdamW keeps exp_avg, exp_avg_sq and a float32 step per trainable parameter. The saved
    parameter g is counted once, as a parameter: counting it again as an activation (a planted bug) fails this."""
    E, n, d = 3, 64, 5
    model = OneLinear(E, d, frozen_bias)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    x, y = torch.randn(E, n, d), torch.randn(E, n)
    peak, how = cost.peak_train_bytes(model, opt, x, y)
    params = 4 * (E * d + 2 * E)
    grads = 4 * sum(p.numel() for p in trainable)
    adam = 2 * grads + 4 * len(trainable)  # exp_avg and exp_avg_sq, and a float32 scalar `step` per parameter
    saved = 4 * E * n * d + 4 * E * n + 4 * E * n  # x, h = x W, and (out - y)
    assert how == "cpu-accounting"
    assert peak == params + grads + adam + saved


def test_adapter_bytes_is_the_trainable_weights_and_not_the_backbone():
    """The adapter file holds one member's trainable weights: at least their float32 bytes, at most that plus a
    small per-tensor header; nothing for `frozen`. Counting the backbone (a planted bug) would add its 155 kB."""
    from qlbench.bench.models import stacked_model

    for name in ("lora", "queryable", "vb-lora"):
        model, _ = stacked_model("deep-narrow", name, 2, "cpu")
        n = adapters.trainable_parameter_count(model)
        tensors = sum(1 for p in model.parameters() if p.requires_grad)
        size = cost.adapter_bytes(model)
        assert 4 * n <= size <= 4 * n + 1024 * tensors, name
        total = adapters.total_parameter_count(model)
        assert size < 4 * total  # the backbone is not in it
    frozen, _ = stacked_model("deep-narrow", "frozen", 2, "cpu")
    assert cost.adapter_bytes(frozen) == 0


@pytest.mark.parametrize("budget_s, rounds", [(1e9, cost.REPEATS), (0.0, cost.MIN_REPEATS)])
def test_latency_times_fewer_rounds_only_when_they_are_slow(monkeypatch, budget_s, rounds):
    """Every model is timed in every round (warm-up first); a slow round (here: a zero time budget) cuts the timed
    rounds to MIN_REPEATS, a fast one keeps REPEATS."""
    monkeypatch.setattr(cost, "ROUND_BUDGET_S", budget_s)
    calls = {"a": 0, "b": 0}

    def counting(name):
        def forward(x, instruction=None):
            calls[name] += 1
            return x.sum(-1)

        return forward

    out = cost._latency({"a": counting("a"), "b": counting("b")}, torch.zeros(1, 4, 2))
    assert calls == {"a": cost.WARMUP + rounds, "b": cost.WARMUP + rounds}
    assert set(out) == {"a", "b"} and all(v >= 0 for v in out.values())


def test_the_smoke_budget_times_the_fewest_rounds_after_one_warm_up(monkeypatch):
    """A smoke cell's latencies: MIN_REPEATS timed rounds after one warm-up (its training is seconds long);
    every other budget REPEATS after WARMUP."""
    assert cost.repeats_for("quick") == cost.repeats_for("paper") == cost.REPEATS
    assert cost.repeats_for("smoke") == cost.MIN_REPEATS
    monkeypatch.setattr(cost, "ROUND_BUDGET_S", 1e9)
    calls = []
    cost._latency({"a": lambda x, instruction=None: calls.append(1) or x.sum(-1)}, torch.zeros(1, 4, 2), None, 3)
    assert len(calls) == 1 + cost.MIN_REPEATS


@pytest.fixture(scope="module")
def smoke_records(tmp_path_factory):
    out = tmp_path_factory.mktemp("cost")
    plan = experiment.plan(
        functions=["matyas"],
        methods=["lora", "queryable", "frozen"],
        protocol=Protocol(arch="deep-narrow", seeds=2, budget="smoke"),
        execution=Execution(device="cpu", out_dir=out),
    )
    paths = runner.run(plan, progress=False, log=lambda m: None)
    return out, paths


def test_records_carry_the_cost_and_tables_show_it(smoke_records):
    out, paths = smoke_records
    recs = {results.read_record(p)["run_info"]["config"]["method"]: results.read_record(p) for p in paths}
    for method, rec in recs.items():
        c = rec["train_info"]["cost"]
        lat = c["latency_s_per_sample"]
        assert set(lat) == {"1", "256"} and all(v > 0 for b in lat.values() for v in b.values())
        if method == "frozen":
            assert c["adapter_bytes"] == 0 and c["peak_train_bytes"] is None
        else:
            assert c["memory_method"] == "cpu-accounting"
            assert c["adapter_bytes"] >= 4 * rec["train_info"]["trainable_params"]
            # the step holds at least every parameter of the member, its gradients and AdamW's two moments
            assert c["peak_train_bytes"] > 4 * rec["train_info"]["total_params"]
    frame = results.load(out)
    assert frame[list(results.COST_COLUMNS[1:])].loc[frame["method"] != "frozen"].notna().all().all()
    t = tables.cost_table(frame).set_index("method")
    assert list(t.index) == ["lora", "queryable", "frozen"]
    assert t.loc["lora", "× LoRA"] == "1.000" and t.loc["frozen", "peak step MB"] == "-"
    lora_bytes = recs["lora"]["train_info"]["cost"]["adapter_bytes"]
    assert float(t.loc["lora", "adapter KB"]) == pytest.approx(lora_bytes / 1024, rel=1e-2)
    run_table = report.method_table(frame).set_index("method")
    assert run_table.loc["queryable", "adapter KB"] != "-" and run_table.loc["frozen", "adapter KB"] == "0"


def test_a_record_without_cost_reads_as_not_measured(smoke_records, tmp_path):
    """Records written before costs existed load with NaN costs and show '-' in the tables."""
    _, paths = smoke_records
    rec = results.read_record(paths[0])
    del rec["train_info"]["cost"]
    (tmp_path / "r.json").write_text(json.dumps(rec))
    frame = results.load([tmp_path / "r.json"])
    assert np.isnan(frame[list(results.COST_COLUMNS)].to_numpy(dtype=float)).all()
    row = tables.cost_table(frame).iloc[0]
    assert row["adapter KB"] == "-" and row["b256 × frozen"] == "-"


def test_a_failing_cost_measurement_keeps_the_record(tmp_path, monkeypatch):
    """Cost is an extra: if measuring it fails, the cell's record is still written, without a cost, and the
    failure is said."""

    def broken(*a, **k):
        raise RuntimeError("planted")

    monkeypatch.setattr(cost, "measure", broken)
    said = []
    plan = experiment.plan(
        functions=["matyas"],
        methods=["lora"],
        protocol=Protocol(arch="deep-narrow", seeds=2, budget="smoke"),
        execution=Execution(device="cpu", out_dir=tmp_path),
    )
    (path,) = runner.run(plan, progress=False, log=said.append)
    rec = results.read_record(path)
    assert rec["train_info"]["status"] == "ok" and "cost" not in rec["train_info"]
    assert any("cost not measured: RuntimeError: planted" in m for m in said)
