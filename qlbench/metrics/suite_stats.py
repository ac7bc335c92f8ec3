"""Suite records -> per-seed metrics -> the suite table with paired tests against LoRA.

One row per (record, seed) of `load`: the slice keys SLICE (a `-same-instruction` control is folded into its card's
slice, its instruct-queryable row named CONTROL), the row's method, the seed, its status, the continual
metrics of `qlbench.metrics.continual` computed from that seed's stage x task matrix, and the raw arrays (R, initial,
usage) for the figures. A diverged seed scores inf in every metric (as in `qlbench.metrics.stats`: equally worst, never
dropped from a test); a failed row has one row per seed with status "failed" and no metrics.

    average      final test MSE averaged over the tasks the schedule trains (suites.schedule_stages: all T under
                 joint and a card's sequential; all but the held-out tasks under held-out and a parametric card's
                 sequential)
    paraphrased  the same average with every task's paraphrases in place of its sentence (instruction methods)
    shuffled     the same average with task t given task t + 1's instruction (instruction methods)
    held-out     the never-trained tasks' mean test MSE (schedule held-out: the last task, or a parametric card's
                 interpolation and extrapolation tasks; a parametric card's sequential schedule too)
    forgetting   mean over the tasks trained before the last stage of continual.forgetting (schedule sequential)
    bwt, fwt     GEM's backward and forward transfer on -MSE (schedule sequential)
    usage-kl     mean over task pairs of the final symmetric KL between the tasks' atom usage (routed rows)
    route-drift  mean over stages and tasks of the stagewise route drift (routed rows, schedule sequential)

Usage-based numbers are computed per seed and then averaged: atom m of one seed has nothing to do with atom m of
another, so usage itself is never averaged over seeds.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from qlbench import adapters, suites, text
from qlbench.metrics import continual, stats
from qlbench.records.results import cost_fields, git_fields, read_record
from qlbench.records.store import DamagedFile, Store
from qlbench.text import Column

SLICE = ["arch", "suite", "schedule", "budget", "backbone_init"]
METRICS = ("average", "paraphrased", "shuffled", "held-out", "forgetting", "bwt", "fwt", "usage-kl", "route-drift")
LOWER_IS_BETTER = {"average", "paraphrased", "shuffled", "held-out", "forgetting"}
CONTROL = "same-instruction"  # instruct-queryable on a suite's -same-instruction control
MAX_TASK_COLUMNS = 8  # a suite of more tasks has no per-task columns (the held-out section summarises them)


def row_name(suite: str, row: str) -> str:
    """A record's row in its card's table: a row run on a `-same-instruction` control joins its card's table as
    CONTROL ("instruct-queryable" there) or "<row> (same-instruction)"; the control shares the card's backbone,
    data and seeds, so it pairs with the card's rows seed by seed."""
    if not suite.endswith(suites.CONTROL_SUFFIX):
        return row
    return CONTROL if row == "instruct-queryable" else f"{row} ({CONTROL})"


def _array(v) -> np.ndarray:
    """A nested list from a record as floats (None: a non-finite value written as JSON null -> inf)."""
    return np.array(v, dtype=float) if v is not None else None


def stage_of(config: dict) -> np.ndarray:
    """(T,) the stage that trains each task of a suite record (-1: never trained)."""
    out = np.full(len(config["suite_card"]["tasks"]), -1)
    for k, group in enumerate(suites.record_stages(config)):
        out[group] = k
    return out


def _seed_metrics(schedule: str, stage: np.ndarray, s: dict) -> dict:
    """One seed's metrics; `stage` (T,) the stage that trains each task (stage_of)."""
    R = np.nan_to_num(_array(s["stage_task_mse"]), nan=math.inf)  # (S, T)
    trained, never = stage >= 0, stage < 0
    out = {
        "average": continual.average(R[:, trained]),  # over the tasks the schedule trains
        "held-out": float(R[-1, never].mean()) if never.any() else math.nan,
    }
    for key, name in (("paraphrase_task_mse", "paraphrased"), ("shuffled_task_mse", "shuffled")):
        out[name] = float(np.nan_to_num(_array(s[key]), nan=math.inf)[trained].mean()) if key in s else math.nan
    if schedule == "sequential":
        initial = np.nan_to_num(_array(s["initial_task_mse"]), nan=math.inf)
        with np.errstate(invalid="ignore"):
            out |= {
                "forgetting": float(continual.forgetting(R, stage).mean()),
                "bwt": continual.bwt(R, stage),
                "fwt": continual.fwt(R, initial, stage),
            }
    else:
        out |= {"forgetting": math.nan, "bwt": math.nan, "fwt": math.nan}
    out["usage-kl"] = out["route-drift"] = math.nan
    if s.get("usage") is not None and s["status"] == "ok":
        U = _array(s["usage"])  # (S, T, M)
        kl = continual.symmetric_kl(U[-1])
        out["usage-kl"] = float(kl[~np.eye(len(kl), dtype=bool)].mean())
        if schedule == "sequential":
            out["route-drift"] = float(continual.route_drift(U).mean())
    if s["status"] == "diverged":  # equally worst in every metric, never dropped
        out = {k: (math.inf if k in LOWER_IS_BETTER else -math.inf) if not math.isnan(v) else v for k, v in out.items()}
    return out


def load(paths_or_root, on_damaged=None) -> pd.DataFrame:
    """Every suite record of a results folder (or the given record paths) as one row per (record, seed), with the
    record's path, commit and dirty flag; a damaged record goes to on_damaged(message) (default: a warning) and is
    skipped."""
    rows = []
    paths = Store(paths_or_root).suite_records() if isinstance(paths_or_root, str | Path) else paths_or_root
    for path in paths:
        try:
            rec = read_record(path)
        except DamagedFile as err:
            (on_damaged or (lambda m: warnings.warn(m, stacklevel=2)))(f"{err}; skipped")
            continue
        cfg, info = rec["run_info"]["config"], rec["train_info"]
        key = {
            "arch": cfg["arch"],
            "suite": suites.base_name(cfg["suite"]),
            "schedule": cfg["schedule"],
            "budget": cfg["budget"]["name"],
            "backbone_init": cfg["backbone_init"],
            "method": row_name(cfg["suite"], cfg["row"]),
            "trainable_params": info.get("trainable_params"),
            **cost_fields(info),
            "tasks": tuple(cfg["suite_card"]["tasks"][t]["name"] for t in range(len(cfg["suite_card"]["tasks"]))),
            "path": str(path),
            **git_fields(rec["run_info"].get("git")),  # the record's commit and dirty flag (results.GIT_COLUMNS)
        }
        if info["status"] == "failed" or not info.get("per_seed"):
            rows += [key | {"seed": s, "status": "failed"} for s in cfg["seeds"]]
            continue
        stage = stage_of(cfg)  # the record's schedule, once for its seeds
        for s in info["per_seed"]:
            arrays = {
                "R": _array(s["stage_task_mse"]),
                "initial": _array(s["initial_task_mse"]),
                "usage": _array(s.get("usage")),
                "paraphrase": _array(s.get("paraphrase_task_mse")),  # (T,) after the last stage
                "shuffled_R": _array(s.get("shuffled_task_mse")),  # (T,)
            }
            rows.append(
                key | {"seed": s["seed"], "status": s["status"]} | _seed_metrics(cfg["schedule"], stage, s) | arrays
            )
    return pd.DataFrame(rows)


def index(frame: pd.DataFrame) -> pd.DataFrame:
    """One line per suite record of `load`'s frame: its slice, row, status, seeds and diverged seeds."""
    if frame.empty:
        return frame
    rows = []
    for (path, method), g in frame.groupby(["path", "method"], sort=True):
        first = g.iloc[0]
        status = (
            "failed" if (g["status"] == "failed").all() else "diverged" if (g["status"] == "diverged").any() else "ok"
        )
        rows.append(
            {k: first[k] for k in SLICE}
            | {
                "method": method,
                "hash": Path(path).stem.split("-")[-1],
                "status": status,
                "seeds": len(g),
                "diverged": int((g["status"] == "diverged").sum()),
            }
        )
    return pd.DataFrame(rows).sort_values([*SLICE, "method"], key=None).reset_index(drop=True)


def cell(values: pd.Series, status: pd.Series) -> str:
    """mean ± std over the finite seeds; a diverged seed shows as inf with the survivors' count."""
    v = values.to_numpy(float)
    if np.isnan(v).all():
        return "-"
    finite = v[np.isfinite(v)]
    body = text.mean_std(
        float(finite.mean()) if len(finite) else math.nan,
        float(np.std(finite, ddof=1)) if len(finite) > 1 else math.nan,
        len(finite),
    )
    n_div = int((status == "diverged").sum())
    return f"inf ({len(finite)} ok: {body})" if n_div else body


def summary(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (slice, method) in the tables' method order: n seeds, trainable parameters, every metric as
    "mean ± std" text (columns METRICS, and for a suite of at most MAX_TASK_COLUMNS tasks one column per task with
    its final MSE), and the paired test of the
    average against LoRA over the common seeds (p raw, p_holm Holm-adjusted over the slice's table; vs-lora: the
    mean difference, p and Holm p as text; outcome win | tie | loss, decided on p_holm)."""
    out = []
    for key, g in frame.groupby(SLICE, sort=True):
        tasks = g["tasks"].iloc[0]
        base = g[g["method"] == adapters.BASELINE]
        tested = []  # (row, paired test) of every row of this slice's table compared with LoRA: one Holm family
        for method in stats.method_order(g["method"].unique()):
            m = g[g["method"] == method]
            row = dict(zip(SLICE, key)) | {
                "method": method,
                "n": len(m),
                "trainable_params": m["trainable_params"].iloc[0],
            }
            if (m["status"] == "failed").all():
                out.append(row | {"average": "failed"})
                continue
            for metric in METRICS:
                row[metric] = cell(m[metric], m["status"])
            for t, name in enumerate(tasks if len(tasks) <= MAX_TASK_COLUMNS else ()):
                finals = m["R"].map(
                    lambda R, t=t: math.inf if R is None else float(np.nan_to_num(R[-1, t], nan=math.inf))
                )
                row[name] = cell(finals, m["status"])
            if method != adapters.BASELINE and len(base) and stats.is_adapter(method):
                paired = m.merge(base, on="seed", suffixes=("", "_b"))
                tested.append((row, stats.paired_test(paired["average"], paired["average_b"])))
            out.append(row)
        _vs_lora(tested)
    return pd.DataFrame(out)


def _vs_lora(tested: list[tuple[dict, dict]]) -> None:
    """Fill p, p_holm, vs-lora and outcome of one table's rows (in place) from their paired tests against LoRA. A
    table compares every row with LoRA at once, so its rows are one family: p_holm is Holm-adjusted over it
    (`stats.holm`), and a win or loss needs p_holm < ALPHA, not only the raw p."""
    adjusted = stats.holm([t["p"] for _, t in tested])  # NaN (no test) stays out of the family
    for (row, t), p_holm in zip(tested, adjusted):
        shown = f"{text.num(t['mean_diff'], 2)} (p {text.num(t['p'], 2)}, Holm {text.num(p_holm, 2)})"
        row |= {"p": t["p"], "p_holm": p_holm, "vs-lora": shown if t["n"] >= 2 else "-"}
        row["outcome"] = t["outcome"] if p_holm < stats.ALPHA else "tie"  # p_holm >= p: only fewer claims


def mean_over_seeds(frame: pd.DataFrame, column: str, of=lambda a: a) -> np.ndarray | None:
    """The mean over a group's ok seeds of of(array) for an array column (R, initial, usage); None when no seed has
    it. Never average usage itself (atoms are per seed): pass `of` a permutation-invariant function of it."""
    ok = [of(a) for a, s in zip(frame[column], frame["status"]) if s == "ok" and a is not None]
    return np.mean(np.stack(ok), axis=0) if ok else None


COLUMN_NOTES = {
    "paraphrased": "the average with every task's paraphrases in place of its sentence",
    "shuffled": "the average with task t given task t + 1's instruction",
    "held-out": "the never-trained tasks (held-out), zero-shot",
    "forgetting": "final minus best earlier MSE after training, mean over the tasks trained before the last stage",
    "bwt": "GEM backward transfer on -MSE (< 0: later stages hurt earlier tasks)",
    "fwt": "GEM forward transfer on -MSE (> 0: earlier stages helped)",
    "usage-kl": "final symmetric KL between the tasks' atom usage, mean over task pairs (nats)",
    "route-drift": "total variation of each task's usage from one stage to the next, mean",
    "vs-lora": "mean difference of the average against LoRA, paired over seeds, its raw p and its p Holm-adjusted "
    "over the table's {family} comparisons with LoRA",
    "outcome": "win / loss when the Holm-adjusted p < 0.05 (with at least 3 pairs), else tie",
}


def table_text(summary) -> str:
    """The suite table of one slice (suite_stats.summary rows), columns with no value anywhere left out, and the
    notes of the columns it shows."""
    rows = summary.to_dict("records")
    present = lambda key: any(isinstance(r.get(key), str) and r[key] not in ("-", "") for r in rows)
    tasks = [c for c in summary.columns if c not in (*SLICE, "method", "n", "trainable_params")]
    tasks = [c for c in tasks if c not in (*METRICS, "vs-lora", "outcome", "p", "p_holm")]
    columns = [
        Column("method", "method"),
        Column("trainable", "trainable_params", lambda v: "-" if v is None or v != v else f"{int(v):,}"),
        Column("average", "average"),
        *(Column(t, t, lambda v: "-" if not isinstance(v, str) else v) for t in tasks if present(t)),
        *(Column(m, m, lambda v: "-" if not isinstance(v, str) else v) for m in METRICS[1:] if present(m)),
        *(Column(c, c, lambda v: "-" if not isinstance(v, str) else v) for c in ("vs-lora", "outcome") if present(c)),
    ]
    family = sum(isinstance(r.get("p"), float) and not math.isnan(r["p"]) for r in rows)  # the rows tested vs LoRA
    notes = [
        f"{c.heading}: {COLUMN_NOTES[c.heading].format(family=family)}" for c in columns if c.heading in COLUMN_NOTES
    ]
    return text.table(rows, columns) + ("\n\n" + "; ".join(notes) if notes else "")
