"""`write_report`: every table, paired statistic and figure of a results frame, written to files, one set per
(arch, budget, backbone init): Markdown, LaTeX (booktabs, via the pandas Styler) and CSV tables, PNG and PDF figures,
and report.md.

Every number says how many seeds it stands on, and a diverged seed counts as MSE = inf in every "best" mark and
test (see `qlbench.metrics.stats` for the conventions).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from qlbench import adapters, diagnostics, text
from qlbench.backbones import DEFAULT_INIT
from qlbench.metrics import stats
from qlbench.records import per_seed, results, store
from qlbench.report import cost_figures, figures, tables

# --------------------------------------------------------------------------------------------------------------
# LaTeX: booktabs table floats from the pandas Styler.


def paper_latex(data: pd.DataFrame, label: str = "") -> str:
    """The LaTeX (booktabs) paper table of one (arch, budget) slice of `table_data`: a `table` float whose caption
    is the title and legend; names escaped, compiles with only \\usepackage{booktabs}."""
    cells, bold, italic = tables.grid(data, "latex")
    css = np.where(bold, "textbf: --rwrap;", "") + np.where(italic, "textit: --rwrap;", "")
    css = pd.DataFrame(css, index=cells.index, columns=cells.columns)
    return _styler_latex(
        cells.style.apply(lambda _: css, axis=None),
        caption=f"{_latex_escape(tables.title(data))}. {tables.legend(data, 'latex')}",
        label=label,
    )


_TEX = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "<": "$<$",
    ">": "$>$",
}


def _latex_escape(s: str) -> str:
    """Plain text -> LaTeX text (captions; Styler escapes the cells and labels)."""
    return "".join(_TEX.get(ch, ch) for ch in s)


def _styler_latex(sty, *, caption: str, label: str = "", index: bool = True) -> str:
    """booktabs table float from a Styler whose cell values are LaTeX already; row/column labels get escaped."""
    sty = sty.format_index(escape="latex", axis=1)
    sty = sty.format_index(escape="latex", axis=0) if index else sty.hide(axis="index")
    sty = sty.set_table_styles(
        [{"selector": "scriptsize", "props": ":;"}, {"selector": "setlength", "props": r":{\tabcolsep}{3pt};"}],
        overwrite=False,
    )
    ncols = sty.data.shape[1]
    return sty.to_latex(
        hrules=True,
        column_format="l" + "r" * ncols if index else "l" * ncols,
        caption=caption,
        label=label or None,
        position="htbp",
        position_float="centering",
        environment="table",
    )


# --------------------------------------------------------------------------------------------------------------
# Files: one table as .md / .tex / .csv, one figure as .png / .pdf.


def _write_table(files: list, stem: Path, formats, *, md: str, latex, csv: pd.DataFrame, provenance: str) -> None:
    """Write one table as stem.md / .tex / .csv (those in `formats`); `latex` is a str or a callable making one; the
    Markdown ends with `provenance` (`results.provenance` of the table's records)."""
    out = {
        "md": lambda: f"{md}\n\n{provenance}\n",
        "latex": lambda: latex() if callable(latex) else latex,
        "csv": lambda: text.csv(csv),
    }
    for fmt in formats:
        path = stem.with_suffix(".tex" if fmt == "latex" else f".{fmt}")
        store.write_text(out[fmt](), path)
        files.append(path)


def _save_figure(files: list, fig: Figure, stem: Path, dpi: int = 150) -> None:
    for ext in ("png", "pdf"):
        store.atomic_write(stem.with_suffix(f".{ext}"), lambda tmp, ext=ext: fig.savefig(tmp, format=ext, dpi=dpi))
        files.append(stem.with_suffix(f".{ext}"))


def _save_table(files: list, folder: Path, md: str, frame: pd.DataFrame, formats) -> None:
    """A section's table as folder/table.md (its Markdown `md`) and folder/table.csv (`frame`), as `formats` ask."""
    if "md" in formats:
        store.write_text(md + "\n", folder / "table.md")
        files.append(folder / "table.md")
    if "csv" in formats:
        store.write_text(text.csv(frame), folder / "table.csv")
        files.append(folder / "table.csv")


# --------------------------------------------------------------------------------------------------------------
# The report: every table, statistic and figure of a results frame, one set per (arch, budget).


def _validate(frame: pd.DataFrame, metric: str, formats) -> None:
    """One-line ValueErrors for what the CLI turns into exit 2."""
    if frame is None or len(frame) == 0:
        raise ValueError("no results to report: the results frame is empty")
    stats.metric_column(metric)
    bad = [f for f in formats if f not in text.FORMATS]
    if bad:
        raise ValueError(f"unknown format {bad[0]!r}; valid: {', '.join(text.FORMATS)}")
    required = ["function", "arch", "method", "budget", "seed", "status", *(m.column for m in stats.METRICS.values())]
    missing = [c for c in required if c not in frame]
    if missing:
        raise ValueError(f"results frame lacks column(s) {', '.join(missing)}")


def _slug(s) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(s))


def _stats_section(frame: pd.DataFrame, metric: str, folder: Path, formats, files: list, provenance: str) -> list[str]:
    """Paired statistics of one slice on `metric`: per function vs LoRA and vs the best static adapter, and the
    cross-function win/tie/loss; returns the Markdown parts and writes the files (`provenance`: their records')."""
    parts = []
    for baseline, name in ((adapters.BASELINE, "LoRA"), (stats.BEST_STATIC, "the best static adapter")):
        comp = stats.compare(frame, metric, baseline)
        if comp.empty:
            parts.append(f"No paired statistics against {name}: it is not in these results.")
            continue
        per_fn, wtl = tables.comparison_table(comp), tables.wtl_table(stats.win_tie_loss(comp))
        cap = f"paired by seed vs {name} ({stats.metric(metric).label})"
        for stem, table, title in (
            (f"stats-vs-{baseline}-{metric}", per_fn, f"Per function: {cap}"),
            (f"wtl-vs-{baseline}-{metric}", wtl, f"Across functions: {cap}"),
        ):
            latex = lambda t=table, c=title: _styler_latex(
                t.style.format(escape="latex"), index=False, caption=_latex_escape(f"{c}. {tables.STATS_LEGEND}")
            )
            _write_table(
                files,
                folder / stem,
                formats,
                md=f"{text.markdown(table)}\n\n{tables.STATS_LEGEND}",
                latex=latex,
                csv=comp if stem.startswith("stats") else stats.win_tie_loss(comp),
                provenance=provenance,
            )
            parts.append(f"#### {title}\n\n{text.markdown(table)}")
        parts.append(tables.STATS_LEGEND)
    return parts


def _slice_report(frame, curves, folder: Path, metric: str, formats, draw: bool, files: list) -> str:
    """Tables, statistics and (when `draw`) figures of one (arch, budget) into `folder`; returns its Markdown, which
    states its records' provenance under its heading (and each table's file at its end)."""
    arch, budget = frame["arch"].iloc[0], frame["budget"].iloc[0]
    folder.mkdir(parents=True, exist_ok=True)
    prov = results.provenance(frame)
    parts = [f"## {arch}, budget {budget}", prov]
    if gaps := tables.missing_note(frame):
        parts.append(gaps)
    if headline := tables.across_markdown(frame, metric):  # the question a reader asks first: across the zoo
        parts.append(headline.replace("#### ", "### Headline: ", 1))
        comp = stats.across_functions(frame, metric)
        _write_table(
            files,
            folder / f"across-vs-lora-{metric}",
            [f for f in formats if f != "latex"],
            md=headline,
            latex="",
            csv=comp,
            provenance=prov,
        )
    for m in dict.fromkeys(["best-train", metric]):  # the train table, then the chosen test table
        data = tables.table_data(frame, m)
        md = tables.paper_markdown(data)
        if m == metric and (note := tables.collapse_note(frame, m)):
            md = f"{md}\n\n{note}"
        if across := tables.across_markdown(frame, m):
            md = f"{md}\n\n{across}"
        _write_table(
            files,
            folder / f"table-{m}",
            formats,
            md=f"### {tables.title(data)}\n\n{md}",
            csv=data,
            latex=lambda d=data, m=m: paper_latex(d, label=f"tab:{_slug(arch)}-{_slug(budget)}-{m}"),
            provenance=prov,
        )
        parts.append(f"### {tables.title(data)}\n\n{md}")
    parts.append(f"### Paired statistics ({stats.metric(metric).label})")
    parts += _stats_section(frame, metric, folder, formats, files, prov)
    cost = tables.cost_table(frame)
    title = f"Cost, {arch}, budget {budget}"
    _write_table(
        files,
        folder / "cost",
        formats,
        md=f"### {title}\n\n{text.markdown(cost)}\n\n{tables.COST_LEGEND}",
        csv=cost,
        latex=lambda: _styler_latex(
            cost.style.format(escape="latex"), index=False, caption=_latex_escape(f"{title}. {tables.COST_LEGEND}")
        ),
        provenance=prov,
    )
    parts.append(f"### {title}\n\n{text.markdown(cost)}\n\n{tables.COST_LEGEND}")
    if draw:
        _slice_figures(frame, curves, folder, metric, files)
    return "\n\n".join(parts)


def _init_slice(f: pd.DataFrame | None, arch: str, budget: str, init: str, label: str) -> pd.DataFrame | None:
    """The rows of a curves or gradients frame for one (arch, budget, backbone init), arch relabelled."""
    if f is None or not len(f):
        return f
    inits = f["backbone_init"] if "backbone_init" in f else pd.Series(DEFAULT_INIT, index=f.index)
    keep = (f["arch"] == arch) & (f["budget"] == budget) & (inits == init)
    return f[keep].assign(arch=label)


def _slice_figures(frame, curves, folder: Path, metric: str, files: list) -> None:
    arch, budget = frame["arch"].iloc[0], frame["budget"].iloc[0]
    if curves is not None and len(curves):
        c = curves[(curves["arch"] == arch) & (curves["budget"] == budget)]
        for split in ("train", "test") if len(c) else ():
            _save_figure(files, figures.curves_figure(c, split), folder / f"curves-{split}")
    if adapters.BASELINE in set(frame["method"]) and len(set(frame["method"])) > 1:  # LoRA alone has nothing to compare
        _save_figure(files, figures.log_ratio_figure(frame, metric), folder / f"log-ratio-{metric}")
    for x in cost_figures.COST_AXES:
        if (fig := cost_figures.cost_figure(frame, metric, x)) is not None:
            _save_figure(files, fig, folder / f"cost-{x}-{metric}")


def _gradient_section(grads: pd.DataFrame, folder: Path, formats, draw: bool, files: list, provenance: str) -> str:
    """The concentration table (vs LoRA) and the gradient figures of one slice of `results.load_gradients`
    (`provenance`: the slice's records')."""
    per_seed = diagnostics.concentration_per_seed(grads)
    comparison = diagnostics.compare_concentration(per_seed)
    table, legend = tables.concentration_table(comparison), tables.concentration_legend(comparison)
    arch, budget = grads["arch"].iloc[0], grads["budget"].iloc[0]
    title = f"Gradient concentration index, {arch}, budget {budget}"
    _write_table(
        files,
        folder / "gradient-concentration",
        [f for f in formats if f != "latex"],
        md=f"### {title}\n\n{text.markdown(table)}\n\n{legend}",
        latex="",
        csv=comparison,
        provenance=provenance,
    )
    if draw:  # the paper's comparison (LoRA, queryable, instruct-queryable) where present; the table has all
        shown = [m for m in diagnostics.GRADIENT_METHODS if m in set(grads["method"])] or None
        _save_figure(files, figures.gradient_profile_figure(grads, shown), folder / "gradient-profile", dpi=100)
        _save_figure(files, figures.concentration_figure(grads, shown), folder / "gradient-concentration", dpi=100)
    return f"### {title}\n\n{text.markdown(table)}\n\n{legend}"


def write_report(
    frame: pd.DataFrame,
    curves: pd.DataFrame | None,
    out_dir: Path,
    *,
    metric: str = "test-at-best-train",
    formats=text.FORMATS,
    figures: bool = True,
    gradients: pd.DataFrame | None = None,
) -> dict:
    """Write every table, paired statistic and figure of a results frame into out_dir, one set per (arch, budget)
    in out_dir/<arch>/<budget>/ (never mixed), plus out_dir/report.md when "md" is in `formats`. Records of a
    non-default backbone init (column backbone_init) are a slice of their own, in out_dir/<arch>-<init>/<budget>/,
    labelled "<arch>, <init> init" in its tables and figures.

    frame: `results.load`; curves: `results.load_curves` (or None: no curve figures); metric: the test metric
    (best-train | best-test | test-at-best-train), shown after the best-train table and used by the statistics;
    formats: any of md, latex, csv; gradients: `results.load_gradients` (or None): adds the gradient concentration
    table (vs LoRA, paired) and the gradient figures of each slice that has any.
    Every slice and every table's Markdown states the provenance of its records (`results.provenance`: their
    commits, and a warning when they are not one clean commit's).
    out_dir/per-seed.csv.gz holds the frame's per-seed rows (`per_seed.write`): `qlbench report` on that file
    rebuilds every table.
    Returns {"markdown": the report text, "files": [paths written], "provenance": of every record of `frame`}.
    ValueError (one line) for an empty frame, a bad metric or format.
    """
    _validate(frame, metric, formats)
    out_dir, files, sections, given = Path(out_dir), [], [], frame
    if "backbone_init" not in frame:
        frame = frame.assign(backbone_init=DEFAULT_INIT)
    # rows in one order whatever the loader's (records or a per-seed CSV): the same frame gives the same files
    frame = frame.sort_values(["arch", "budget", "backbone_init", "function", "method", "seed"], kind="stable")
    for (arch, budget, init), group in frame.groupby(["arch", "budget", "backbone_init"], sort=True):
        label = arch if init == DEFAULT_INIT else f"{arch}, {init} init"
        folder = out_dir / _slug(arch if init == DEFAULT_INIT else f"{arch}-{init}") / _slug(budget)
        key = (arch, budget, init, label)
        # a learning-rate grid's methods are shown per rate (the per-seed CSV keeps their names and rates)
        group = stats.by_rate(group.drop(columns="backbone_init").assign(arch=label))
        sections.append(_slice_report(group, _init_slice(curves, *key), folder, metric, formats, figures, files))
        if gradients is not None and len(g := _init_slice(gradients, *key)):
            sections.append(_gradient_section(g, folder, formats, figures, files, results.provenance(group)))
    md = "\n\n".join(sections) + "\n"
    if "record" in frame:  # the records every table above reads, compactly, beside them (rebuilt from: report CSV)
        files.append(per_seed.write(frame, out_dir / per_seed.FILE))
    if "md" in formats:
        out_dir.mkdir(parents=True, exist_ok=True)
        store.write_text(md, out_dir / "report.md")
        files.append(out_dir / "report.md")
    return {"markdown": md, "files": files, "provenance": results.provenance(given)}
