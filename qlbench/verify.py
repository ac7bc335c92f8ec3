"""`qlbench verify`: check every norm and Lipschitz statement of the paper on a trained Queryable LoRA model
(`queryable` or `instruct-queryable`).

    qlbench verify --results results                      # a trained cell: records/<arch>/<function>/queryable/...
    qlbench verify --results results --method instruct-queryable
    qlbench verify                                        # trains a smoke cell first (in a temp folder, or --out's)

Over the cell's target test set (every member, float64 recomputation of the trained weights) it reports, per
statement: the observed value and the bound at the worst item (largest observed / bound), that tightness ratio, the
number of items (samples x blocks x layers ...) and holds / VIOLATED.

The Lipschitz statements are about the instruction embedding e: they probe e' = e + delta per chunk of samples with
each block's states held fixed (their premise; see tests/properties/THEOREMS.md). They start from the model's own
e(c) when it routes with one (instruct-queryable: each member's bound instruction embedding), else from a seeded
probe. A model without instruction channels (lambda_ctx = tau_lang = 0) does not depend on e at all; its rows are
reported as vacuous (0 <= 0).

This module returns data and raises ValueError on bad input; `qlbench.commands.verify` prints and sets exit codes.
"""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path

import torch

from qlbench import __version__, adapters, inputs, zoo
from qlbench.backbones import ARCHS
from qlbench.experiments import adapted, experiment
from qlbench.records.store import Store, finite
from qlbench.settings import Execution, Protocol
from qlbench.theory import checks, tracing
from qlbench.theory.bounds import REL_TOL

METHODS = adapters.of_family("queryable")  # the theorems are about routing over shared atoms
METHOD = METHODS[0]  # the default, and what a smoke cell trains
DEFAULT_FUNCTION = "dropwave"


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"verify checks {' or '.join(METHODS)} models, not {method!r}")
    return method


def find_record(
    results: Path, arch: str | None, function: str | None, budget: str | None = None, method: str = METHOD
) -> Path:
    """The `method` record under `results`; arch, function and budget may be left out when the record is
    unique (several configs of one cell: the newest)."""
    check_method(method)

    if arch is not None and arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; valid: {', '.join(ARCHS)}")
    if function is not None:
        zoo.card(function)  # ValueError naming the valid functions
    inputs.folder(results, "results folder")
    store = Store(results)
    found = store.records(arch or "*", function or "*", method, budget or "*")
    if not found:
        have = sorted(str(p.relative_to(store.root)) for p in store.records(method=method))
        raise ValueError(
            f"no {method} record for arch={arch or 'any'}, function={function or 'any'} under "
            f"{store.root / 'records'}" + (f"; found: {', '.join(have)}" if have else "")
        )
    cells = sorted({store.cell_of(p) for p in found})
    if len(cells) > 1:
        choices = ", ".join(f"--arch {a} --function {f} --budget {b}" for a, f, _, b in cells)
        raise ValueError(f"several {method} cells under {store.root}: choose one of {choices}")
    return max(found, key=lambda p: p.stat().st_mtime_ns)


def smoke_plan(folder: Path, arch: str, function: str, device: str, method: str = METHOD):
    """The plan of a smoke-budget cell of `method` to verify when no trained one is given (ValueError on bad
    input)."""
    protocol = Protocol(arch=arch, budget="smoke")
    return experiment.plan(
        [function], [check_method(method)], protocol=protocol, execution=Execution(device=device, out_dir=folder)
    )


def base_instruction(model, members: int, device) -> tuple[torch.Tensor, str]:
    """The instruction embedding e the Lipschitz probes start from, and what it is: the members' own e(c) when the
    model routes with one (instruct-queryable binds it), else a seeded N(0, I / d_c) per member (a model without
    instruction channels ignores it)."""
    memory = tracing.memory_of(model)
    if memory.instruction is not None:
        return memory.instruction.to(device, torch.float64), "the members' own e(c) (the model's bound instruction)"
    d_c = memory.config.instruction_dim or 1
    g = torch.Generator().manual_seed(0)
    e = torch.randn(members, d_c, generator=g, dtype=torch.float64) / math.sqrt(d_c)
    return e.to(device), "seeded probe e ~ N(0, I/d_c) per member"


def verify_record(record: Path, device: str = "cpu") -> dict:
    """Rebuild the trained cell and check every statement over its target test set; returns the JSON report."""
    try:
        model, data, rec = adapted.load_adapted(record, device=device)
    except (FileNotFoundError, ValueError, KeyError) as err:
        raise ValueError(f"cannot rebuild the trained cell from {record}: {err}") from None
    cfg = rec["run_info"]["config"]
    if cfg["method"] not in METHODS:
        raise ValueError(f"{record} is a {cfg['method']} record, not {' or '.join(METHODS)}")
    model.eval()
    x = data.x_test
    e, e_source = base_instruction(model, x.shape[0], x.device)
    bounds = checks.check_model(model, x, e)
    config = tracing.memory_of(model).config
    if not (config.lambda_ctx or config.tau_lang):
        for b in bounds:
            if b.label in LIPSCHITZ_LABELS and "(e')" in b.quantity:
                b.note = "vacuous: lambda_ctx = tau_lang = 0, routing does not depend on e"
    rows = [finite_row(b.summary()) for b in bounds]
    return {
        "schema": 1,
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "qlbench_version": __version__,
        "record": str(record),
        "function": cfg["function"],
        "arch": cfg["arch"],
        "method": cfg["method"],
        "budget": rec["run_info"]["budget"],
        "seeds": cfg["seeds"],
        "test_samples": int(x.shape[1]),
        "members": int(x.shape[0]),
        "arithmetic": "float64 recomputation of the trained weights",
        "instruction": f"{e_source}, e' = e + delta (||delta|| = 1e-3 max(1, ||e||))",
        "tolerance": f"holds when observed <= bound + {REL_TOL:.3g} (|bound| + |observed| + operand size)",
        "statements": rows,
        "violated": sum(r["status"] == "VIOLATED" for r in rows),
    }


LIPSCHITZ_LABELS = (
    "prop:app_summary_lipschitz",
    "prop:app_router_operator_lipschitz",
    "thm:app_attention_projection_norm_stability",
)


def finite_row(row: dict) -> dict:
    """A statement's summary with non-finite floats as None (JSON)."""
    return {k: (finite(v) if isinstance(v, float) else v) for k, v in row.items()}


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def format_table(report: dict) -> str:
    head = ("statement", "quantity", "items", "observed*", "bound*", "ratio", "status")
    rows = [
        (
            r["label"],
            r["quantity"],
            str(r["items"]),
            _fmt(r["observed"]),
            _fmt(r["bound"]),
            _fmt(r["ratio"]),
            r["status"] + (f" ({r['note']})" if r["note"] else ""),
        )
        for r in report["statements"]
    ]
    widths = [max(len(x[i]) for x in rows + [head]) for i in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in [head] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("* at the item with the largest observed / bound (ratio); items = samples x blocks x layers ...")
    return "\n".join(lines)
