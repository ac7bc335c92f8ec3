"""The Markdown of a `qlbench bench` report (what it prints and writes to bench.md): a few sentences, then one table
per list of rows in the report, each a list of column specs (`qlbench.text.Column`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from qlbench.bench.timing import BATCH
from qlbench.engine.snapshot import COST_SHARE, EVERY_S
from qlbench.text import Column, fixed, pct, share, table, times


def digits(d: int):
    """`fixed` with `d` digits."""
    return partial(fixed, digits=d)


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f}"


STACK = [Column("arch", "arch"), Column("method", "method"), Column("E", "members"), Column("threads", "threads")]


@dataclass(frozen=True)
class Table:
    """One table of the report: the rows under `key`, their columns, and the heading above them; shown when it has
    rows, or always when `always`."""

    key: str
    heading: str
    columns: list[Column]
    always: bool = False


THROUGHPUT = Table(
    "throughput",
    "Adaptation throughput: stacked engine vs per-seed loop",
    STACK
    + [
        Column("stacked model-steps/s", "stacked", digits(0)),
        Column("per-seed loop model-steps/s", "per_seed", digits(1)),
        Column("speed-up", "speedup", times),
        Column("GFLOP/s", "gflops", digits(2)),
        Column("% of peak", "peak_share", lambda v: f"{100 * v:.1f}"),
    ],
    always=True,
)

ESTIMATE = [  # rows: est["methods"], one per method
    Column("method", "method"),
    Column("adaptation h", "train_s", hours),
    Column("evaluation h", "eval_s", hours),
    Column("total h", "total_s", hours),
    Column("training step", "mode"),
    Column("total h, captured with TF32 matmuls", "tf32_total_s", hours, optional=True),
    Column("adaptation h at the roofline floor", "floor_s", hours, optional=True),
]

# after the estimate, in this order
TABLES = [
    Table(
        "overhead",
        "Queryable LoRA against LoRA (paired, same E)",
        [
            Column("arch", "arch"),
            Column("E", "members"),
            Column("training step vs LoRA", "train_step_overhead_pct", pct),
            Column("compiled training step vs LoRA compiled", "compiled_train_step_overhead_pct", pct),
            Column("forward vs LoRA", "forward_overhead_pct", pct),
            Column("compiled forward vs LoRA compiled", "compiled_forward_overhead_pct", pct),
        ],
    ),
    Table(
        "dispatch",
        "Kernels per training step's forward and backward, counted without a GPU (the ATen ops that launch one, "
        "dispatched on the meta device, which takes CUDA's code paths; an estimate of CUDA's count, the optimiser's "
        "update not included), with the step's matmul FLOPs and the bytes its kernels read and write (each input "
        "read once, each output written once)",
        [
            Column("arch", "arch"),
            Column("method", "method"),
            Column("E", "members"),
            Column("kernels", "kernels", digits(0)),
            Column("vs LoRA", "vs_lora", partial(times, digits=2), optional=True),
            Column("matmul GFLOP", "gflop", digits(3), optional=True),
            Column("GB read and written", "gbyte", digits(3), optional=True),
        ],
    ),
    Table(
        "profile",
        "Profile of one training step (torch.profiler; ops include nested calls)",
        STACK
        + [
            Column("step ms", "step_ms", digits(2)),
            Column("ATen ops / step", "aten_ops", digits(0)),
            Column("µs per op", "us_per_op", digits(1)),
            Column("matmul share of step", "matmul_share", share),
            Column("GELU fwd+bwd share", "gelu_share", share),
        ],
    ),
    Table(
        "soap",
        "full-soap's optimizer step: batched vs one SOAP per member (paired, over whole periods of the eigenbases' "
        "refresh); the refresh alone",
        [
            Column("arch", "arch"),
            Column("E", "members"),
            Column("threads", "threads"),
            Column("batched StackedSoap ms/step", "batched_ms", digits(1)),
            Column("pytorch_optimizer.SOAP per member ms/step", "per_member_ms", digits(1)),
            Column("speed-up", "speedup", times),
            Column("eigenbases' refresh ms (eager)", "refresh_ms", digits(1)),
            Column("refresh share of a batched step", "refresh_share", share),
            Column("refresh ms with torch.linalg.qr (CUDA: as before)", "refresh_lapack_ms", digits(1)),
            Column(
                "refresh ms replayed from a CUDA graph (as a captured stage runs it)", "refresh_recorded_ms", digits(1)
            ),
        ],
    ),
    Table(
        "snapshot",
        "Snapshots (engine/snapshot.py): a stack's training state saved atomically and read back; the save against "
        "the stack's training step (alternating), and its share of the training time at the default interval (a save "
        f"every {EVERY_S:g} s, further apart where a save takes over {COST_SHARE:.0%} of the time)",
        STACK
        + [
            Column("snapshot MB", "snapshot_mb", digits(1)),
            Column("save s", "save_s", digits(3)),
            Column("load s", "load_s", digits(3)),
            Column("step ms", "step_ms", digits(2)),
            Column("a save in steps", "save_in_steps", digits(1)),
            Column("share of training at the default interval", "share_at_default", partial(share, digits=2)),
        ],
    ),
    Table(
        "padding",
        "Stack independence: a one-member cell's training step, padded to two members, against the unpadded step",
        STACK
        + [
            Column("one member ms/step", "alone_ms", digits(2)),
            Column("padded to two ms/step", "padded_ms", digits(2)),
            Column("cost", "cost", partial(times, digits=2)),
        ],
    ),
    Table(
        "pareto_stack",
        "Pareto grid: the points of one (r, M) that differ in k alone (k = 1, 2, 4) as one stack, against one stack "
        "per point trained one after another (qlbench/experiments/pareto_stack.py); E: members per point",
        STACK
        + [
            Column("points", "points", digits(0)),
            Column("point by point model-steps/s", "alone", digits(0)),
            Column("one stack model-steps/s", "stacked", digits(0)),
            Column("speed-up", "speedup", partial(times, digits=2)),
        ],
    ),
    Table(
        "suite",
        "Multi-task suites: a suite stage's training step (a batch mixing the suite's tasks) against a single-task "
        "step of the same size",
        STACK
        + [
            Column("tasks", "tasks"),
            Column("single-task ms/step", "single_ms", digits(2)),
            Column("suite ms/step", "suite_ms", digits(2)),
            Column("cost", "cost", partial(times, digits=2)),
        ],
    ),
    Table(
        "compile",
        "torch.compile (model-steps/s after warm-up)",
        STACK
        + [
            Column("warm-up s", "warmup_s", digits(1)),
            Column("eager", "eager", digits(0)),
            Column("forward compiled", "compiled_forward", digits(0), optional=True),
            Column("forward and update compiled", "compiled", digits(0)),
            Column("speed-up", "speedup", partial(times, digits=2)),
            Column("update compiled vs not", "update_speedup", partial(times, digits=2), optional=True),
        ],
    ),
    Table(
        "capture",
        "CUDA graphs: the training step eager, captured whole in a CUDA graph, captured with TF32 matmuls (speed-up "
        "against the float32 captured step; qlbench trains in float32), and compiled, when the run compiles; ms per "
        "step, CUDA kernels per step (torch.profiler); the step's roofline floor (each of its kernels at the run's "
        "matmul peak or memory bandwidth, whichever bounds it, launches free; the optimiser's update not counted) "
        "and the captured step's speed as a share of it",
        STACK
        + [
            Column("eager ms", "eager_ms", digits(3)),
            Column("captured ms", "captured_ms", digits(3)),
            Column("captured speed-up", "captured_speedup", partial(times, digits=1)),
            Column("captured TF32 ms", "captured_tf32_ms", digits(3), optional=True),
            Column("TF32 speed-up", "tf32_speedup", partial(times, digits=2), optional=True),
            Column("compiled ms", "compiled_ms", digits(3), optional=True),
            Column("compiled + captured ms", "compiled_captured_ms", digits(3), optional=True),
            Column(
                "compiled + captured speed-up", "compiled_captured_speedup", partial(times, digits=1), optional=True
            ),
            Column("recording warm-up s", "captured_warmup_s", digits(1)),
            Column("kernels eager", "eager_kernels", digits(0)),
            Column("kernels captured", "captured_kernels", digits(0)),
            Column("µs per kernel captured", "captured_us_per_kernel", digits(2)),
            Column("kernel time ms, captured", "captured_kernel_ms", digits(3), optional=True),
            Column("device busy, captured", "captured_busy", share, optional=True),
            Column("roofline floor ms", "roofline_ms", digits(3), optional=True),
            Column("captured at % of the floor", "roofline_share", share, optional=True),
            Column("evaluation s, captured", "eval_s", digits(4), optional=True),
            Column("evaluation s, eager", "eval_eager_s", digits(4), optional=True),
        ],
    ),
    Table(
        "capture_kernels",  # rows: top_kernels(report)
        "CUDA graphs: the kernels that take the most of the device's time in each captured step, at each method's "
        "widest stack (torch.profiler; launches and device µs per step, share of all its kernels' device time)",
        STACK[:3]
        + [
            Column("kernel", lambda r: r["kernel"][:KERNEL_NAME].replace("|", "/")),
            Column("launches per step", "per_step", digits(0)),
            Column("µs per step", "us_per_step", digits(1)),
            Column("share of kernel time", "share", share),
        ],
    ),
    Table(
        "at_once",
        "Methods at once: the adapted methods' steps, each its own stack in its own thread and, on CUDA, on its own "
        "stream and captured (`--methods-at-once`); ms per round of one step of each, one method after another and "
        "as many at a time as the `at once` column says",
        STACK[:1]
        + STACK[2:]
        + [
            Column("methods", lambda r: len(r["methods"])),
            Column("at once", "width"),
            Column("one after another ms", "one_after_another_ms", digits(3)),
            Column("at once ms", "at_once_ms", digits(3)),
            Column("at once speed-up", "at_once_speedup", partial(times, digits=2)),
        ],
    ),
    Table(
        "side_by_side",
        "Tasks side by side (separate processes, as Ray's workers; rate of one process alone against each of them at "
        "once, paired)",
        STACK
        + [
            Column("processes at once", "workers"),
            Column("step", lambda r: "compiled" if r["compiled"] else "eager"),
            Column("alone model-steps/s", "alone", digits(0)),
            Column("each, side by side", "together", digits(0)),
            Column("side by side vs alone", "together_vs_alone", partial(times, digits=2)),
        ],
    ),
    Table(
        "members",
        "Methods written for one member (peft's tuners, methods from outside): model-steps/s of qlbench's stacked "
        "`lora`, of the method stacked by vmap (where it runs so) and looped over the members, in the same rounds",
        [
            Column("arch", "arch"),
            Column("method", "method"),
            Column("E", "members"),
            Column("lora", "lora", digits(0)),
            Column("stacked", "stacked", lambda v: "" if v is None else digits(0)(v)),
            Column("looped", "looped", digits(0)),
            Column("stacked / looped", "stacked_vs_loop", lambda v: "" if v is None else times(v)),
            Column("vs lora", "vs_lora", partial(times, digits=3)),
            Column("path in training", "path"),
        ],
    ),
    Table(
        "grid",
        "A learning-rate grid in one stack (engine/rates.py): model-steps/s of a method's stack of E members at one "
        "rate and of its stack of rates x E members, a rate per member, in the same rounds; grid step / one-rate step: "
        "the grid's wall time against one rate's (the rates trained one after another: x rates)",
        [
            Column("arch", "arch"),
            Column("method", "method"),
            Column("E", "members"),
            Column("rates", "rates"),
            Column("one rate", "one", digits(0)),
            Column("grid", "grid", digits(0)),
            Column("grid step / one-rate step", "grid_vs_one", partial(times, digits=2)),
        ],
    ),
    Table(
        "hf",
        "The peft tuner (qlbench.hf) against peft's LoRA on the same model: one training step on a batch of 32 "
        "sequences of 13 tokens; greedy generation with the KV cache, 6 new tokens from 32 prompts of 7",
        [
            Column("model", "model"),
            Column("call", "call"),
            Column("method", "method"),
            Column("ms/call", "ms_per_step", digits(2)),
            Column("vs LoRA", "vs_lora", partial(times, digits=2)),
        ],
    ),
    Table(
        "inference",
        "Inference: forward at batch 64, one model (no grad; compiled: the same model through torch.compile)",
        [
            Column("arch", "arch"),
            Column("method", "method"),
            Column("latency ms", "latency_ms", digits(2)),
            Column("vs LoRA", "latency_overhead_pct", pct),
            Column("samples/s", "samples_per_s", digits(0)),
            Column("GFLOP", "gflop", digits(4)),
            Column("FLOPs vs LoRA", "flop_overhead_pct", partial(pct, digits=1)),
            Column("compiled ms", "compiled_latency_ms", digits(2), optional=True),
            Column("compiled vs LoRA compiled", "compiled_latency_overhead_pct", pct, optional=True),
        ],
        always=True,
    ),
]


def markdown(report: dict) -> str:
    """The report as Markdown tables (what `qlbench bench` prints and writes to bench.md)."""
    out = [header(report), *plain_lines(report.get("plain"))]
    out += section(THROUGHPUT, report)
    for est in report.get("paper_estimates") or [report.get("paper_estimate")]:
        out += estimate(est) if est else []
    derived = report | {"capture_kernels": top_kernels(report.get("capture") or [])}
    for spec in TABLES:
        out += section(spec, derived)
    return "\n".join(out) + "\n"


KERNEL_NAME = 90  # characters of a CUDA kernel's name shown (its C++ signature runs to hundreds)


def top_kernels(capture: list[dict]) -> list[dict]:
    """The capture rows' top kernels as rows of their own, for each (arch, method) at its widest stack."""
    widest = {}
    for row in capture:
        key = (row["arch"], row["method"])
        if "captured_top_kernels" in row and row["members"] >= widest.get(key, {"members": 0})["members"]:
            widest[key] = row
    return [
        {"arch": r["arch"], "method": r["method"], "members": r["members"], **k}
        for r in widest.values()
        for k in r["captured_top_kernels"]
    ]


def section(spec: Table, report: dict) -> list[str]:
    rows = report.get(spec.key)
    ran = report.get("only") is None or spec.key in report["only"]  # `--only` left the measurement out
    return [f"\n### {spec.heading}\n", table(rows, spec.columns)] if rows or (spec.always and ran) else []


def header(report: dict) -> str:
    bandwidth = ""
    if "bandwidth_gbs" in report:  # the roofline floor's memory rate
        bandwidth = f"memory bandwidth (a 256 MiB copy, at the start of the run): {report['bandwidth_gbs']:.1f} GB/s; "
    return (
        f"Matmul peak (float32 2048^3 sgemm, best at the start and end of the run): "
        f"{report['peak_gflops']:.1f} GFLOP/s; {bandwidth}threads "
        f"{report['meta']['threads']}; batch {BATCH}; medians of {report['settings']['rounds']} alternating rounds "
        f"({report['settings']['inference_rounds']} for inference)."
    )


def plain_lines(a: dict | None) -> list[str]:
    """The plain PyTorch loop against the per-seed loop and the stacked engine's stacks, and the kernel floors."""
    if a is None:
        return []
    stacks = "; ".join(
        f"stacked engine at E = {k.split('_')[1][1:]}{' compiled' if k.endswith('compiled') else ''} "
        f"{a[k]:.0f} model-steps/s = x{a[k + '_vs_plain']:.1f} the plain loop"
        for k in a
        if k.startswith("stacked_") and not k.endswith("_vs_plain")
    )
    out = [
        f"\nPlain PyTorch loop (deep-narrow LoRA, steps/s of one seed): nn.Linear + LoRA {a['plain']:.0f} (default "
        f"threads), {a['plain_1_thread']:.0f} (one thread); qlbench per-seed loop {a['per_seed']:.0f}; {stacks}."
    ]
    if floors := kernel_floors(a):
        out.append(
            f"\nKernel floor (the same LoRA stack's step with its backward written out and one fused AdamW "
            f"update: no autograd graph, no per-tensor optimizer bookkeeping; compiled when the run compiles, so "
            f"Inductor fuses it as it fuses the engine's step; a bound measured for engines on these kernels, "
            f"not a proven one): {floors}."
        )
    return out


def kernel_floors(a: dict) -> str:
    """The kernel floors, each with the share of it the engine's faster stack (eager or compiled) of that E
    reaches."""
    parts = []
    for k, rate in a.items():
        if k.startswith("floor_e") and not k.endswith("_vs_plain"):
            E = k[len("floor_e") :]
            engine_rate = max(a.get(f"stacked_e{E}", 0.0), a.get(f"stacked_e{E}_compiled", 0.0))
            parts.append(
                f"at E = {E} {rate:.0f} model-steps/s = x{a[k + '_vs_plain']:.1f} the plain loop, of which the "
                f"engine reaches {100 * engine_rate / rate:.0f}%"
            )
    return "; ".join(parts)


def estimate(est: dict) -> list[str]:
    """The paper-table estimate: its heading, one row per method, and the line for tasks side by side."""
    rows = [dict(method=m, mode="eager") | v for m, v in est["methods"].items()]
    evaluated = " and their evaluations" if "evaluated_at" in est else ""
    captured = f" (captured steps{evaluated} at E = {est['captured_at']})" if "captured_at" in est else ""
    narrower = {m: v["measured_at"] for m, v in est["methods"].items() if "measured_at" in v}
    if narrower:  # methods timed only at a narrower stack than the run's widest
        captured += " (" + ", ".join(f"{m} at E = {e}" for m, e in narrower.items()) + ")"
    tf32 = ""
    if "tf32_total_s" in est:  # measured, not run: qlbench trains in float32
        tf32 = f"; {est['tf32_total_s'] / 3600:.2f} h if the captured steps' matmuls used TF32 (not what qlbench runs)"
    floor = ""
    if "floor_s" in est:  # every method's training steps at its captured step's roofline floor
        floor = (
            f"; the adaptation steps alone would take {est['floor_s'] / 3600:.2f} h at the captured steps' roofline "
            f"floors (every kernel at this device's measured matmul peak or memory bandwidth, launches free)"
        )
    out = [
        f"\n### Estimate: the full {est['arch']} paper table ({est['members']} members per method, 5,000 epochs; "
        f"from the rates at E = {est['measured_at']}{captured}, linear in members; training steps as the paper "
        f"budget runs them on this device (compiled where `--compile auto` compiles it, captured on CUDA), warm-up "
        f"included; one process; the backbones' pretraining, once per arch, its own row where measured): "
        f"{est['total_s'] / 3600:.2f} h for the methods measured" + tf32 + floor + "\n",
        table(rows, ESTIMATE),
    ]
    if together := est.get("at_once"):
        out.append(
            f"\nWith the {len(together['methods'])} adapted methods of the `at_once` row trained "
            f"{together['width']} at a time (`--methods-at-once {together['width']}`: their training steps above at "
            f"x{together['speedup']:.2f} the speed, a round at once against one after another as measured; their "
            f"warm-ups and evaluations counted one after another): {together['total_s'] / 3600:.2f} h."
        )
    if par := est.get("parallel"):
        measured = ""
        if "measured_total_s" in par:
            ratios = ", ".join(f"{m} x{v:.2f}" for m, v in par["together_vs_alone"].items())
            measured = (
                f"; {par['measured_total_s'] / 3600:.2f} h with each task slowed by its measured side-by-side ratio "
                f"({ratios}; the mean of these for the others)"
            )
        out.append(
            f"\nWith {par['workers']} such tasks at once (`qlbench sweep --executor ray --threads "
            f"{par['threads']}` on this machine; tasks taken in this order by the first free worker): "
            f"{par['total_s'] / 3600:.2f} h if each task kept the rate measured here alone{measured}."
        )
    return out
