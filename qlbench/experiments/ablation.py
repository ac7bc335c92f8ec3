"""The paper's instruction-router ablation on a synthetic task: instruct-queryable trained with eight instruction
variants, every one with the same trainable parameters, each a normal cell of the results store.

    no-instruction     tau_lang = lambda_ctx = 0: state-only routing (the instruction channels exist, unused)
    generic            "a smooth two-dimensional function" for every task
    card               the function card's sentence (the method's default, instruction_source "card")
    shuffled           another card's sentence (a fixed derangement: the next card in name order)
    adversarial        the card's sentence describing a very different surface
    random             a seeded random embedding with the norm of the card's
    no-language-prior  tau_lang = 0: the instruction enters the query only, no language prior over the atoms
                       (not the paper's "state-query-only" router, which also drops the instruction from the query:
                       that is `no-instruction`)
    instruction-only   the query is w_b + lambda_ctx Q_ctx e: no state and no depth term (input-independent routes)

What a single task can show (LIMITATION, printed with every table): with one task the instruction is the same
sentence for every sample, so e(c) is a constant. Its query term lambda_ctx Q_ctx e is then a constant vector that
the learned block prior w_b can absorb, and its language prior a constant bias of the logits that the keys can
absorb: a difference between the instruction rows cannot come from what the sentence says about the task. The
informative ablation varies the instruction across tasks that share one adapter: `suite_plans` runs it on a
multi-task suite (`qlbench ablate --suite`), where each sample is routed with its own task's instruction:

    card               each task's own sentence (instruct-queryable)
    same-instruction   one sentence for every task (instruct-queryable on the suite's -same-instruction control)
    task-code          each sentence replaced by a fixed random vector: identity without language
    no-instruction, no-language-prior, instruction-only   as above
"""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd

from qlbench import engine, suites, text
from qlbench.experiments import adapted, experiment, multitask
from qlbench.metrics import stats, suite_stats
from qlbench.records import results
from qlbench.settings import DEFAULT_EXECUTION, DEFAULT_PROTOCOL, Execution, Protocol

METHOD = "instruct-queryable"
REFERENCE = "card"  # the variant every other is compared with
LIMITATION = (
    "One task: e(c) is the same for every sample, so the instruction's query term is a constant that the block prior "
    "w_b can absorb and its prior a constant logit bias the keys can absorb; differences between instruction rows "
    "cannot come from what the sentence says about the task (see docs/methods.md, the ablation)."
)
VARIANTS: dict[str, dict] = {  # the structural ones from multitask, which runs them on a suite too
    "no-instruction": multitask.STRUCTURAL_VARIANTS["no-instruction"],
    "generic": dict(instruction_source="generic"),
    "card": dict(),
    "shuffled": dict(instruction_source="shuffled"),
    "adversarial": dict(instruction_source="adversarial"),
    "random": dict(instruction_source="random"),
    "no-language-prior": multitask.STRUCTURAL_VARIANTS["no-language-prior"],
    "instruction-only": multitask.STRUCTURAL_VARIANTS["instruction-only"],
}


def plans(
    *,
    function: str,
    overrides: dict | None = None,
    protocol: Protocol = DEFAULT_PROTOCOL,
    execution: Execution = DEFAULT_EXECUTION,
) -> dict[str, experiment.Plan]:
    """One validated plan per variant (ValueError on bad input, before any work). `overrides`: instruct-queryable
    settings for every variant, none of which a variant sets (`check_overrides`)."""
    overrides = check_overrides(overrides, VARIANTS.values())
    settings = dict(protocol=protocol, execution=execution)
    return {
        name: experiment.plan([function], [METHOD], overrides=overrides | fixed, **settings)
        for name, fixed in VARIANTS.items()
    }


def check_overrides(overrides: dict | None, variants) -> dict:
    """A user's instruct-queryable settings (--hp), refused (ValueError) where one is what a variant varies: the
    ablation compares the variants' settings, all else equal."""
    overrides = dict(overrides or {})
    varied = sorted({k for fixed in variants for k in fixed})
    if taken := sorted(set(overrides) & set(varied)):
        raise ValueError(
            f"hyper-parameter {', '.join(taken)} is what the ablation's variants vary; valid: any other {METHOD} "
            f"setting (varied: {', '.join(varied)})"
        )
    return overrides


def evaluation_time(record: Path, repeats: int = 3) -> tuple[float, float]:
    """(seconds to evaluate the cell's whole target test set, all members, best of `repeats`; seconds per sample
    and member) for the trained model of a record, with the engine's thread setting for the stack."""
    model, data, rec = adapted.load_adapted(record)
    model.eval()
    best = float("inf")
    with engine.num_threads(engine.auto_threads(rec["run_info"]["config"]["arch"], data.x_test.shape[0])):
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.evaluate(model, data.x_test, data.y_test)
            best = min(best, time.perf_counter() - t0)
    return best, best / data.x_test.shape[0] / data.x_test.shape[1]


def legend(table: pd.DataFrame) -> str:
    """What the paired columns of an ablation table (`table` or `suite_table`) say, with the size of its Holm family:
    the variants whose paired test against the card has a p."""
    family = int(pd.to_numeric(table.get("Holm p", pd.Series(dtype=object)), errors="coerce").notna().sum())
    return (
        f"diff vs {REFERENCE}: the variant minus {REFERENCE}, paired by seed; p raw (paired t-test, Wilcoxon "
        f"signed-rank when a seed diverged); Holm p: p Holm-adjusted over the table's {family} comparisons with "
        f"{REFERENCE} (every variant against it), since the table makes that many claims at once: a difference is "
        "significant when Holm p < 0.05 (with at least 3 pairs)."
    )


def _fill_holm(rows: list[dict], tests: dict[str, dict], fmt) -> None:
    """Set "Holm p" (in place) of each tested variant's row: its p Holm-adjusted over the family of every paired
    test of one table (`stats.holm`; a NaN p stays out of the family), formatted by `fmt`."""
    adjusted = dict(zip(tests, stats.holm([t["p"] for t in tests.values()])))
    for row in rows:
        if row["variant"] in adjusted:
            row["Holm p"] = fmt(adjusted[row["variant"]])


def table(records: dict[str, Path]) -> pd.DataFrame:
    """One row per variant: the three metrics (mean ± std over seeds, diverged seeds as inf), evaluation time and
    latency per sample, and the paired difference to the card's instruction on test MSE at the best-train epoch
    with its raw p and its p Holm-adjusted over the table's comparisons (every variant against the card; `legend`
    says how many)."""
    frame = results.load(list(records.values()))
    variant_of = {str(path): name for name, path in records.items()}
    frame["variant"] = frame["record"].map(variant_of)
    column = stats.metric_column("test-at-best-train")
    by_seed = lambda g, col: stats.scores(g, col).set_axis(g["seed"]).sort_index()  # (seeds,), paired by seed
    reference = by_seed(frame[frame["variant"] == REFERENCE], column)
    rows, tests = [], {}
    for name, path in records.items():
        g = frame[frame["variant"] == name]
        if (g["status"] == "failed").all():  # a failed cell: a row that says so, never a missing one
            rows.append({"variant": name, "trainable": "-", "diverged": "-", **{m: "failed" for m in stats.METRICS}})
            continue
        n_div = int((g["status"] == "diverged").sum())
        row = {"variant": name, "trainable": f"{int(g['trainable_params'].iloc[0]):,}", "diverged": f"{n_div}/{len(g)}"}
        for metric in stats.METRICS:  # mean ± std over the n seeds; "inf (k ok: ...)" when a seed diverged
            (summary,) = stats.summarize(g, stats.metric_column(metric)).itertuples()
            row[metric] = text.seed_cell(summary)
        seconds, latency = evaluation_time(path)
        row["eval s"] = f"{seconds:.3f}"
        row["µs / sample"] = f"{1e6 * latency:.2f}"
        row[f"diff vs {REFERENCE} [95% CI], p"] = row["Holm p"] = "-"
        if name != REFERENCE and len(reference):  # no reference record (another process has it): no comparison
            mine = by_seed(g, column)
            test = tests[name] = stats.paired_test(mine.to_numpy(), reference.to_numpy())
            row[f"diff vs {REFERENCE} [95% CI], p"] = (
                f"{text.num(test['mean_diff'], 3)} [{text.num(test['ci_low'], 2)}, {text.num(test['ci_high'], 2)}], "
                f"p = {test['p']:.2g}"
            )
        rows.append(row)
    _fill_holm(rows, tests, lambda p: f"{p:.2g}")  # one family: every variant against the card in this table
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------------------------
# On a multi-task suite.

SUITE_ROWS = (METHOD, "task-code", *multitask.STRUCTURAL_VARIANTS)
SUITE_VARIANT = {"instruct-queryable": REFERENCE}  # a row's name in the ablation table (others keep theirs)
SAME = suite_stats.CONTROL


def suite_plans(
    *,
    suite: str,
    schedule: str = "joint",
    overrides: dict | None = None,
    protocol: Protocol = DEFAULT_PROTOCOL,
    execution: Execution = DEFAULT_EXECUTION,
) -> dict[str, multitask.SuitePlan]:
    """The suite ablation's two validated plans: the structural variants on `suite`, and instruct-queryable on its
    same-instruction control (ValueError on bad input, before any work). `overrides` as `plans`'."""
    if suite.endswith(suites.CONTROL_SUFFIX):
        raise ValueError(f"ablate --suite takes a suite card, not a control: {suites.base_name(suite)!r}")
    overrides = check_overrides(overrides, [multitask.method_of(r)[1] for r in SUITE_ROWS])
    settings = dict(overrides=overrides, protocol=protocol, execution=execution)
    return {
        "variants": multitask.plan(suite, schedule, list(SUITE_ROWS), **settings),
        SAME: multitask.plan(suite + suites.CONTROL_SUFFIX, schedule, ["instruct-queryable"], **settings),
    }


def suite_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per variant of a suite ablation (`suite_stats.load` of its records): the suite metrics (mean ± std
    over seeds) and the paired difference of the average to the card's sentences, with its raw p and its p
    Holm-adjusted over the table's comparisons (every variant against the card; `legend` says how many)."""
    frame = frame.assign(variant=[SUITE_VARIANT.get(m, m) for m in frame["method"]])  # the control: SAME
    reference = frame[frame["variant"] == REFERENCE].set_index("seed")["average"]
    rows, tests = [], {}
    for name in (REFERENCE, SAME, *(r for r in SUITE_ROWS if r not in SUITE_VARIANT)):
        g = frame[frame["variant"] == name]
        if g.empty:
            continue
        row = {"variant": name, "trainable": f"{int(g['trainable_params'].iloc[0]):,}"}
        if (g["status"] == "failed").all():
            rows.append(row | {"average": "failed"})
            continue
        for metric in ("average", "paraphrased", "shuffled", "held-out", "usage-kl"):
            row[metric] = suite_stats.cell(g[metric], g["status"])
        row[f"diff vs {REFERENCE}, p"] = row["Holm p"] = "-"
        if name != REFERENCE:
            mine = g.set_index("seed")["average"]
            common = mine.index.intersection(reference.index)
            test = tests[name] = stats.paired_test(mine[common].to_numpy(), reference[common].to_numpy())
            row[f"diff vs {REFERENCE}, p"] = f"{text.num(test['mean_diff'], 3)}, p = {text.num(test['p'], 2)}"
        rows.append(row)
    _fill_holm(rows, tests, lambda p: text.num(p, 2))  # one family: every variant against the card in this table
    table = pd.DataFrame(rows)
    kept = [c for c in table.columns if c.startswith("diff") or c == "Holm p" or not (table[c] == "-").all()]
    return table.loc[:, kept]
