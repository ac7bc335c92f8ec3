"""The CUDA path: every registered method trains a smoke cell on the GPU (both backbones, eager; compiled for the
routed and DoRA-family methods), CPU and CUDA agree on a smoke cell, a member trained alone equals the same member in a
wider stack, a suite's sequential schedule trains, and an interrupted sweep resumes to the numbers of a clean one.

Skipped, with the reason, on a machine without CUDA (CI); `make test-cuda` runs them where a GPU is present.

Tolerances, and why: on CUDA the same arithmetic runs in other kernels than on the CPU (cuBLAS and cuDNN choose their
algorithms by shape, and reduce in other orders), so float32 results agree to rounding, amplified by training, not bit
for bit. Measured on an NVIDIA H200 (docs/speed.md): CPU against CUDA per-seed best test MSE of a deep-narrow smoke
cell, every method, median relative difference 4.7e-8, largest 1.9e-7; the tests allow CUDA_RTOL = 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from qlbench import adapters, engine, experiment, multitask, results, runner

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device here: `make test-cuda` runs these on a machine with a GPU"
    ),
]

CUDA_RTOL = 1e-5
EVERY_METHOD = adapters.names()
COMPILED = ["lora", "dora", "doran", "queryable", "instruct-queryable"]


def cells(tmp_path, device: str, methods, arch="deep-narrow", compile="off", functions=("dropwave",), seeds=2):
    """The smoke cells' per-seed entries by (function, method), trained through the runner on `device`."""
    plan = experiment.plan(
        functions=list(functions), arch=arch, methods=list(methods), seeds=seeds, budget="smoke", device=device,
        compile=compile, out_dir=tmp_path / device,
    )  # fmt: skip
    runner.run(plan, progress=False, log=lambda m: None)
    out = {}
    for function in functions:
        for method in methods:
            rec = results.read_record(plan.record_path(function, method))
            assert rec["train_info"]["status"] == "ok", (method, rec["train_info"]["message"])
            out[function, method] = rec["train_info"]["per_seed"]
    return out


def best(per_seed) -> list[float]:
    return [s["best_test_mse"] for s in per_seed]


def every_method_trains_a_smoke_cell(tmp_path, arch):
    got = cells(tmp_path, "cuda", EVERY_METHOD, arch=arch)
    for key, per_seed in got.items():
        assert all(v is not None and v == v for v in best(per_seed)), key  # finite, not NaN


def test_every_method_trains_a_deep_narrow_smoke_cell_on_cuda_eager(tmp_path):
    every_method_trains_a_smoke_cell(tmp_path, "deep-narrow")


def test_cpu_and_cuda_agree_on_a_smoke_cell(tmp_path):
    methods = ["full-soap", "lora", "dora", "queryable", "instruct-queryable", "task-lora", "frozen"]
    cpu, cuda = cells(tmp_path, "cpu", methods), cells(tmp_path, "cuda", methods)
    for key in cpu:
        assert best(cuda[key]) == pytest.approx(best(cpu[key]), rel=CUDA_RTOL), key


def test_a_member_alone_equals_the_same_member_in_a_wider_stack_on_cuda():
    smoke = engine.budget("smoke", "deep-narrow")
    wide = [("dropwave", 0), ("levy", 1), ("matyas", 2), ("ackley", 0), ("rastrigin", 1)]
    spec = engine.Backbones("deep-narrow", smoke.pretrain)
    for method in ("lora", "queryable"):
        config = adapters.get(method).make_config()
        curves = {}
        for members in (wide[:1], wide):
            pre = engine.pretrain(spec, members, device="cuda")
            res = engine.adapt(pre, method, config, smoke, device="cuda")
            curves[len(members)] = res.curves.test_mse[0]
        # cuBLAS may pick other kernels for another stack width: rounding, amplified by training (not yet measured)
        assert torch.allclose(curves[1], curves[len(wide)], rtol=1e-4, atol=0), method


def test_a_suite_trains_its_sequential_stages_on_cuda(tmp_path):
    plan = multitask.plan(
        suite="zoo-4", schedule="sequential", arch="deep-narrow", methods=["lora", "task-lora", "instruct-queryable"],
        budget="smoke", device="cuda", out_dir=tmp_path,
    )  # fmt: skip
    for path in runner.run(plan, progress=False, log=lambda m: None):
        rec = results.read_record(path)
        assert rec["train_info"]["status"] == "ok"
        for entry in rec["train_info"]["per_seed"]:
            rows = entry["stage_task_mse"]  # (stages, tasks)
            assert len(rows) == 4 and all(v is not None for row in rows for v in row)


def test_an_interrupted_sweep_resumes_to_the_numbers_of_a_clean_one_on_cuda(tmp_path, monkeypatch):
    methods = ["lora", "queryable"]
    clean = cells(tmp_path / "clean", "cuda", methods)
    calls = []
    adapt = engine.adapt

    def interrupted(*args, **kwargs):
        if calls:
            raise KeyboardInterrupt  # the process is stopped after the first method's records
        calls.append(1)
        return adapt(*args, **kwargs)

    monkeypatch.setattr(engine, "adapt", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cells(tmp_path / "resumed", "cuda", methods)
    monkeypatch.setattr(engine, "adapt", adapt)
    resumed = cells(tmp_path / "resumed", "cuda", methods)
    for key in clean:
        assert best(resumed[key]) == pytest.approx(best(clean[key]), rel=CUDA_RTOL), key


def test_the_routed_and_dora_methods_train_compiled_on_cuda(tmp_path):
    got = cells(tmp_path, "cuda", COMPILED, compile="on")
    eager = cells(tmp_path / "eager", "cuda", COMPILED)
    for key in got:  # compiled kernels reorder sums: rounding, not another model
        assert best(got[key]) == pytest.approx(best(eager[key]), rel=1e-4), key


def test_every_method_trains_a_transformer_smoke_cell_on_cuda_eager(tmp_path):
    every_method_trains_a_smoke_cell(tmp_path, "transformer")
