"""Several methods' stacks trained at once (`--methods-at-once`, engine.concurrently): the records are those of one
method at a time, bit for bit, eager and through the captured step (its CPU stand-in); a method that fails is a
failed record and the others are written; bad settings are refused before any work; the memory check counts every
stack that trains at once; a recording runs alone while the others wait at their next step (the gate, alone and as
the engine wires it, through the stand-in). What this cannot check without a GPU: CUDA streams, and CUDA's own
recordings beside other threads (tests/test_cuda.py, and `make gpu-check`'s run-quick, at once by default there)."""

from __future__ import annotations

import _thread
import json
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from qlbench import cli, engine
from qlbench.engine import step
from qlbench.experiments import experiment, planning

from helpers import ReplayByRerun, fail_adapting, one_line_error, settings

SWEEP = ["sweep", "--functions", "matyas,levy", "--budget", "smoke", "--seeds", "2",
         "--methods", "full-soap,lora,queryable,instruct-queryable,frozen", "--no-progress"]  # fmt: skip


def records(folder: Path) -> dict[str, tuple[str, list]]:
    """Every record's status and per-seed entries under `folder`, by its path inside."""
    out = {}
    for path in sorted(folder.rglob("*.json")):
        rec = json.loads(path.read_text())
        if "train_info" in rec:
            out[str(path.relative_to(folder))] = (rec["train_info"]["status"], rec["train_info"]["per_seed"])
    return out


def test_concurrently_keeps_the_order_the_callers_threads_and_raises_after_every_job_ended():
    started, ended = threading.Barrier(3, timeout=30), []

    def job(i: int):
        started.wait()  # all three run at once, or this times out
        ended.append(i)
        if i == 1:
            raise ValueError("planted")
        return i, torch.get_num_threads(), threading.current_thread() is threading.main_thread()

    for n in (1, 2):  # one of them differs from a new thread's default, whatever it is
        started.reset()
        with engine.num_threads(n):
            out = engine.concurrently([lambda: job(0), lambda: job(2), lambda: job(3)], 3, "cpu")
        assert out == [(0, n, False), (2, n, False), (3, n, False)]
    started.reset()
    ended.clear()
    with pytest.raises(ValueError, match="planted"):
        engine.concurrently([lambda i=i: job(i) for i in range(3)], 3, "cpu")
    assert sorted(ended) == [0, 1, 2]  # the others ran to their end
    assert engine.concurrently([lambda: threading.current_thread() is threading.main_thread()], 4, "cpu") == [True]


def test_an_interrupt_is_raised_at_once_and_no_job_starts_after_it():
    """Ctrl-C (or SIGTERM, which the CLI turns into an exception in the main thread) while stacks train at once: the
    caller gets it at once, not when the running jobs end, and the jobs not started never start. The interrupt is
    sent once both running jobs have started (an event, not a timer), and sent again until the caller has it:
    CPython runs a signal's handler at the main thread's next bytecode, which on a loaded machine can be a
    finalizer's, where a KeyboardInterrupt is reported and dropped. So the handler here raises only while
    `concurrently` is on the main thread's stack, and a dropped interrupt is followed by another."""
    release, caught, started, finished = threading.Event(), threading.Event(), [], []
    lock = threading.Lock()

    def handler(signum, frame):
        while frame is not None:
            if frame.f_code is engine.concurrently.__code__:
                raise KeyboardInterrupt
            frame = frame.f_back

    def job(i: int) -> int:
        with lock:
            started.append(i)
            both = len(started) == 2
        if both:  # both workers busy: now the caller is waiting on them
            deadline = time.perf_counter() + 10
            while not caught.wait(0.05) and time.perf_counter() < deadline:
                _thread.interrupt_main()
        release.wait(30)
        finished.append(i)
        return i

    previous = signal.signal(signal.SIGINT, handler)
    try:
        t0 = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            engine.concurrently([lambda i=i: job(i) for i in range(3)], 2, "cpu")
        caught.set()
        assert time.perf_counter() - t0 < 5  # at once: the jobs still wait on `release`
    finally:
        caught.set()
        signal.signal(signal.SIGINT, previous)
    release.set()
    deadline = time.perf_counter() + 10
    while len(finished) < 2 and time.perf_counter() < deadline:  # the two running jobs end
        time.sleep(0.01)
    time.sleep(0.2)  # a third job, were one taken, would start within this
    assert sorted(started) == [0, 1] and sorted(finished) == [0, 1]


# eager under -m slow (20 s on 2 cores; CI runs it): the default suite keeps the captured case, within about 10 minutes
@pytest.mark.parametrize("capture", [pytest.param("off", marks=pytest.mark.slow), "on"])
def test_methods_trained_at_once_write_the_records_of_one_at_a_time(tmp_path, monkeypatch, capture):
    if capture == "on":  # the captured step, with the CPU stand-in for CUDA graphs (tests/test_captured_commands.py)
        monkeypatch.setattr(step, "RECORDER", ReplayByRerun)
        monkeypatch.setattr(engine, "use_capture", lambda setting, device: setting == "on")
    argv = [*SWEEP, "--capture", capture]
    assert cli.main([*argv, "--out", str(tmp_path / "one")]) == 0
    assert cli.main([*argv, "--methods-at-once", "4", "--out", str(tmp_path / "four")]) == 0
    one, four = records(tmp_path / "one"), records(tmp_path / "four")
    assert len(one) == 10 and one.keys() == four.keys()
    for path in one:
        assert four[path] == one[path], path
        settings = [json.loads((tmp_path / run / path).read_text())["run_info"]["settings"] for run in ("one", "four")]
        assert [s["methods_at_once"] for s in settings] == [1, 4]  # stated: the wall time was shared


def test_a_method_that_fails_among_those_at_once_is_a_failed_record_and_the_others_are_written(
    tmp_path, monkeypatch, capsys
):
    fail_adapting(monkeypatch, "queryable")
    assert cli.main([*SWEEP, "--methods-at-once", "3", "--out", str(tmp_path)]) == 1
    status = {Path(p).parts[-2]: s for p, (s, _) in records(tmp_path).items()}  # records/<arch>/<function>/<method>
    assert status.pop("queryable") == "failed" and set(status.values()) == {"ok"}, status
    assert "queryable failed: RuntimeError: planted failure" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, problem",
    [
        (["--methods-at-once", "0"], "methods at once must be an integer >= 1 or auto, got 0"),
        (["--methods-at-once", "all"], "methods at once must be an integer >= 1 or auto, got 'all'"),
        (["--methods-at-once", "2", "--compile", "on"], "valid with --methods-at-once above 1: --compile auto or off"),
        (["--methods-at-once", "2", "--executor", "ray"], "--methods-at-once only applies to --executor local"),
    ],
)
def test_bad_methods_at_once_is_one_line_before_any_work(tmp_path, capsys, extra, problem):
    line = one_line_error(capsys, [*SWEEP, *extra, "--out", str(tmp_path)])
    assert problem in line
    assert not (tmp_path / "records").exists()


def test_methods_at_once_auto_trains_every_method_at_once_on_cuda_for_deep_narrow_only():
    """`--methods-at-once auto` (the CLI's default): every method's stack at once where it was measured to pay (CUDA,
    deep-narrow, stacks on this machine, not --compile on), else one at a time; an integer as given."""
    from qlbench.experiments.planning import resolve_at_once

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_at_once("auto", "deep-narrow", cuda, 9, "auto", local=True) == 9
    assert resolve_at_once("auto", "deep-narrow", cuda, 9, "off", local=True) == 9
    assert resolve_at_once("auto", "deep-narrow", cpu, 9, "auto", local=True) == 1  # the CPU: as before
    assert resolve_at_once("auto", "transformer", cuda, 9, "auto", local=True) == 1  # busy device: not measured
    assert resolve_at_once("auto", "deep-narrow", cuda, 9, "on", local=True) == 1  # compiled: one at a time
    assert resolve_at_once("auto", "deep-narrow", cuda, 9, "auto", local=False) == 1  # Ray's workers
    assert resolve_at_once(3, "transformer", cpu, 9, "auto", local=True) == 3


def test_the_cli_default_trains_one_method_at_a_time_on_the_cpu(tmp_path):
    """Without --methods-at-once (auto) on the CPU, the plan trains one method at a time, and compiles where the
    budget does, as before auto; `auto` given explicitly is the same; Ray takes auto."""
    from qlbench.commands import run as run_command

    args = cli.build_parser().parse_args(["sweep", "--arch", "deep-narrow", "--functions", "matyas"])
    assert args.methods_at_once == "auto" and run_command.check_executor(args) == "local"
    kwargs = dict(functions=["matyas"], arch="deep-narrow", budget="paper", device="cpu", out_dir=tmp_path)
    plan = experiment.plan(**settings(**kwargs, methods_at_once="auto"))
    assert plan.methods_at_once == 1 and plan.compile == experiment.plan(**settings(**kwargs)).compile


def test_compile_auto_does_not_compile_stacks_trained_at_once(tmp_path):
    kwargs = dict(functions=["matyas"], arch="deep-narrow", budget="paper", device="cpu", out_dir=tmp_path)
    assert engine.compile_by_default(torch.device("cpu"), "paper")  # what auto gives one method at a time
    assert experiment.plan(**settings(**kwargs)).compile
    assert not experiment.plan(**settings(**kwargs, methods_at_once=2)).compile
    assert not experiment.plan(**settings(**kwargs, methods_at_once=2, compile="auto")).compile


def test_the_memory_check_counts_every_stack_that_trains_at_once(tmp_path, monkeypatch):
    kwargs = dict(functions=["matyas", "levy"], arch="deep-narrow", methods=["lora", "queryable"], seeds=2)
    plan = experiment.plan(**settings(**kwargs, device="cpu", out_dir=tmp_path))
    sizes = planning.dry_build("deep-narrow", plan.configs)
    both = planning.plan_bytes(sizes, 2 * 2, "float32")  # the two functions' members in one stack
    monkeypatch.setattr(planning, "available_bytes", lambda device: both)
    assert (
        experiment.plan(**settings(**kwargs, device="cpu", out_dir=tmp_path)).stack_functions is None
    )  # one stack fits
    at_once = experiment.plan(**settings(**kwargs, device="cpu", out_dir=tmp_path, methods_at_once=2))
    assert at_once.stack_functions == 1  # two stacks of both functions do not: a function per stack
    assert experiment.plan(**settings(**kwargs, device="cpu", out_dir=tmp_path, methods_at_once=9)).stack_functions == 1


def test_each_method_trained_at_once_writes_its_records_as_it_ends(tmp_path, monkeypatch):
    """A method's adapted stack is not held until every method has trained (N stacks at once, not all of them, is
    what the memory check counts): with two at once, when the fifth method starts, at least three have ended, and
    their records are written."""
    adapt, seen = engine.adapt, {}

    def spy(pre, adaptation, *args, **kwargs):
        if adaptation.method == "frozen":  # the fifth of SWEEP's methods
            seen["written"] = {p.parts[-2] for p in (tmp_path / "records").rglob("*.json")}
        return adapt(pre, adaptation, *args, **kwargs)

    monkeypatch.setattr(engine, "adapt", spy)
    assert cli.main([*SWEEP, "--methods-at-once", "2", "--out", str(tmp_path)]) == 0
    assert len(seen["written"]) >= 3, seen


def test_a_recording_runs_alone_while_the_other_jobs_wait_at_their_next_step():
    """engine.runtime.Gate, as `concurrently` and the captured step use it on CUDA: two jobs hold the gate and step
    (pausing at each step's start); a third asks for it alone, as a recording does. It must get it while the
    others are still running (they stop at their next step rather than run to their end), no other job may step
    while it holds it, and they go on after. A recording while other threads launched broke a CUDA run (the
    Gate's docstring)."""
    from qlbench.engine.runtime import Gate

    gate, recording, finished = Gate(), threading.Event(), threading.Event()
    steps_while_recording, steps_after, alive_at_recording = [], [], []

    def job(k: int) -> None:
        deadline = time.monotonic() + 10  # a gate that never lets the recording in: the jobs end on their own
        with gate.held():
            while not finished.is_set() and time.monotonic() < deadline:
                gate.pause()
                if recording.is_set():
                    steps_while_recording.append(k)
                if finished.is_set():
                    steps_after.append(k)
                time.sleep(0.001)  # a step's launches
            gate.pause()
            steps_after.append(k)

    jobs = [threading.Thread(target=job, args=(k,), daemon=True) for k in range(2)]
    for t in jobs:
        t.start()

    def recorder() -> None:
        with gate.held():
            time.sleep(0.05)  # the others stepping meanwhile
            with gate.alone():
                alive_at_recording.extend(t.is_alive() for t in jobs)
                recording.set()
                time.sleep(0.05)
                recording.clear()
            finished.set()

    r = threading.Thread(target=recorder, daemon=True)
    r.start()
    for t in [r, *jobs]:
        t.join(30)
    assert alive_at_recording == [True, True]  # it did not wait for the jobs to end
    assert steps_while_recording == []
    assert sorted(set(steps_after)) == [0, 1]  # they went on after it


def test_no_method_replays_its_step_while_another_records_as_methods_train_at_once(tmp_path, monkeypatch):
    """The gate as the engine wires it (`engine.concurrently` holds it for each job, a recording takes it alone, a
    captured step pauses for it): methods at once through the captured step's CPU stand-in, each recording kept
    open 20 ms. No method's replay may run while another's recording is open; on CUDA one did, and broke the run
    (engine.runtime.Gate). Every method still records and replays."""
    import types

    recording, events = threading.Event(), []

    class Watchful(ReplayByRerun):
        def record(self, body, params, optimizer):
            recording.set()
            try:
                time.sleep(0.02)  # the others keep stepping meanwhile, unless the gate holds them
                graph, out = super().record(body, params, optimizer)
            finally:
                recording.clear()
            events.append(("record", threading.get_ident()))

            def replay():
                events.append(("replay while recording" if recording.is_set() else "replay", threading.get_ident()))
                graph.replay()

            return types.SimpleNamespace(replay=replay), out

    monkeypatch.setattr(step, "RECORDER", Watchful)
    monkeypatch.setattr(engine, "use_capture", lambda setting, device: setting == "on")
    argv = ["run", "--function", "matyas", "--budget", "smoke", "--seeds", "2", "--capture", "on", "--no-progress",
            "--methods", "full-soap,lora,queryable,dora", "--methods-at-once", "4", "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == 0
    kinds = [kind for kind, _ in events]
    assert kinds.count("replay while recording") == 0
    main = threading.main_thread().ident  # the pretraining, recorded before the methods start
    threads = {t for kind, t in events if kind == "record" and t != main}
    assert len(threads) == 4  # each method in its own thread: 2 batch shapes and 2 evaluation sets recorded
    assert all(sum(event == ("record", t) for event in events) == 4 for t in threads)
    assert all(("replay", t) in events for t in threads)
