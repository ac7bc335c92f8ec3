"""The order and the run of `qlbench bench`'s measurements: `tasks` (a run's measurements in order, each tagged with
its kind, KINDS: what `--only` selects) and `run`, which takes them in order and adds the matmul peak and the
paper-table estimate. The cases themselves are in `training`, `capture`, `forwards`, `workloads` and `members`.
"""

from __future__ import annotations

import functools
import gc
import sys
from collections.abc import Callable

import torch

from qlbench import adapters, engine
from qlbench.bench.capture import at_once_row, capture_row
from qlbench.bench.estimate import paper_estimate
from qlbench.bench.forwards import inference
from qlbench.bench.members import member_rows
from qlbench.bench.models import PRETRAINING
from qlbench.bench.parallel import side_by_side
from qlbench.bench.rates import grid_rows
from qlbench.bench.timing import BATCH, Settings, matmul_peak, memory_bandwidth
from qlbench.bench.training import (
    compile_row,
    dispatch_rows,
    overhead,
    padding_row,
    plain_loop,
    profile_row,
    soap_row,
    throughput,
)
from qlbench.bench.workloads import SUITE_METHODS, hf_rows, pareto_stack_row, snapshot_row, suite_row
from qlbench.engine.step import first_line
from qlbench.experiments import grid, pareto_stack
from qlbench.progress import bar as progress_bar
from qlbench.records import record

PAPER_MEMBERS = 45  # a method's members in the paper table (9 functions x 5 seeds): one stack on a GPU


# mean's model is a constant (each member's training-label mean), no network: its forward is not timed. Not a kind:
# frozen, the other reference row, is the backbone's own forward and is timed.
UNTIMED_FORWARDS = ("mean",)


def tasks(archs: list[str], methods: list[str], s: Settings, device, report: dict) -> list[tuple[str, Callable]]:
    """The measurements of a run, in order, as (label, fn) pairs; each fn adds its rows to `report`."""
    out = []
    add = lambda key, fn: kind(key, lambda: report[key].append(fn()))
    one_member = [m for m in methods if isinstance(adapters.get(m), adapters.MemberMethod)]  # their own rows only
    methods = [m for m in methods if m not in one_member]
    for arch in archs if one_member else []:
        E = min(s.members)
        row = lambda a=arch, E=E: report["members"].extend(member_rows(a, one_member, E, s, device))
        out.append((f"{arch} methods written for one member E={E}", kind("members", row)))
    in_grid = [m for m in methods + one_member if grid.one_stack(m)]  # a learning-rate grid in one stack
    for arch in archs if in_grid else []:
        E = min(s.members)
        row = lambda a=arch, E=E: report["grid"].extend(grid_rows(a, in_grid, E, s, device))
        out.append((f"{arch} learning-rate grid in one stack E={E}", kind("grid", row)))
    if "deep-narrow" in archs:
        out.append(("plain loop", kind("plain", lambda: report.update(plain=plain_loop(s, device)))))
    trained = [m for m in methods if adapters.get(m).trains]
    pair = [m for m in ("lora", "queryable") if m in methods]  # on purpose: Queryable LoRA against the LoRA it extends
    forwarded = [m for m in methods if m not in UNTIMED_FORWARDS]
    timed = [PRETRAINING, *trained] if trained else []  # the stacks the paper-table estimate counts
    for arch in archs:
        for E in s.members:
            for m in timed:
                if arch == "transformer" and m in ("full-soap", PRETRAINING) and E > 5:
                    continue  # 45 copies of a 6.3M-parameter model with their optimizer states: a GPU's (capture)
                out.append(
                    (f"{arch} {m} E={E}", add("throughput", lambda a=arch, m=m, E=E: throughput(a, m, E, s, device)))
                )
            if len(pair) == 2:
                out.append((f"{arch} overhead E={E}", add("overhead", lambda a=arch, E=E: overhead(a, E, s, device))))
            for m in pair:
                out.append(
                    (
                        f"{arch} profile {m} E={E}",
                        add("profile", lambda a=arch, m=m, E=E: profile_row(a, m, E, s, device)),
                    )
                )
        for m in pair:
            out.append((f"{arch} padding {m}", add("padding", lambda a=arch, m=m: padding_row(a, m, s, device))))
        row = lambda a=arch: report["dispatch"].extend(dispatch_rows(a, trained, min(s.members)))
        out.append((f"{arch} kernels dispatched", kind("dispatch", row)))
        for m in (m for m in pair if pareto_stack.stackable(m)):  # a Pareto grid's k stacked (Queryable LoRA)
            out.append(
                (f"{arch} pareto stack {m}", add("pareto_stack", lambda a=arch, m=m: pareto_stack_row(a, m, s, device)))
            )
        for m in SUITE_METHODS:  # the suite rows: the static baseline, the task controls, the routed methods
            if m in methods or adapters.kind_of(m) == "task":
                E = min(s.members)
                out.append(
                    (f"{arch} suite {m} E={E}", add("suite", lambda a=arch, m=m, E=E: suite_row(a, m, E, s, device)))
                )
        if "full-soap" in methods:  # on CUDA at the paper's 45 members too: its refresh's QRs, 3,060 matrices there
            cuda_widths = {PAPER_MEMBERS} if torch.device(device).type == "cuda" else set()
            for E in sorted(set(s.members) | cuda_widths):
                if arch == "transformer" and E > 5:
                    continue  # 45 per-member SOAP states of a 6.3M-parameter model
                out.append((f"{arch} SOAP E={E}", add("soap", lambda a=arch, E=E: soap_row(a, E, s, device))))
        E = PAPER_MEMBERS if torch.device(device).type == "cuda" else max(s.members)  # a stack of the paper table
        for m in trained:  # what a stopped stack keeps (pretraining takes no snapshots)
            if not (arch == "transformer" and m == "full-soap" and E > 5):  # too large, as above
                row = lambda a=arch, m=m, E=E: snapshot_row(a, m, E, s, device)
                out.append((f"{arch} snapshot {m} E={E}", add("snapshot", row)))
        if s.compile and arch == "deep-narrow":  # every trained method at the largest E: the paper estimate's rates
            E = max(s.members)
            for m in timed:
                row = lambda a=arch, m=m, E=E: compile_row(a, m, E, s, device)
                out.append((f"{arch} compile {m} E={E}", add("compile", row)))
            # on purpose: three tasks of unlike weight (full-soap's per-member SOAP step, LoRA, Queryable LoRA); the
            # estimate slows the others by the mean of their ratios
            paired = [m for m in ("full-soap", "lora", "queryable") if m in trained]
            if torch.device(device).type == "cpu" and s.side_by_side_for(arch, E)[1] > 1 and paired:
                row = lambda a=arch, E=E, p=paired: report["side_by_side"].extend(side_by_side(a, p, E, s, device))
                out.append((f"{arch} side by side E={E}", kind("side_by_side", row)))
        # on CUDA the captured step of every trained method at the paper's stack width, which the estimate uses, and
        # then at every E of the run (widest first: a run stopped at a time limit has the estimate's rows first);
        # full-soap's 45 Transformers last of all (each copy's first SOAP step solves 4,590 eigenproblems, 720 of
        # them 1,024 x 1,024: a stopped run keeps every other row, and the estimate scales full-soap from E = 5)
        if torch.device(device).type == "cuda":
            widths = sorted(set(s.members) | {PAPER_MEMBERS}, reverse=True)
            pairs = [(E, m) for E in widths for m in timed]
            last = (PAPER_MEMBERS, "full-soap") if arch == "transformer" else None
            rates = (report["peak_gflops_start"], report["bandwidth_gbs"]) if "bandwidth_gbs" in report else None
            for E, m in sorted(pairs, key=lambda pair, last=last: pair == last):  # stable: the others keep their order
                label = f"{arch} capture {m} E={E}"
                row = functools.partial(capture_row, arch, m, E, s, device, rates)
                out.append((label, kind("capture", lambda lb=label, r=row: if_it_fits(lb, report["capture"], r))))
        # every adapted method's stack, as many at once as `--methods-at-once` would train: on CUDA all of them at the
        # paper's 45 members (full-soap's 45 Transformers left out, as above: too large); on the CPU as many as its
        # cores hold at the stacks' intra-op threads, at the run's narrowest E (a deep-narrow stack of 5 runs on one)
        cuda = torch.device(device).type == "cuda"
        E = PAPER_MEMBERS if cuda else min(s.members)
        together = [m for m in trained if not (arch == "transformer" and m == "full-soap" and E > 5)]
        width = len(together) if cuda else s.side_by_side_for(arch, E)[1]
        if len(together) > 1 and width > 1:
            label = f"{arch} {len(together)} methods, {width} at once E={E}"
            row = functools.partial(at_once_row, arch, together, E, width, s, device)
            fits = lambda lb=label, r=row: if_it_fits(lb, report["at_once"], r, failing=(RuntimeError,))
            out.append((label, kind("at_once", fits)))
        row = lambda a=arch: report["inference"].extend(inference(a, forwarded, s, device))
        out.append((f"{arch} inference", kind("inference", row)))
    if "lora" in methods and "queryable" in methods:  # the peft tuner against peft's LoRA
        out.append(("peft tuner", kind("hf", lambda: report["hf"].extend(hf_rows(s, device)))))
    return out


def if_it_fits(label: str, rows: list, measure: Callable[[], dict], failing: tuple[type, ...] = ()) -> None:
    """rows.append(measure()), or, where the device runs out of memory (a wide stack of a large model, such as
    full-soap's 45 Transformers with their SOAP states, on a smaller GPU), a line on stderr and no row: the estimate
    then scales that method from its narrower stack. `failing`: further errors that are likewise a line and no row,
    so that the rows after them are still measured and the estimate still made (the `at_once` rows train several
    threads' stacks at once, recording CUDA graphs among them, where a RuntimeError could fail every method on a
    GPU: docs/speed.md)."""
    try:
        rows.append(measure())
        return
    except torch.OutOfMemoryError as err:
        print(f"qlbench bench: {label} skipped: the device ran out of memory ({first_line(err)})", file=sys.stderr)
    except failing as err:
        print(f"qlbench bench: {label} failed: {type(err).__name__}: {first_line(err)}", file=sys.stderr)
    gc.collect()
    torch.cuda.empty_cache()


# what `qlbench bench --only` selects: a measurement's kind, the report's key it writes (plain: the plain PyTorch loop
# and the kernel floor)
KINDS = (
    "plain", "throughput", "overhead", "profile", "dispatch", "padding", "pareto_stack", "suite", "soap", "compile",
    "side_by_side", "capture", "at_once", "inference", "hf", "snapshot", "members", "grid",
)  # fmt: skip


def kind(name: str, fn: Callable) -> Callable:
    """fn, tagged with its measurement's kind (one of KINDS)."""
    assert name in KINDS, name
    fn.kind = name
    return fn


@engine.flush_denormals()
def run(
    archs: list[str],
    methods: list[str],
    s: Settings,
    device,
    *,
    progress: bool = True,
    only: set[str] | None = None,
    partial: Callable[[dict], None] | None = None,
) -> dict:
    """Every measurement of `tasks` (those of the kinds in `only`, when given), with a progress bar; returns the
    report (JSON-ready). `partial(report)`, if given, is called after each measurement with the report so far (the
    command writes it, so that a run stopped at a time limit keeps the rows it measured)."""
    report = dict(
        meta=record.meta_info(device),
        settings=vars(s) | {"batch": BATCH},
        only=None if only is None else sorted(only),
        throughput=[],
        overhead=[],
        compile=[],
        inference=[],
        profile=[],
        dispatch=[],
        soap=[],
        padding=[],
        suite=[],
        side_by_side=[],
        pareto_stack=[],
        capture=[],
        at_once=[],
        hf=[],
        snapshot=[],
        members=[],
        grid=[],
    )
    report["peak_gflops_start"] = matmul_peak(device)
    report["bandwidth_gbs"] = memory_bandwidth(device)  # the roofline floor's memory rate (capture rows)
    todo = [(label, fn) for label, fn in tasks(archs, methods, s, device, report) if only is None or fn.kind in only]
    with progress_bar(todo, desc="bench", unit="measurement", disable=not progress) as bar:
        for label, fn in bar:
            bar.set_description(f"bench: {label}")
            fn()
            if partial is not None:
                partial(report)
    report["peak_gflops_end"] = matmul_peak(device)
    report["peak_gflops"] = max(report["peak_gflops_start"], report["peak_gflops_end"])
    for row in report["throughput"]:
        row["peak_share"] = row["gflops"] / report["peak_gflops"]
    compiled = engine.compile_by_default(device, "paper")
    report["paper_estimate"] = paper_estimate(report, compiled=compiled)
    if torch.device(device).type == "cuda":  # on CUDA the paper table of each backbone, at the captured rates
        report["paper_estimates"] = [paper_estimate(report, a, compiled=compiled) for a in archs]
    return report
