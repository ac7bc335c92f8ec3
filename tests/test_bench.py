"""`qlbench bench` runs its real measurements (quick mode) and writes its report; speed itself is never asserted
(shared machines are noisy): the numbers are reported, and their consistency is what is checked here."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from qlbench import adapters, bench, cli, engine
from qlbench.bench.models import stacked_model

from helpers import ReplayByRerun, one_line_error


@pytest.mark.slow  # 44 s on 2 cores: under -m slow (CI), so the default suite stays within about 10 minutes
def test_quick_bench_writes_consistent_report(tmp_path, capsys, monkeypatch):
    from qlbench.bench import capture

    monkeypatch.setattr(capture, "AT_ONCE_CHUNK", 1)  # the at_once row at a tenth of its steps (tested below)
    assert (
        cli.main(
            [
                "bench",
                "--quick",
                "--archs",
                "deep-narrow",
                "--methods",
                "lora,queryable,instruct-queryable,mean",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.md").read_text() in capsys.readouterr().out
    assert not (tmp_path / "bench.partial.json").exists()  # the rows so far, kept only while the run goes on
    assert report["peak_gflops"] > 0
    rows = {(r["method"], r["members"]): r for r in report["throughput"]}
    # `mean` does not train; the backbones' pretraining is timed for the estimate, whichever methods are named
    assert set(rows) == {("pretraining", 5), ("lora", 5), ("queryable", 5), ("instruct-queryable", 5)}
    for r in rows.values():
        assert r["stacked"] > 0 and r["per_seed"] > 0 and r["step_gflop"] > 0
        assert r["gflops"] == pytest.approx(r["step_gflop"] * r["stacked"] / 5)
        assert 0 < r["peak_share"] < 1
    inference = {r["method"]: r for r in report["inference"]}
    assert inference["lora"]["flop_overhead_pct"] == 0
    assert inference["queryable"]["flop_overhead_pct"] > 0  # routing costs FLOPs
    assert {"train_step_overhead_pct", "forward_overhead_pct"} <= set(report["overhead"][0])
    snaps = {r["method"]: r for r in report["snapshot"]}  # what a stopped stack keeps: every trained method's
    assert set(snaps) == {"lora", "queryable", "instruct-queryable"}
    for m, r in snaps.items():  # the trained parameters and AdamW's two moments, float32: at least 12 bytes each
        model, _ = stacked_model("deep-narrow", m, 5, "cpu")
        assert r["snapshot_mb"] * 2**20 >= 12 * adapters.trainable_parameter_count(model)
        assert r["save_s"] > 0 and r["load_s"] > 0 and 0 < r["share_at_default"] < 1
    assert "Snapshots (engine/snapshot.py)" in (tmp_path / "bench.md").read_text()
    profile = {r["method"]: r for r in report["profile"]}
    assert set(profile) == {"lora", "queryable"}
    assert profile["queryable"]["aten_ops"] > profile["lora"]["aten_ops"] > 32  # at least one op per hidden layer
    for r in profile.values():
        assert 0 < r["matmul_share"] < 1 and 0 < r["gelu_share"] < 1
    assert all(r["eval_s"] > 0 for r in rows.values())
    est = report["paper_estimate"]
    assert set(est["methods"]) == {"pretraining", "lora", "queryable", "instruct-queryable"}
    assert est["measured_at"] == 5
    assert "Estimate: the full deep-narrow paper table" in (tmp_path / "bench.md").read_text()
    a = report["plain"]
    assert a["floor_e5"] > 0 and a["floor_e5_vs_plain"] > 0
    (grid,) = report["pareto_stack"]  # Queryable LoRA's k stacked; LoRA has no k
    assert grid["method"] == "queryable" and grid["points"] == 3 and grid["members"] == 5
    assert grid["alone"] > 0 and grid["stacked"] > 0 and "Pareto grid" in (tmp_path / "bench.md").read_text()
    padding = {r["method"]: r for r in report["padding"]}
    assert set(padding) == {"lora", "queryable"} and all(r["members"] == 1 for r in padding.values())
    # timing ratios are the benchmark's output, not asserted here: speed is measured by `qlbench bench`, never by timed
    # unit tests, and under `make test`'s two workers a ratio of two timings moves (0.68 seen for two members' work)
    for r in padding.values():
        assert r["alone_ms"] > 0 and r["padded_ms"] > 0 and 0 < r["cost"] < math.inf
    assert "Stack independence: a one-member cell" in (tmp_path / "bench.md").read_text()
    suite = {r["method"]: r for r in report["suite"]}  # the task controls always; the others when selected
    assert set(suite) == {"lora", *adapters.of_kind("task"), "queryable", "instruct-queryable"}
    for r in suite.values():  # a batch of four tasks against one (its ratio, as above, not asserted)
        assert r["tasks"] == 4 and r["single_ms"] > 0 and r["suite_ms"] > 0 and 0 < r["cost"] < math.inf
    assert "Multi-task suites: a suite stage's training step" in (tmp_path / "bench.md").read_text()
    assert "Kernel floor" in (tmp_path / "bench.md").read_text()
    grids = {r["method"]: r for r in report["grid"]}  # each trained method's grid in one stack against one rate
    assert set(grids) == {"lora", "queryable", "instruct-queryable"}
    for r in grids.values():
        assert r["members"] == 5 and r["rates"] == 4 and r["one"] > 0 and r["grid"] > 0 and 0 < r["grid_vs_one"]
    assert "A learning-rate grid in one stack" in (tmp_path / "bench.md").read_text()


@pytest.mark.parametrize(
    "argv, word",
    [(["--archs", "cnn"], "cnn"), (["--methods", "lora,bogus"], "bogus"), (["--threads", "0"], "threads must be")],
)
def test_bench_bad_input(argv, word, capsys):
    assert cli.main(["bench", "--quick", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and word in err[0]


def test_markdown_renders_every_section(tmp_path):
    """The full report's sections (compile rows only appear outside --quick) render from a report's fields."""
    row = dict(arch="deep-narrow", method="lora", members=5, threads=1)
    inference_row = lambda method, ms, per_s, gflop: dict(
        arch="deep-narrow", method=method, latency_ms=ms, samples_per_s=per_s, gflop=gflop
    )
    overheads = lambda latency, flop, compiled_ms, compiled: dict(
        latency_overhead_pct=latency,
        flop_overhead_pct=flop,
        compiled_latency_ms=compiled_ms,
        compiled_latency_overhead_pct=compiled,
    )
    report = dict(
        peak_gflops=100.0,
        meta={"threads": 2},
        settings={"rounds": 3, "inference_rounds": 9},
        plain=dict(
            plain=70.0,
            plain_1_thread=90.0,
            per_seed=100.0,
            stacked_e5=500.0,
            stacked_e5_vs_plain=7.1,
            stacked_e45_compiled=2200.0,
            stacked_e45_compiled_vs_plain=31.4,
            floor_e5=1000.0,
            floor_e5_vs_plain=13.9,
        ),
        throughput=[
            row | dict(stacked=500.0, per_seed=100.0, speedup=5.0, step_gflop=0.1, gflops=10.0, peak_share=0.1)
        ],
        overhead=[
            dict(
                arch="deep-narrow",
                members=5,
                train_step_overhead_pct=50.0,
                compiled_train_step_overhead_pct=-12.0,
                forward_overhead_pct=40.0,
                compiled_forward_overhead_pct=137.0,
            )
        ],
        compile=[row | dict(warmup_s=7.5, eager=600.0, compiled=800.0, speedup=1.33)],
        padding=[dict(arch="deep-narrow", method="lora", members=1, threads=1, alone_ms=2.0, padded_ms=2.5, cost=1.25)],
        profile=[row | dict(step_ms=12.5, aten_ops=2100.0, us_per_op=6.0, matmul_share=0.28, gelu_share=0.27)],
        inference=[
            inference_row("lora", 1.0, 64000.0, 0.005) | overheads(0.0, 0.0, 0.6, 0.0),
            inference_row("queryable", 4.5, 14222.0, 0.006) | overheads(350.0, 25.0, 1.35, 125.0),
            inference_row("dora", 3.0, 21333.0, 0.005),  # no overheads: not compared, not compiled
        ],
        grid=[dict(arch="deep-narrow", method="lora", members=5, rates=4, one=500.0, grid=1000.0, grid_vs_one=2.0)],
    )
    text = bench.markdown(report)
    needles = ("(9 for inference)", "x7.1 the plain loop", "| x5.0", "+50%", "-12%", "x1.33", "64,000", "2,100", "28%")
    needles += ("E = 45 compiled 2200 model-steps/s = x31.4 the plain loop",)
    needles += ("at E = 5 1000 model-steps/s = x13.9 the plain loop, of which the engine reaches 50%",)
    needles += ("compiled forward vs LoRA compiled", "| +137%")  # the compiled forwards at E
    needles += ("padded to two ms/step", "| 2.50 ", "x1.25")
    needles += ("qlbench per-seed loop 100;", "| per-seed loop model-steps/s |", "| 100.0 ")
    needles += ("| grid step / one-rate step |", "| 1,000 | x2.00  ")
    for needle in needles:
        assert needle in text, needle
    inference = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[-3:-1]] for line in text.splitlines()
                 if line.startswith("| deep-narrow |") and line.count("|") == 10}  # fmt: skip
    assert "compiled vs LoRA compiled" in text and inference["queryable"] == ["1.35", "+125%"]
    assert inference["lora"] == ["0.60", "+0%"] and inference["dora"] == ["-", "-"]  # dora: not timed compiled


def test_soap_row_times_both_optimizers_on_the_same_parameters():
    row = bench.soap_row("deep-narrow", 2, bench.Settings.make(quick=True), torch.device("cpu"))
    assert row["members"] == 2 and row["batched_ms"] > 0 and row["per_member_ms"] > 0
    assert row["speedup"] == pytest.approx(row["per_member_ms"] / row["batched_ms"], rel=1.0)  # paired median


def test_whole_periods_round_up_to_every_soaps_refresh_period():
    from qlbench.bench.timing import whole_periods
    from qlbench.soap import StackedSoap

    def soap(frequency):
        return StackedSoap([torch.nn.Parameter(torch.zeros(2, 3, 3))], lr=1e-3, precondition_frequency=frequency)

    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    assert [whole_periods(n, soap(10)) for n in (1, 4, 10, 11, 40)] == [10, 10, 10, 20, 40]
    assert whole_periods(4, adamw) == 4 and whole_periods(4) == 4  # no periodic host work: as asked
    assert whole_periods(5, soap(4), soap(6), adamw) == 12  # every one's period


@pytest.mark.parametrize("row", ["throughput", "soap_row"])
def test_every_timed_chunk_of_full_soap_holds_whole_periods_of_its_refresh(monkeypatch, row):
    """full-soap refreshes its eigenbases every tenth step, outside the captured step's recording. The quick
    bench timed 4 steps a chunk, so most rounds held no refresh and the rate left it out (on an H200 the estimate's
    full-soap step came from such chunks). Each timed call here is run once, counting the refreshes it makes: every
    call that steps a StackedSoap holds one per ten steps, and at least one."""
    from qlbench.bench import training
    from qlbench.soap import StackedSoap

    refreshes = [0]
    real = StackedSoap.refresh

    def counted(self, **how):
        refreshes[0] += 1
        real(self, **how)

    seen: dict[str, list[int]] = {}

    def once(fns, rounds, device):  # training.alternate, each fn run once, the refreshes in it counted
        for name, (fn, _) in fns.items():
            before = refreshes[0]
            fn()
            seen.setdefault(name, []).append(refreshes[0] - before)
        return {name: [1.0] * rounds for name in fns}

    monkeypatch.setattr(StackedSoap, "refresh", counted)
    monkeypatch.setattr(training, "alternate", once)
    s = bench.Settings.make(quick=True)
    if row == "throughput":
        training.throughput("deep-narrow", "full-soap", 2, s, torch.device("cpu"))
        assert seen["stacked"] == [1] and seen["per_seed"] == [1]  # 4 steps asked, 10 timed: one refresh each
    else:
        row = training.soap_row("deep-narrow", 2, s, torch.device("cpu"))
        assert seen["batched"] == [1] and seen["refresh"] == [1] and seen["per-member"] == [0]  # pytorch_optimizer's
        assert row["refresh_share"] == pytest.approx(row["refresh_ms"] / 10 / row["batched_ms"])
        assert "refresh_lapack" not in seen and "refresh_lapack_ms" not in row  # the CPU's refresh is LAPACK's
        # where the small QRs take the Householder reflections (CUDA; here the CPU made to), both refreshes side by
        # side, the one before through refresh(lapack_qr=True) (the module's setting left as it was)
        import qlbench.soap

        seen.clear()
        monkeypatch.setattr(qlbench.soap, "LAPACK_QR_DEVICES", frozenset())
        paths: list[bool] = []
        householder_q = qlbench.soap.householder_q
        monkeypatch.setattr(qlbench.soap, "householder_q", lambda a: (paths.append(True), householder_q(a))[1])
        # and, the refresh then being device work alone, it replayed from a recording too (engine/step.py's
        # CapturedRefresh; the CPU stand-in for CUDA graphs records it once, after its eager warm-up)
        from qlbench.engine import step as step_module

        recorders = []
        monkeypatch.setattr(step_module, "RECORDER", lambda d: recorders.append(ReplayByRerun(d)) or recorders[-1])
        row = training.soap_row("deep-narrow", 2, s, torch.device("cpu"))
        assert seen["refresh_lapack"] == [1] and row["refresh_lapack_ms"] > 0
        assert qlbench.soap.HOUSEHOLDER_MAX_SIZE == 64 and paths  # the Householder path taken without lapack_qr
        assert seen["refresh_recorded"] == [1] and row["refresh_recorded_ms"] > 0
        assert [r.recorded for r in recorders] == [1]


def test_paper_estimate_by_hand():
    rows = [
        dict(arch="deep-narrow", method="lora", members=45, stacked=1000.0, eval_s=0.5, threads=2),
        dict(arch="deep-narrow", method="lora", members=5, stacked=400.0, eval_s=0.1, threads=1),  # not the largest E
        dict(arch="transformer", method="lora", members=45, stacked=10.0, eval_s=9.0, threads=2),  # another arch
    ]
    est = bench.paper_estimate({"throughput": rows})
    lora = est["methods"]["lora"]
    # 45 members x 5,000 epochs x ceil(400 / 64) = 7 steps, at 1,000 model-steps/s; 501 evaluations of 0.5 s at E = 45
    assert lora["train_s"] == pytest.approx(45 * 35_000 / 1000) and lora["eval_s"] == pytest.approx(501 * 0.5)
    assert est["total_s"] == pytest.approx(1575 + 250.5) and est["measured_at"] == 45
    assert bench.paper_estimate({"throughput": rows[2:]}) is None
    assert lora["mode"] == "eager"


def test_paper_estimate_uses_compiled_rates_only_where_the_paper_budget_compiles():
    rows = [
        dict(arch="deep-narrow", method=m, members=45, stacked=1000.0, eval_s=0.5, threads=2) for m in ("lora", "dora")
    ]
    compile_rows = [dict(arch="deep-narrow", method="lora", members=45, compiled=2000.0, warmup_s=30.0)]
    report = {"throughput": rows, "compile": compile_rows}
    eager = bench.paper_estimate(report, compiled=False)["methods"]
    assert eager["lora"]["train_s"] == pytest.approx(45 * 35_000 / 1000) and eager["lora"]["mode"] == "eager"
    est = bench.paper_estimate(report, compiled=True)["methods"]
    # lora: compiled rate plus its warm-up; dora has no compiled measurement and stays at its eager rate
    assert est["lora"]["train_s"] == pytest.approx(45 * 35_000 / 2000 + 30.0) and est["lora"]["mode"] == "compiled"
    assert est["dora"]["train_s"] == pytest.approx(45 * 35_000 / 1000) and est["dora"]["mode"] == "eager"
    assert est["lora"]["eval_s"] == eager["lora"]["eval_s"]  # evaluation runs eager either way


def test_paper_estimate_on_cuda_uses_the_captured_rates():
    """On CUDA the estimate takes each method's captured step (compiled + captured where the paper budget compiles
    and the run measured it), with its warm-up (the compilation's too); a method without a capture row keeps its
    other rate."""
    rows = [
        dict(arch="deep-narrow", method=m, members=45, stacked=1000.0, eval_s=0.5, threads=2) for m in ("lora", "dora")
    ]
    capture = [
        dict(arch="deep-narrow", method="lora", members=45, captured_rate=9000.0, captured_warmup_s=2.0,
             compiled_ms=8.0, compiled_warmup_s=30.0, compiled_captured_ms=2.5, compiled_captured_warmup_s=1.5),
    ]  # fmt: skip
    report = {"throughput": rows, "capture": capture}
    est = bench.paper_estimate(report, compiled=False)["methods"]
    assert est["lora"]["train_s"] == pytest.approx(45 * 35_000 / 9000 + 2.0) and est["lora"]["mode"] == "captured"
    assert est["dora"]["mode"] == "eager"
    est = bench.paper_estimate(report, compiled=True)["methods"]
    # 45 members in 2.5 ms per step: 18,000 model-steps/s; the compilation (timed in the compiled variant, which the
    # compiled + captured one reuses) and the recording both paid
    assert est["lora"]["train_s"] == pytest.approx(45 * 35_000 / 18_000 + 30.0 + 1.5)
    assert est["lora"]["mode"] == "compiled + captured"


def test_the_estimate_counts_the_backbones_pretraining_once_at_its_own_length():
    """The `pretraining` row is the paper budget's pretraining of the 45 members (once per arch, shared by every
    method): 300 epochs of the 2,400 source samples at batch 64 (11,400 steps per member, against an adaptation's
    35,000), evaluated twice on the source's 3,000 samples (the timed evaluation is of the target's 1,200)."""
    rows = [
        dict(arch="deep-narrow", method=m, members=5, stacked=100.0, eval_s=0.4, threads=2)
        for m in ("pretraining", "lora")
    ]
    est = bench.paper_estimate({"throughput": rows})
    pre, lora = est["methods"]["pretraining"], est["methods"]["lora"]
    assert pre["train_s"] == pytest.approx(45 * 300 * 38 / 100.0)  # ceil(2400 / 64) = 38 steps per epoch
    assert lora["train_s"] == pytest.approx(45 * 5000 * 7 / 100.0)
    assert pre["eval_s"] == pytest.approx(2 * 0.4 * 3000 / 1200 * 45 / 5)
    assert est["total_s"] == pytest.approx(pre["total_s"] + lora["total_s"])
    from qlbench.bench import models

    (model, opt), _ = models.stacked_copies("deep-narrow", models.PRETRAINING, 3, "cpu", 2)
    trained = {id(p) for g in opt.param_groups for p in g["params"]}
    assert trained == {id(p) for p in model.parameters()} and opt.param_groups[0]["lr"] == 3e-3  # every weight


def test_a_method_timed_only_at_a_narrower_stack_is_scaled_from_it_not_left_out():
    """full-soap's and pretraining's Transformers are timed at E = 5 alone where the others run at 45 too: the
    estimate scales each from its widest row (and says so) instead of dropping it from the table's total."""
    rows = [dict(arch="transformer", method="lora", members=E, stacked=10.0 * E, eval_s=0.1 * E, threads=2)
            for E in (5, 45)]  # fmt: skip
    rows.append(dict(arch="transformer", method="full-soap", members=5, stacked=20.0, eval_s=0.5, threads=2))
    est = bench.paper_estimate({"throughput": rows}, "transformer")
    soap, lora = est["methods"]["full-soap"], est["methods"]["lora"]
    assert soap["train_s"] == pytest.approx(45 * 35_000 / 20.0) and soap["measured_at"] == 5
    assert soap["eval_s"] == pytest.approx(501 * 0.5 * 45 / 5)  # its evaluation scaled from its own 5 members too
    assert lora["train_s"] == pytest.approx(45 * 35_000 / 450.0) and "measured_at" not in lora  # from its 45
    assert est["total_s"] == pytest.approx(soap["total_s"] + lora["total_s"]) and est["measured_at"] == 45
    from qlbench.bench import output

    assert "(full-soap at E = 5)" in "".join(output.estimate(est))


def test_the_estimate_adds_what_tf32_matmuls_would_give_where_measured():
    """A capture row with a TF32 step gives the method's total at that rate (the same evaluation), and the table's
    TF32 total only when every method has one; the training step the estimate reports stays float32's."""
    rows = [dict(arch="transformer", method=m, members=5, stacked=50.0, eval_s=0.5, threads=16) for m in ("a", "b")]
    capture = [
        dict(arch="transformer", method="a", members=45, captured_rate=45e3 / 16.0, captured_warmup_s=2.0,
             captured_tf32_ms=4.0, captured_tf32_warmup_s=3.0, eval_s=0.5),
        dict(arch="transformer", method="b", members=45, captured_rate=45e3 / 20.0, captured_warmup_s=2.0, eval_s=0.5),
    ]  # fmt: skip
    est = bench.paper_estimate({"throughput": rows, "capture": capture}, "transformer")
    a = est["methods"]["a"]
    assert a["train_s"] == pytest.approx(35_000 * 16.0 / 1e3 + 2.0)  # 45 members share each 16 ms step
    assert a["tf32_total_s"] == pytest.approx(35_000 * 4.0 / 1e3 + 3.0 + a["eval_s"])
    assert "tf32_total_s" not in est["methods"]["b"] and "tf32_total_s" not in est  # b's TF32 step not measured
    capture[1] |= dict(captured_tf32_ms=5.0, captured_tf32_warmup_s=1.0)
    est = bench.paper_estimate({"throughput": rows, "capture": capture}, "transformer")
    assert est["tf32_total_s"] == pytest.approx(sum(m["tf32_total_s"] for m in est["methods"].values()))
    from qlbench.bench import output

    text = "".join(output.estimate(est))
    assert f"{est['tf32_total_s'] / 3600:.2f} h if the captured steps' matmuls used TF32" in text
    assert "captured with TF32 matmuls" in text


def test_the_estimate_adds_the_adaptation_steps_at_their_roofline_floor():
    """A capture row's roofline floor gives the method's adaptation steps at that floor (35,000 steps of the stack
    of 45, no evaluation, no warm-up; scaled linearly from a narrower stack), and the table's only when every
    method has one; the line under the estimate's heading says it."""
    rows = [dict(arch="transformer", method=m, members=5, stacked=50.0, eval_s=0.5, threads=16) for m in ("a", "b")]
    capture = [
        dict(arch="transformer", method="a", members=45, captured_rate=45e3 / 16.0, captured_warmup_s=2.0,
             roofline_ms=4.0, eval_s=0.5),
        dict(arch="transformer", method="b", members=5, captured_rate=5e3 / 8.0, captured_warmup_s=2.0, eval_s=0.5),
    ]  # fmt: skip
    est = bench.paper_estimate({"throughput": rows, "capture": capture}, "transformer")
    assert est["methods"]["a"]["floor_s"] == pytest.approx(35_000 * 4.0 / 1e3)
    assert "floor_s" not in est["methods"]["b"] and "floor_s" not in est
    capture[1]["roofline_ms"] = 1.0  # at 5 members: 9 such stacks for the 45
    est = bench.paper_estimate({"throughput": rows, "capture": capture}, "transformer")
    assert est["methods"]["b"]["floor_s"] == pytest.approx(9 * 35_000 * 1.0 / 1e3)
    assert est["floor_s"] == pytest.approx(35_000 * (4.0 + 9 * 1.0) / 1e3)
    from qlbench.bench import output

    text = "".join(output.estimate(est))
    assert (
        f"the adaptation steps alone would take {est['floor_s'] / 3600:.2f} h at the captured steps' roofline" in text
    )
    assert "adaptation h at the roofline floor" in text


def test_on_cuda_the_estimate_takes_each_methods_widest_captured_stack():
    """On a GPU a step's time barely grows with its members (an H200: LoRA captured 1.17 ms at E = 45 against 0.97
    at E = 5), so the estimate takes each method's captured rate at the widest stack measured, not E = 5's scaled;
    a CUDA run measures the paper's width (45) whatever its E, except the Transformer's per-member SOAP."""
    rows = [dict(arch="deep-narrow", method="lora", members=5, stacked=500.0, eval_s=0.5, threads=1)]
    capture = [
        dict(arch="deep-narrow", method="lora", members=45, captured_rate=38_000.0, captured_warmup_s=1.0),
        dict(arch="deep-narrow", method="lora", members=5, captured_rate=5000.0, captured_warmup_s=1.0),
    ]
    est = bench.paper_estimate({"throughput": rows, "capture": capture})
    assert est["methods"]["lora"]["train_s"] == pytest.approx(45 * 35_000 / 38_000 + 1.0)
    assert est["methods"]["lora"]["eval_s"] == pytest.approx(501 * 0.5 * 45 / 5)  # no evaluation timed at 45
    assert est["captured_at"] == 45 and est["measured_at"] == 5
    from qlbench.bench import output

    assert "captured steps at E = 45" in "".join(output.estimate(est))
    # an evaluation of the stack of 45 timed too (as it barely grows with the members): taken as measured
    capture[0]["eval_s"], capture[1]["eval_s"] = 0.6, 0.55
    est = bench.paper_estimate({"throughput": rows, "capture": capture})
    assert est["methods"]["lora"]["eval_s"] == pytest.approx(501 * 0.6)
    assert "captured steps and their evaluations at E = 45" in "".join(output.estimate(est))

    from qlbench.bench import schedule

    s = bench.Settings.make(quick=True)
    labels = [
        label for label, _ in schedule.tasks(["deep-narrow", "transformer"], ["full-soap", "lora"], s, "cuda", {})
    ]
    assert {
        "deep-narrow capture lora E=45",
        "transformer capture lora E=45",
        "transformer capture full-soap E=5",
    } <= set(labels)
    assert "transformer capture full-soap E=45" in labels  # on a GPU's memory (a row that does not fit is skipped)
    # the estimate's rows first: a bench stopped at a GPU call's time limit keeps them
    assert labels.index("deep-narrow capture full-soap E=45") < labels.index("deep-narrow capture lora E=5")
    cpu = [label for label, _ in schedule.tasks(["deep-narrow"], ["lora"], s, "cpu", {})]
    assert not any("capture" in label for label in cpu)
    # full-soap's optimiser step and refresh at the paper's width too on CUDA (its refresh's 3,060 QRs), not the
    # Transformer's 45 per-member SOAP states; on the CPU at the settings' widths only
    assert {"deep-narrow SOAP E=5", "deep-narrow SOAP E=45", "transformer SOAP E=5"} <= set(labels)
    assert "transformer SOAP E=45" not in labels
    cpu = [label for label, _ in schedule.tasks(["deep-narrow"], ["full-soap"], s, "cpu", {}) if "SOAP" in label]
    assert cpu == ["deep-narrow SOAP E=5"]


def test_a_runs_capture_rows_get_its_measured_rates_for_their_floor(monkeypatch):
    """The capture rows take the rates the run measured at its start (matmul peak, memory bandwidth) for their
    roofline floor; a report without a bandwidth (an older run's), none."""
    from qlbench.bench import schedule

    given = []
    monkeypatch.setattr(schedule, "capture_row", lambda *args: given.append(args[-1]) or dict(arch="deep-narrow"))
    s = bench.Settings.make(quick=True)
    for report, rates in [(dict(peak_gflops_start=49e3, bandwidth_gbs=4e3), (49e3, 4e3)), ({}, None)]:
        report |= dict(capture=[])
        todo = dict(schedule.tasks(["deep-narrow"], ["lora"], s, "cuda", report))
        todo["deep-narrow capture lora E=45"]()
        assert given.pop() == rates and len(report["capture"]) == 1


def test_capture_table_and_both_estimates_render():
    """A CUDA run's report: the capture table (compiled columns only when measured) and one estimate per backbone."""
    row = dict(arch="deep-narrow", method="lora", members=5, threads=1, eager_ms=8.5, captured_ms=0.97,
               captured_speedup=8.8, captured_warmup_s=0.4, eager_kernels=468.0, captured_kernels=465.0,
               captured_us_per_kernel=2.09, captured_rate=5150.0)  # fmt: skip
    est = lambda arch: dict(arch=arch, measured_at=5, members=45, total_s=3600.0, methods={"lora": dict(
        train_s=3000.0, eval_s=600.0, total_s=3600.0, mode="captured")})  # fmt: skip
    report = dict(meta=dict(threads=16), settings=dict(rounds=3, inference_rounds=9), peak_gflops=49000.0,
                  throughput=[], inference=[], capture=[row],
                  paper_estimates=[est("deep-narrow"), est("transformer")])  # fmt: skip
    text = bench.markdown(report)
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines() if line.startswith("| deep")]
    assert ["deep-narrow", "lora", "5", "1", "8.500", "0.970", "x8.8", "0.4", "468", "465", "2.09"] in cells
    assert "compiled + captured ms" not in text  # not measured: no column
    assert "kernel time ms, captured" not in text and "the most of the device's time" not in text  # nor these
    assert "full deep-narrow paper table" in text and "full transformer paper table" in text

    # with the profiler's kernel times: the device's busy share, and the top kernels of the widest stack only
    top = lambda name, us: [dict(kernel=name + "<" + "x" * 200 + ">", per_step=2.0, us_per_step=us, share=0.75)]
    rows = [row | dict(captured_kernel_ms=0.485, captured_busy=0.5, captured_top_kernels=top("narrow_gemm", 9.0)),
            row | dict(members=45, captured_ms=1.2, captured_kernel_ms=1.08, captured_busy=0.9,
                       captured_top_kernels=top("wide_gemm", 480.0))]  # fmt: skip
    text = bench.markdown(report | dict(capture=rows))
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines() if line.startswith("| deep")]
    assert ["deep-narrow", "lora", "45", "1", "8.500", "1.200"] == cells[1][:6] and cells[1][-2:] == ["1.080", "90%"]
    assert "roofline floor ms" not in text and "memory bandwidth (a" not in text  # not measured: no column, no line
    rows = [r | dict(roofline_ms=0.3, roofline_share=0.25) for r in rows]
    text = bench.markdown(report | dict(capture=rows, bandwidth_gbs=4321.0))
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines() if line.startswith("| deep")]
    assert cells[1][-4:] == ["1.080", "90%", "0.300", "25%"]
    assert "memory bandwidth (a 256 MiB copy, at the start of the run): 4321.0 GB/s" in text
    assert "narrow_gemm" not in text
    name = "wide_gemm<" + "x" * 80  # cut to bench.output.KERNEL_NAME characters
    assert ["deep-narrow", "lora", "45", name, "2", "480.0", "75%"] in cells


@pytest.mark.slow
def test_compiled_bench_paths_measure_every_arm():
    """The paths `qlbench bench` takes outside --quick: the plain-loop comparison's stacks eager and compiled,
    Queryable LoRA against LoRA compiled, and a compile row, at a tiny size (compilation dominates: about two
    minutes)."""
    s = bench.Settings({"deep-narrow": 2}, 1, (2,), 1, 1, True)
    cpu = torch.device("cpu")
    a = bench.plain_loop(s, cpu)
    assert {"stacked_e2", "stacked_e2_compiled", "stacked_e2_vs_plain", "stacked_e2_compiled_vs_plain"} <= set(a)
    assert a["floor_e2_vs_plain"] == pytest.approx(a["floor_e2"] / a["plain"])
    assert a["stacked_e2_compiled_vs_plain"] == pytest.approx(a["stacked_e2_compiled"] / a["plain"])  # one round
    o = bench.overhead("deep-narrow", 2, s, cpu)
    for key in ("compiled_train_step_overhead_pct", "compiled_forward_overhead_pct"):
        assert math.isfinite(o[key]) and o[key] > -100, key
    rows = {r["method"]: r for r in bench.inference("deep-narrow", ["lora", "queryable", "dora"], s, cpu)}
    assert rows["queryable"]["compiled_latency_ms"] > 0 and "compiled_latency_ms" not in rows["dora"]
    assert rows["lora"]["compiled_latency_overhead_pct"] == pytest.approx(0.0)  # LoRA against itself
    assert rows["queryable"]["compiled_latency_overhead_pct"] == pytest.approx(
        100 * (rows["queryable"]["compiled_latency_ms"] / rows["lora"]["compiled_latency_ms"] - 1), rel=1.0
    )  # one round: the paired ratio is the ratio of the medians
    row = bench.compile_row("deep-narrow", "lora", 2, s, cpu)
    assert row["warmup_s"] > 0 and row["compiled"] > 0 and row["eager"] > 0
    est = bench.paper_estimate(
        {
            "throughput": [
                dict(arch="deep-narrow", method="lora", members=2, stacked=row["eager"], eval_s=0.1, threads=1)
            ],
            "compile": [row],
        },
        compiled=True,
    )
    assert est["methods"]["lora"]["mode"] == "compiled"


def test_list_schedule_takes_tasks_in_order_on_the_first_free_worker():
    tasks = {m: dict(total_s=t) for m, t in [("a", 5.0), ("b", 1.0), ("c", 1.0), ("d", 4.0)]}
    # worker 0: a (5); worker 1: b, c, d (1 + 1 + 4 = 6): the order is kept, not sorted by length
    assert bench.list_schedule(tasks, 2) == 6.0
    assert bench.list_schedule(tasks, 1) == 11.0
    assert bench.list_schedule(tasks, 4) == 5.0


def test_paper_estimate_adds_the_parallel_line_only_when_tasks_fit_side_by_side():
    def report(threads):
        rows = [
            dict(arch="deep-narrow", method=m, members=45, stacked=rate, eval_s=0.0, threads=threads)
            for m, rate in (("lora", 1000.0), ("queryable", 500.0), ("dora", 1000.0))
        ]
        return {"throughput": rows, "meta": {"cpu_count": 2}}

    assert "parallel" not in bench.paper_estimate(report(2))
    est = bench.paper_estimate(report(1))
    one = 45 * 35_000 / 1000  # lora's and dora's hours; queryable's is twice that
    assert est["total_s"] == pytest.approx(4 * one)
    assert est["parallel"] == dict(workers=2, threads=1, total_s=pytest.approx(2 * one))


def test_side_by_side_runs_real_worker_processes():
    """Spawned workers, each its own stack: worker 0 alone, then all at once, one round (eager, tiny windows)."""
    s = bench.Settings({"deep-narrow": 2}, 1, (2,), 1, 1, False, side_by_side_s=0.3)
    (row,) = bench.side_by_side("deep-narrow", ["lora"], 2, s, torch.device("cpu"))
    assert row["workers"] == max(1, (os.cpu_count() or 1) // row["threads"]) and row["compiled"] is False
    assert row["alone"] > 0 and row["together"] > 0
    assert row["together_vs_alone"] == pytest.approx(row["together"] / row["alone"])  # one round


def test_a_dead_side_by_side_worker_is_one_error_not_a_hang():
    s = bench.Settings({"deep-narrow": 2}, 1, (2,), 1, 1, False, side_by_side_s=0.3)
    with pytest.raises(RuntimeError, match="side-by-side benchmark worker exited with code"):
        bench.side_by_side("deep-narrow", ["no-such-method"], 2, s, torch.device("cpu"))


def test_paper_estimate_slows_parallel_tasks_by_the_measured_side_by_side_ratio():
    rows = [
        dict(arch="deep-narrow", method=m, members=45, stacked=rate, eval_s=0.0, threads=1)
        for m, rate in (("lora", 1000.0), ("queryable", 500.0), ("dora", 1000.0))
    ]
    side = [
        dict(arch="deep-narrow", method="lora", members=45, workers=2, together_vs_alone=0.5),
        dict(arch="deep-narrow", method="queryable", members=45, workers=2, together_vs_alone=1.0),
        dict(arch="deep-narrow", method="lora", members=5, workers=2, together_vs_alone=0.1),  # another E: ignored
    ]
    est = bench.paper_estimate({"throughput": rows, "meta": {"cpu_count": 2}, "side_by_side": side})
    one = 45 * 35_000 / 1000
    par = est["parallel"]
    assert par["total_s"] == pytest.approx(2 * one)  # the solo-rate schedule is still reported
    # lora 2 one (one at x0.5), queryable 2 one (x1.0), dora one / 0.75 (the mean ratio): lora | queryable, then dora
    assert par["measured_total_s"] == pytest.approx(2 * one + one / 0.75)
    assert par["together_vs_alone"] == {"lora": 0.5, "queryable": 1.0}
    text = bench.markdown(
        {
            "meta": {"threads": 1},
            "settings": {"rounds": 3, "inference_rounds": 9},
            "peak_gflops": 100.0,
            "throughput": [],
            "overhead": [],
            "compile": [],
            "inference": [],
            "paper_estimate": est,
            "side_by_side": [
                dict(side[0], threads=1, compiled=True, alone=1000.0, together=500.0),
            ],
        }
    )
    assert "lora x0.50, queryable x1.00" in text and f"{(2 * one + one / 0.75) / 3600:.2f} h with each" in text
    assert "| deep-narrow | lora   | 45 | 1       | 2                 | compiled | 1,000" in text


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("plant", [None, "scale", "adam"])
def test_lora_floor_step_trains_exactly_like_the_engine(plant, compile):
    """The kernel floor (eager, and compiled under -m slow) must do the work of a real step, no less: its
    hand-written backward and fused AdamW update move the LoRA factors as engine.make_step (autograd,
    torch.optim.AdamW) does, over steps that change B from zero. A planted error (the floor run with s = 1 instead
    of alpha / r; a wrong AdamW beta) fails."""
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    data = [(x.double(), y.double()) for x, y in bench.batches(3, cpu, n=2)]
    models = [bench.stacked_model("deep-narrow", "lora", 3, cpu)[0].double() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    for m in models:  # a backbone whose gradients reach every layer (the default init's are ~1e-10 deep down)
        torch.manual_seed(1)
        for p in m.parameters():
            if not p.requires_grad:
                p.data.normal_(0, 0.3)
    opts = [adapters.get("lora").optimizer(m, None, 5e-3, 0.01) for m in models]
    engine_step = engine.make_step(models[0], opts[0])
    floor_step = bench.lora_floor_step(models[1], opts[1], compile=compile)
    if plant == "scale":
        for layer in models[1].hidden:
            layer.scale = 1.0  # merge and gradients without s = alpha / r = 2
    if plant == "adam":
        opts[1].param_groups[0]["betas"] = (0.8, 0.999)
    for i in range(6):
        engine_step(*data[i % 2])
        floor_step(*data[i % 2])
    close = all(
        torch.allclose(a, b, rtol=1e-9, atol=1e-12)
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True)
    )
    assert close == (plant is None)
    moved = models[0].hidden[5].lora_B.abs().max()
    assert moved > 1e-3  # B started at zero: the comparison is not of untouched parameters


def test_only_runs_the_measurements_of_the_kinds_named(monkeypatch, tmp_path, capsys):
    """Every measurement has a kind, the report key it writes (so `--only` can name it); `--only throughput` runs
    the throughput rows and nothing else, and the report shows neither the other tables nor their empty headers.
    An unknown kind is a one-line usage error naming the valid ones, before anything is measured."""
    from qlbench.bench import schedule

    s = bench.Settings.make(quick=True)
    for device in ("cpu", "cuda"):
        todo = schedule.tasks(["deep-narrow", "transformer"], adapters.names(), s, device, {})
        assert {fn.kind for _, fn in todo} <= set(bench.KINDS)
    ran = []
    real = schedule.tasks

    def recording(*a, **k):  # the measurements themselves replaced: which ones run is what is checked
        return [(label, schedule.kind(fn.kind, lambda label=label: ran.append(label))) for label, fn in real(*a, **k)]

    monkeypatch.setattr(schedule, "tasks", recording)
    monkeypatch.setattr(schedule, "matmul_peak", lambda device: 1.0)
    report = bench.run(
        ["deep-narrow"], ["lora", "queryable"], s, torch.device("cpu"), progress=False, only={"throughput"}
    )
    assert ran == ["deep-narrow pretraining E=5", "deep-narrow lora E=5", "deep-narrow queryable E=5"]
    assert "### Inference" not in bench.markdown(report)
    full = bench.run(["deep-narrow"], ["lora"], s, torch.device("cpu"), progress=False)
    assert "### Inference" in bench.markdown(full)  # a full run shows it (rows or not)
    line = one_line_error(capsys, ["bench", "--quick", "--only", "throughput,kernels", "--out", str(tmp_path / "b")])
    assert "unknown measurement kind kernels; valid: plain, throughput" in line


# what the profiler gives a capture row in place of CUDA's kernels: per step, two 20 µs matmuls and one 5 µs GELU
PROFILED = [("sgemm", 20.0), ("gelu", 5.0), ("sgemm", 20.0)] * 3  # capture.PROFILED_STEPS


def test_kernel_summary_counts_times_and_ranks_the_kernels_per_step():
    from qlbench.bench import capture

    kernels = [("a", 1.0), ("b", 10.0), ("c", 4.0), ("a", 1.0), ("b", 10.0), ("c", 4.0), ("d", 0.0), ("d", 0.0)]
    out = capture.kernel_summary(kernels, steps=2, top=2)  # per step: a 1 µs, b 10 µs, c 4 µs, d 0 µs
    assert out["kernels"] == 4 and out["kernel_ms"] == pytest.approx(15e-3)
    assert out["top"] == [
        dict(kernel="b", per_step=1.0, us_per_step=10.0, share=pytest.approx(10 / 15)),
        dict(kernel="c", per_step=1.0, us_per_step=4.0, share=pytest.approx(4 / 15)),
    ]
    assert capture.kernel_summary([], steps=3) == dict(kernels=0, kernel_ms=0, top=[])


def test_a_capture_row_times_its_stacks_evaluation(monkeypatch):
    """`capture_row` (CUDA only) run on the CPU stand-in for CUDA graphs, with the profiler's kernels stubbed: its row
    has every column the capture table and the estimate read, the stack's evaluation time among them, and the
    captured step's kernels summed and ranked per step."""
    from qlbench.bench import capture, dispatch
    from qlbench.engine import step as step_module

    from helpers import ReplayByRerun

    monkeypatch.setattr(step_module, "RECORDER", ReplayByRerun)
    monkeypatch.setattr(capture, "profiled_kernels", lambda step, data, device: PROFILED)
    s = bench.Settings.make(quick=True)
    precisions = []  # the float32 matmul precision each recording was made under

    class Spy(ReplayByRerun):
        def record(self, body, params, optimizer):
            precisions.append(torch.get_float32_matmul_precision())
            return super().record(body, params, optimizer)

    monkeypatch.setattr(step_module, "RECORDER", Spy)
    row = capture.capture_row("deep-narrow", "lora", 2, s, torch.device("cpu"), rates=(1000.0, 100.0))
    assert row["members"] == 2 and row["eval_s"] > 0 and row["eval_eager_s"] > 0 and row["captured_rate"] > 0
    # the roofline floor of the same step at the rates given (1,000 GFLOP/s, 100 GB/s), and the step's share of it
    floor = dispatch.roofline_ms(dispatch.step_traffic("deep-narrow", "lora", 2), 1000.0, 100.0)
    assert row["roofline_ms"] == pytest.approx(floor) and row["roofline_share"] == pytest.approx(
        floor / row["captured_ms"]
    )
    assert {"eager_ms", "captured_ms", "captured_speedup", "captured_warmup_s", "captured_us_per_kernel"} <= set(row)
    assert row["captured_kernels"] == 3 and row["captured_kernel_ms"] == pytest.approx(45e-3)
    assert row["captured_busy"] == pytest.approx(45e-3 / row["captured_ms"])
    assert [(k["kernel"], k["per_step"], k["us_per_step"]) for k in row["captured_top_kernels"]] == [
        ("sgemm", 2, 40.0),
        ("gelu", 1, 5.0),
    ]
    # the TF32 variant: recorded under "high" (a recording keeps the kernels chosen then), and the setting restored
    assert {"captured_tf32_ms", "captured_tf32_warmup_s", "tf32_speedup"} <= set(row)
    # then the evaluation's two sets, recorded as a captured stage records them (float32's precision)
    assert precisions == ["highest", "high", "highest", "highest"]
    assert torch.get_float32_matmul_precision() == "highest"


def test_a_capture_row_releases_its_recordings_even_when_it_fails(monkeypatch):
    """`capture_row` closes every step it built once measured, as a training stage does at its end (engine.fit):
    the recordings (on CUDA their graphs and memory pools) are released inside the row, not left to the next row's
    torch._dynamo reset or to the interpreter's exit; also when a measurement inside the row raises."""
    from qlbench.bench import capture
    from qlbench.engine import step as step_module

    from helpers import ReplayByRerun

    monkeypatch.setattr(step_module, "RECORDER", ReplayByRerun)
    closed = []
    close = step_module.CapturedStep.close
    monkeypatch.setattr(step_module.CapturedStep, "close", lambda self: (close(self), closed.append(self)))
    s = bench.Settings.make(quick=True)
    monkeypatch.setattr(capture, "profiled_kernels", lambda step, data, device: PROFILED)
    capture.capture_row("deep-narrow", "lora", 2, s, torch.device("cpu"))
    assert len(closed) == 2 and all(not step.graphs for step in closed)  # captured, captured_tf32

    def fails(step, data, device):
        raise RuntimeError("profiler failed")

    closed.clear()
    monkeypatch.setattr(capture, "profiled_kernels", fails)
    with pytest.raises(RuntimeError, match="profiler failed"):
        capture.capture_row("deep-narrow", "lora", 2, s, torch.device("cpu"))
    assert len(closed) == 2 and all(not step.graphs for step in closed)


def test_a_capture_row_that_runs_out_of_device_memory_is_skipped_with_a_line(monkeypatch, capsys):
    """On CUDA every trained method is captured at the paper's 45 members, full-soap's Transformer with its SOAP
    states included; a row the device has no memory for is one line on stderr and no row, and the rows after it are
    still measured (the estimate then scales that method from its narrower stack)."""
    from qlbench.bench import schedule

    def row(arch, method, E, s, device, rates):
        if (arch, method, E) == ("transformer", "full-soap", 45):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
        return dict(arch=arch, method=method, members=E)

    monkeypatch.setattr(schedule, "capture_row", row)
    s = bench.Settings.make(quick=True)
    report = {"capture": []}
    for _, fn in schedule.tasks(["transformer"], ["full-soap", "lora"], s, "cuda", report):
        if fn.kind == "capture":
            fn()
    measured = [(r["method"], r["members"]) for r in report["capture"]]
    # full-soap's 45 Transformers last: the slowest row to set up, so that a run stopped at its limit keeps the rest
    assert measured == [("pretraining", 45), ("lora", 45), ("pretraining", 5), ("full-soap", 5), ("lora", 5)]
    labels = [label for label, fn in schedule.tasks(["transformer"], ["full-soap", "lora"], s, "cuda", {}) if
              fn.kind == "capture"]  # fmt: skip
    assert labels[-1] == "transformer capture full-soap E=45"
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "qlbench bench: transformer capture full-soap E=45 skipped: the device ran out of memory "
        "(CUDA out of memory. Tried to allocate 2.00 GiB)"
    ]


def test_a_stopped_bench_keeps_the_rows_it_measured(monkeypatch, tmp_path):
    """`partial` sees the report after every measurement (the command writes it to bench.partial.json, and removes
    that file once bench.json is written), so a bench stopped at a time limit keeps the rows measured before."""
    from qlbench.bench import schedule

    def fake(*a, **k):  # each throughput measurement adds one row, under a key nothing after the run reads
        report = a[4]
        row = lambda label: report["profile"].append(dict(label=label))
        return [(label, schedule.kind(fn.kind, lambda label=label: row(label))) for label, fn in real(*a, **k)]

    real = schedule.tasks
    monkeypatch.setattr(schedule, "tasks", fake)
    monkeypatch.setattr(schedule, "matmul_peak", lambda device: 1.0)
    seen = []
    s = bench.Settings.make(quick=True)
    bench.run(["deep-narrow"], ["lora", "queryable"], s, torch.device("cpu"), progress=False, only={"throughput"},
              partial=lambda report: seen.append([r["label"] for r in report["profile"]]))  # fmt: skip
    pre, lora, queryable = (f"deep-narrow {m} E=5" for m in ("pretraining", "lora", "queryable"))
    assert seen == [[pre], [pre, lora], [pre, lora, queryable]]


def test_bench_compile_option_chooses_whether_the_compiled_variants_are_measured(monkeypatch, tmp_path, capsys):
    """`--compile auto` measures the torch.compile variants in a full run and not with --quick; on and off say so
    whatever the budget (a GPU call measures compiled + captured steps in a quick run); anything else is a one-line
    usage error naming the valid settings, before anything is measured."""
    seen = []

    class Stop(Exception):
        pass

    def measured(archs, methods, s, device, **kwargs):  # the settings the command built; nothing measured
        seen.append(s.compile)
        raise Stop

    monkeypatch.setattr(bench, "run", measured)
    cases = [(["--quick"], False), ([], True), (["--quick", "--compile", "on"], True), (["--compile", "off"], False)]
    for flags, expected in cases:
        with pytest.raises(Stop):
            cli.main(["bench", *flags, "--archs", "deep-narrow", "--out", str(tmp_path / "b")])
        assert seen.pop() is expected, flags
    line = one_line_error(capsys, ["bench", "--quick", "--compile", "yes", "--out", str(tmp_path / "b")])
    assert "unknown --compile 'yes'; valid: auto, on, off" in line and not seen


def test_kernel_count_counts_launching_ops_not_views_or_allocations():
    """The dispatch count of known ops: a copy to contiguous memory, an add and a sum launch one kernel each on CUDA;
    a transpose, a view, an unsqueeze, an expand and an empty allocation launch none."""
    from qlbench.bench.dispatch import KernelCount

    a, b = torch.ones(3, 4, device="meta"), torch.ones(4, 3, device="meta")
    with KernelCount() as seen:
        y = (a.t().contiguous() + b).view(-1)
        torch.empty(3, device="meta")
        y.unsqueeze(0).expand(2, 12).sum()
    assert seen.counts == {"clone": 1, "add": 1, "sum": 1}


def test_a_steps_kernels_follow_the_layers_ops():
    """deep-narrow fully fine-tuned (full-adamw), by hand from its layers: an input layer, 32 hidden layers and a
    head, each a linear (one baddbmm) and all but the head followed by a GELU; backward, every linear's weight
    gradient (a bmm) and bias gradient (a sum), every input gradient but the input layer's (a bmm), every GELU's
    backward. A planted extra op in the backbone's GELU (x * 1.0) adds it and its backward's mul once per GELU."""
    from qlbench.bench.dispatch import step_kernels

    linears = 1 + 32 + 1
    full = step_kernels("deep-narrow", "full-adamw", 2)
    assert full["baddbmm"] == linears and full["gelu"] == full["gelu_backward"] == linears - 1
    assert full["bmm"] == linears + (linears - 1)
    assert full["sum"] == linears + 1  # the bias gradients and the loss's sum over members
    gelu = torch.nn.functional.gelu
    try:
        torch.nn.functional.gelu = lambda x, **k: gelu(x * 1.0, **k)  # the backbone calls F.gelu
        planted = step_kernels("deep-narrow", "full-adamw", 2)
    finally:
        torch.nn.functional.gelu = gelu
    assert sum(planted.values()) - sum(full.values()) == 2 * (linears - 1)


def test_each_kernels_flops_and_bytes_by_hand():
    """The traffic of known ops on the meta device, by hand: a batched matmul's FLOPs (2 E n k m) and its operands'
    and result's bytes; a broadcast add reads its (4,) operand once, not once per row; an op given the same tensor
    twice reads it once; an in-place batched matmul counts the out-of-place formula's FLOPs and reads and writes
    its input; a view moves nothing."""
    from qlbench.bench.dispatch import Kernel, KernelCount

    f32 = 4
    a, b, c = (torch.ones(*shape, device="meta") for shape in [(2, 3, 5), (2, 5, 7), (2, 3, 7)])
    row, x = torch.ones(4, device="meta"), torch.ones(3, 4, device="meta")
    with KernelCount() as seen:
        torch.bmm(a, b)
        x + row.expand(3, 4)  # stride 0 along the rows
        x * x
        c.baddbmm_(a, b)
        x.t()
    assert seen.kernels == [
        Kernel("bmm", 2 * 2 * 3 * 5 * 7, f32 * (30 + 70 + 42)),
        Kernel("add", 0, f32 * (12 + 4 + 12)),
        Kernel("mul", 0, f32 * (12 + 12)),
        Kernel("baddbmm_", 2 * 2 * 3 * 5 * 7, f32 * (42 + 30 + 70 + 42)),
    ]


def test_the_flop_counts_include_in_place_matmuls():
    """Queryable LoRA's eager layer adds its low-rank product in place (baddbmm_), which torch.utils.flop_counter's
    own formulas leave out: bench's counts (`timing.forward_flops`, `step_flops`) include it, 2 b m k n as the
    out-of-place op's, and so does an in-place addmm_."""
    from qlbench.bench.timing import forward_flops

    class InPlace(torch.nn.Module):
        def forward(self, x):  # x (2, 3, 5)
            y = torch.zeros(2, 3, 7).baddbmm_(x, torch.ones(2, 5, 7))
            return torch.zeros(3, 7).addmm_(x[0], torch.ones(5, 7)) + y

    assert forward_flops(InPlace(), torch.ones(2, 3, 5)) == 2 * 2 * 3 * 5 * 7 + 2 * 3 * 5 * 7


def test_the_roofline_takes_each_kernels_slower_bound():
    """Each kernel at the slower of its FLOPs at the matmul rate and its bytes at the memory rate, summed: one
    kernel bound by its arithmetic (2 ms against 1 ms of traffic) and one by its memory (4 ms against 0.1 ms) give
    6 ms, where the bounds of the totals would give 5 ms and the two rates added 7.1 ms."""
    from qlbench.bench.dispatch import Kernel, roofline_ms

    kernels = [Kernel("bmm", int(2e9), int(1e8)), Kernel("add", int(1e8), int(4e8))]
    assert roofline_ms(kernels, gflops=1000.0, gbytes_per_s=100.0) == pytest.approx(6.0)


@pytest.mark.parametrize("method", ["lora", "dora", "full-soap"])
def test_a_steps_flops_on_the_meta_device_are_the_real_steps(method):
    """The matmul FLOPs that `step_traffic` counts over a stack built on the meta device (nothing drawn) equal
    torch.utils.flop_counter's over the real step of a stack built on the CPU (`timing.step_flops`), for methods
    whose layers take the same ops on both devices."""
    from qlbench.bench.dispatch import NoUpdate, step_traffic
    from qlbench.bench.models import batches, stacked_model
    from qlbench.bench.timing import step_flops

    kernels = step_traffic("deep-narrow", method, 2)
    model, _ = stacked_model("deep-narrow", method, 2, "cpu")
    assert sum(k.flops for k in kernels) == step_flops(model, engine.make_step(model, NoUpdate()), batches(2, "cpu"))


def test_a_stack_built_on_the_meta_device_dispatches_the_kernels_of_one_built_on_the_cpu():
    """`step_traffic` builds its stack on the meta device, drawing nothing; every trained default method on
    deep-narrow, and the Transformer's routed ones, dispatch there the kernels (names, FLOPs, bytes, in order) of the
    same stack drawn on the CPU and moved to meta."""
    from qlbench.bench.dispatch import KernelCount, NoUpdate, step_traffic
    from qlbench.bench.models import batches, stacked_model

    xb, yb = (t.to("meta") for t in batches(2, "cpu", n=1)[0])
    for arch, methods in [("deep-narrow", TRAINED), ("transformer", ["dora", "queryable", "instruct-queryable"])]:
        for method in methods:
            model, _ = stacked_model(arch, method, 2, "cpu")
            model.to("meta")
            with KernelCount() as seen:
                engine.make_step(model, NoUpdate())(xb, yb)
            assert seen.kernels == step_traffic(arch, method, 2), (arch, method)


def test_memory_bandwidth_counts_each_byte_read_and_written(monkeypatch):
    """GB/s of a copy: twice the tensor's bytes (read, then written) per copy, over the best trial's time."""
    from qlbench.bench import timing

    clock = iter([0.0, 0.5, 1.0, 1.25, 2.0, 3.0])  # trials of 0.5, 0.25 and 1 s
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    gbs = timing.memory_bandwidth("cpu", megabytes=1, reps=3, trials=3)
    assert gbs == pytest.approx(2 * 2**20 * 3 / 0.25 / 1e9)


TRAINED = [m for m in adapters.DEFAULT_METHODS if adapters.get(m).trains]


@pytest.mark.parametrize("arch, methods", [("deep-narrow", TRAINED), ("transformer", ["instruct-queryable"])])
def test_stacked_copies_train_as_separately_built_stacks(arch, methods):
    """`capture_row`'s variants are one drawn stack and its copies: each copy, with its own optimizer, takes the same
    step as a stack `stacked_model` draws afresh, bit for bit, and training one leaves the others untouched (no
    tensor, shared memory included, is shared between copies)."""
    from qlbench.bench import models

    data = models.batches(2, "cpu", n=2)
    for m in methods:
        fresh, fresh_opt = models.stacked_model(arch, m, 2, "cpu")
        (a, a_opt), (b, b_opt) = models.stacked_copies(arch, m, 2, "cpu", 2)
        before = {k: v.clone() for k, v in b.state_dict().items()}
        steps = [engine.make_step(mod, opt) for mod, opt in ((fresh, fresh_opt), (a, a_opt))]
        for xb, yb in data:  # two steps: SOAP's first only gathers its statistics
            losses = [step(xb, yb) for step in steps]
            assert torch.equal(losses[0], losses[1]), m
        assert all(torch.equal(v, a.state_dict()[k]) for k, v in fresh.state_dict().items()), m
        assert all(torch.equal(v, b.state_dict()[k]) for k, v in before.items()), m  # b untouched by a's step
        assert any(not torch.equal(v, a.state_dict()[k]) for k, v in before.items()), m  # a did train


@pytest.mark.parametrize("row", ["compile_row", "capture_row"])
def test_no_variant_compiles_inside_the_timed_rounds(row, monkeypatch):
    """Building a compiled step resets torch._dynamo (engine.compiled), which drops whatever was compiled before: the
    rows with compiled variants build every variant before warming any up, so nothing compiles while the rounds are
    timed. torch.compile with a counting backend (no Inductor) stands in for the real one; capture_row on the CPU
    stand-in for CUDA graphs."""
    from torch._dynamo.testing import CompileCounter

    from qlbench.bench import capture, training
    from qlbench.engine import loop
    from qlbench.engine import step as step_module

    from helpers import ReplayByRerun

    counter = CompileCounter()

    def counted(fn):
        torch._dynamo.reset()
        return torch.compile(fn, backend=counter)

    monkeypatch.setattr(loop, "compiled", counted)
    monkeypatch.setattr(step_module, "compiled_update", lambda opt: torch.compile(opt.step, backend=counter))
    monkeypatch.setattr(step_module, "RECORDER", ReplayByRerun)
    monkeypatch.setattr(capture, "profiled_kernels", lambda step, data, device: PROFILED)
    module = {"compile_row": training, "capture_row": capture}[row]  # each row times with its module's alternate
    during = []
    real = module.alternate

    def timed(fns, rounds, device):
        before = counter.frame_count
        out = real(fns, rounds, device)
        during.append(counter.frame_count - before)
        return out

    monkeypatch.setattr(module, "alternate", timed)
    s = bench.Settings.make(quick=True, compile=True)
    getattr(module, row)("deep-narrow", "lora", 2, s, torch.device("cpu"))
    assert counter.frame_count > 0 and during == [0]


def test_an_at_once_row_times_a_round_one_after_another_and_at_once(monkeypatch):
    """`at_once_row` on the CPU: every method's step runs its warm-up, then each round its n steps twice, once one
    method after another in this thread and once each method in a thread of its own (`engine.concurrently`, at most
    `width` at a time), and every step is closed at the row's end. The tasks: on CUDA every adapted method at the
    paper's 45 members, all at once; on the CPU as many at once as the cores hold at the narrowest E."""
    import threading

    from qlbench.bench import capture, schedule

    ran: list[tuple[int, bool]] = []  # (the step, whether it ran in the caller's thread)
    call, close, closed = engine.Step.__call__, engine.Step.close, []
    main = threading.main_thread()

    def spy(self, *args, **kwargs):
        ran.append((id(self), threading.current_thread() is main))
        return call(self, *args, **kwargs)

    monkeypatch.setattr(engine.Step, "__call__", spy)
    monkeypatch.setattr(engine.Step, "close", lambda self: (close(self), closed.append(self)))
    monkeypatch.setattr(capture, "AT_ONCE_CHUNK", 2)  # the steps a timed call runs follow it (the default: 10)
    s = bench.Settings.make(quick=True)
    row = capture.at_once_row("deep-narrow", ["lora", "queryable", "full-soap"], 2, 2, s, torch.device("cpu"))
    assert row["methods"] == ["lora", "queryable", "full-soap"] and row["members"] == 2 and row["width"] == 2
    assert row["one_after_another_ms"] > 0 and row["at_once_ms"] > 0 and row["at_once_speedup"] > 0
    steps = list(dict.fromkeys(step for step, _ in ran))
    assert s.steps["deep-narrow"] * capture.AT_ONCE_CHUNK == 8
    n, warm = 10, engine.step.WARMUP + 2  # the 8 steps asked, as whole periods of full-soap's refresh (every 10 steps)
    assert len(steps) == 3 and len(closed) == 3
    for step in steps:
        mine = [in_main for k, in_main in ran if k == step]
        assert mine.count(True) == warm + s.rounds * n and mine.count(False) == s.rounds * n  # the threads' rounds
    labels = [label for label, _ in schedule.tasks(["deep-narrow", "transformer"], ["full-soap", "lora", "dora"], s,
              "cuda", {})]  # fmt: skip
    assert "deep-narrow 3 methods, 3 at once E=45" in labels and "transformer 2 methods, 2 at once E=45" in labels
    cpu = [label for label, _ in schedule.tasks(["deep-narrow"], ["lora", "dora"], s, "cpu", {}) if "at once" in label]
    width = s.side_by_side_for("deep-narrow", 5)[1]  # the stack's one thread: as many as the cores
    assert cpu == ([f"deep-narrow 2 methods, {width} at once E=5"] if width > 1 else [])


def test_the_estimate_with_methods_at_once_by_hand():
    """With an `at_once` row the estimate adds the table's total with those methods trained at once: their training
    steps as the one-at-a-time estimate counts them, divided by the row's measured speed-up (a ratio side by side,
    whatever the row's own round times), plus each one's recording warm-up and evaluations one after another, plus
    the methods outside the row (pretraining) as they are."""
    from qlbench.bench import output

    rows = [dict(arch="deep-narrow", method=m, members=45, stacked=100.0, eval_s=0.5, threads=1)
            for m in ("pretraining", "lora", "queryable")]  # fmt: skip
    rates = (("pretraining", 9000.0, 1.0), ("lora", 30_000.0, 2.0), ("queryable", 12_000.0, 3.0))
    capture = [dict(arch="deep-narrow", method=m, members=45, captured_rate=rate, captured_warmup_s=w, eval_s=0.01)
               for m, rate, w in rates]  # fmt: skip
    at_once = [dict(arch="deep-narrow", members=15, threads=1, methods=["lora", "queryable"], width=2,
                    one_after_another_ms=5.0, at_once_ms=4.0, at_once_speedup=1.25)]  # fmt: skip
    est = bench.paper_estimate({"throughput": rows, "capture": capture, "at_once": at_once})
    methods = est["methods"]
    pretraining = methods["pretraining"]["total_s"]
    assert pretraining == pytest.approx(45 * 11_400 / 9000 + 1.0 + 2 * 2.5 * 0.01)
    # 45 x 35,000 steps of each at its captured rate, at x1.25 (the row's own 4 ms rounds not used); the warm-ups
    # (2 + 3 s) and 501 evaluations of 0.01 s each
    together = (45 * 35_000 / 30_000 + 45 * 35_000 / 12_000) / 1.25 + 2.0 + 3.0 + 2 * 501 * 0.01
    assert est["at_once"]["total_s"] == pytest.approx(pretraining + together)
    assert est["at_once"]["methods"] == ["lora", "queryable"] and est["at_once"]["speedup"] == 1.25
    assert "With the 2 adapted methods of the `at_once` row trained 2 at a time" in "".join(output.estimate(est))
    (spec,) = [t for t in output.TABLES if t.key == "at_once"]
    last = "".join(output.section(spec, {"at_once": at_once})).splitlines()[-1]
    assert [c.strip() for c in last.strip("|").split("|")] == ["deep-narrow", "15", "1", "2", "2", "5.000", "4.000",
                                                                "x1.25"]  # fmt: skip
    assert "at_once" not in bench.paper_estimate({"throughput": rows, "capture": capture})
    at_once[0]["methods"] = ["lora", "dora"]  # one of them not in the estimate: nothing to train at once
    assert "at_once" not in bench.paper_estimate({"throughput": rows, "capture": capture, "at_once": at_once})


def test_an_at_once_row_that_fails_is_a_line_and_the_run_goes_on(monkeypatch, capsys):
    """The `at_once` rows train several threads' stacks at once, recording CUDA graphs among them (which once failed
    every method on an H200): a RuntimeError in one is one line on stderr and no row, not the end of the bench (its
    later rows and the estimate still come)."""
    from qlbench.bench import schedule

    def fails(arch, methods, E, width, s, device):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(schedule, "at_once_row", fails)
    report = {"at_once": []}
    s = bench.Settings.make(quick=True)
    for _, fn in schedule.tasks(["deep-narrow"], ["lora", "dora"], s, "cuda", report):
        if fn.kind == "at_once":
            fn()
    assert report["at_once"] == []
    assert capsys.readouterr().err.strip().splitlines() == [
        "qlbench bench: deep-narrow 2 methods, 2 at once E=45 failed: RuntimeError: CUDA error: operation not "
        "permitted when stream is capturing"
    ]


def test_the_peft_tuner_rows_time_a_training_step_and_generation_beside_lora():
    """`bench --only hf`: for each call (a training step, greedy generation with the KV cache) a row per method,
    LoRA's ratio 1 and the others' positive; the generation really decodes (tokens past the prompt)."""
    pytest.importorskip("peft")
    from qlbench.bench import models, workloads

    s = bench.Settings({"deep-narrow": 2}, 1, (2,), 1, 1, True)
    rows = workloads.hf_rows(s, torch.device("cpu"))
    assert {(r["call"], r["method"]) for r in rows} == {
        (c, m) for c in ("training step", "generate (KV cache)") for m in ("lora", "queryable", "instruct-queryable")
    }
    assert all(r["ms_per_step"] > 0 and r["vs_lora"] > 0 for r in rows)
    assert all(r["vs_lora"] == 1.0 for r in rows if r["method"] == "lora")
    import transformers

    from qlbench.experiments import real_lm

    calls = []
    generate = models.hf_generate("queryable", torch.device("cpu"))

    def counting(self, *a, **kw):
        out = transformers.GenerationMixin.generate(self, *a, **kw)
        calls.append(out.shape)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformers.LlamaForCausalLM, "generate", counting)
        generate()
    assert calls == [torch.Size([32, real_lm.LENGTH + 2 + real_lm.LENGTH + 1])]
