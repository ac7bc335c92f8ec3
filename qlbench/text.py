"""Text for people: number formatting, the seed-summary cell, and Markdown tables built from rows and column specs.

One module for every table qlbench prints or writes (`qlbench run`, `results`, `report`, `ablate`, `bench`,
`diagnose`, `signal`), so a number reads the same everywhere:

    text.num(0.012345, 3)              -> "0.0123"
    text.mean_std(0.0161, 8.3e-4, 3)   -> "0.0161 ± 8.3e-04"
    text.seed_cell(summary_row)        -> "0.0161 ± 8.3e-04" | "inf (2 ok: 0.0161 ± 8.3e-04)" | "failed"
    text.table(rows, [Column("E", "members"), Column("speed-up", "speedup", times)])

Pure Python and pandas (a table can also be given as a DataFrame); nothing here computes a statistic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pandas as pd

FORMATS = ("md", "latex", "csv")  # the table formats `qlbench report` writes
PM = {"md": " ± ", "latex": r" $\pm$ "}  # mean ± std, per output format
# Significant digits of a float in a CSV table. A table's numbers are computed from its records (means, p-values,
# bootstrap intervals); their last bits follow the machine's floating-point paths (SIMD width, libm), so 17 digits
# would differ between two machines that read the same records. Ten digits are far more than any table shows.
CSV_DIGITS = 10

# ---------------------------------------------------------------------------------------------------------------
# Numbers


def num(v: float, sig: int) -> str:
    """`sig` significant digits, positional between 1e-3 and 1e5, scientific outside."""
    if v == 0 or not math.isfinite(v):
        return f"{v:g}"
    e = math.floor(math.log10(abs(v)))
    return f"{v:.{max(sig - 1 - e, 0)}f}" if -3 <= e < 5 else f"{v:.{sig - 1}e}"


def fixed(v: float | None, digits: int = 1) -> str:
    """A fixed-point number with thousands separators; "-" for a missing value."""
    return "-" if v is None else f"{v:,.{digits}f}"


def pct(v: float | None, digits: int = 0) -> str:
    """A signed percentage ("+12%"); "-" for a missing value."""
    return "-" if v is None else f"{v:+.{digits}f}%"


def share(v: float | None, digits: int = 0) -> str:
    """A fraction as an unsigned percentage (0.123 -> "12%"); "-" for a missing value."""
    return "-" if v is None else f"{100 * v:.{digits}f}%"


def times(v: float | None, digits: int = 1) -> str:
    """A ratio as a factor ("x2.5"); "-" for a missing value."""
    return "-" if v is None else f"x{v:.{digits}f}"


def p_value(p: float) -> str:
    """A p-value: three significant digits, scientific below 1e-3, n/a when undefined."""
    return "n/a" if math.isnan(p) else f"{p:.1e}" if p < 1e-3 else f"{p:.3g}"


# ---------------------------------------------------------------------------------------------------------------
# Seed summaries (a `stats.summarize` row: n, n_ok, n_diverged, n_failed, mean_ok, std_ok)


def mean_std(mean: float, std: float, n: int, fmt: str = "md") -> str:
    """mean ± sample std (3 and 2 significant digits); the mean alone for one seed; n/a for none."""
    if n == 0 or math.isnan(mean):
        return "n/a"
    return num(mean, 3) if n == 1 or math.isnan(std) else f"{num(mean, 3)}{PM[fmt]}{num(std, 2)}"


def seed_cell(r) -> str:
    """The cell of every run-style table: "failed", "mean ± std", "mean ± std (n=k)" when only k of the cell's
    seeds finished, or "inf (k ok: mean ± std)" when a seed diverged (inf is the cell's value in every ranking and
    test; the survivors' mean is shown with the count it stands on, never alone)."""
    if r.n_ok + r.n_diverged == 0:
        return "failed" if r.n_failed else "n/a"
    ok = mean_std(r.mean_ok, r.std_ok, r.n_ok)
    if r.n_diverged:
        return f"inf ({int(r.n_ok)} ok: {ok})" if r.n_ok else "inf"
    return ok if r.n_ok == r.n else f"{ok} (n={int(r.n_ok)})"


# ---------------------------------------------------------------------------------------------------------------
# Tables


@dataclass(frozen=True)
class Column:
    """One column of a table built from rows (dicts): its heading, the row field it shows (or a function of the
    row), and how a value becomes text. `optional`: left out when no row has the field."""

    heading: str
    field: str | Callable[[dict], object]
    format: Callable[[object], str] = str
    optional: bool = False

    def value(self, row: dict) -> object:
        return self.field(row) if callable(self.field) else row.get(self.field)

    def present(self, rows: list[dict]) -> bool:
        return not self.optional or callable(self.field) or any(self.field in r for r in rows)


def frame(rows: Iterable[dict], columns: list[Column]) -> pd.DataFrame:
    """The rows as a DataFrame of text, one column per spec (optional columns no row has left out)."""
    rows = list(rows)
    cols = [c for c in columns if c.present(rows)]
    return pd.DataFrame([[c.format(c.value(r)) for c in cols] for r in rows], columns=[c.heading for c in cols])


def table(rows: Iterable[dict], columns: list[Column]) -> str:
    """The rows as a Markdown pipe table, one column per spec."""
    return markdown(frame(rows, columns))


def csv(table: pd.DataFrame) -> str:
    """A DataFrame as CSV text (no index), every float at CSV_DIGITS significant digits, in float and mixed
    columns alike (inf and NaN as pandas writes them: "inf", empty)."""
    rounded = lambda v: float(f"{v:.{CSV_DIGITS}g}") if isinstance(v, float) and math.isfinite(v) else v
    mixed = {c: table[c].map(rounded) for c in table.columns if table[c].dtype == object}
    return table.assign(**mixed).to_csv(index=False, float_format=f"%.{CSV_DIGITS}g")


def markdown(table: pd.DataFrame) -> str:
    """A DataFrame as a Markdown pipe table, columns padded to their widest cell (no extra dependency)."""
    cols = [str(c) for c in table.columns]
    cells = [[str(v) for v in row] for row in table.itertuples(index=False)]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"
    return "\n".join([line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in cells])
