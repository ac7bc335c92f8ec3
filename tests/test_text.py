"""qlbench.text: exact strings for the seed cell, number formatting at its boundaries, and Markdown tables from
column specs (an optional column that no row has is left out)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pandas as pd
import pytest

from qlbench import text
from qlbench.text import Column


def summary(n: int, ok: int, diverged: int = 0, mean: float = 0.0161, std: float = 8.3e-4) -> SimpleNamespace:
    """A hand-made `stats.summarize` row: n seeds, `ok` finished, `diverged` diverged, the rest failed."""
    failed = n - ok - diverged
    return SimpleNamespace(
        n=n, n_ok=ok, n_diverged=diverged, n_failed=failed, mean_ok=mean if ok else math.nan, std_ok=std
    )


@pytest.mark.parametrize(
    ("row", "cell"),
    [
        (summary(3, 3), "0.0161 ± 8.3e-04"),
        (summary(3, 2, diverged=1), "inf (2 ok: 0.0161 ± 8.3e-04)"),
        (summary(3, 1, diverged=2), "inf (1 ok: 0.0161)"),  # one survivor: its value alone, no std
        (summary(3, 0, diverged=3), "inf"),
        (summary(3, 0), "failed"),
        (summary(5, 4), "0.0161 ± 8.3e-04 (n=4)"),  # a failed seed: the count the mean stands on
        (summary(1, 1, std=math.nan), "0.0161"),
        (summary(0, 0), "n/a"),
    ],
)
def test_seed_cell(row, cell):
    assert text.seed_cell(row) == cell


@pytest.mark.parametrize(
    ("value", "sig", "out"),
    [
        (0.0, 3, "0"),
        (math.inf, 3, "inf"),
        (math.nan, 3, "nan"),
        (0.001, 3, "0.00100"),  # 1e-3: still positional
        (0.000999, 3, "9.99e-04"),  # below 1e-3: scientific
        (-0.0123456, 3, "-0.0123"),
        (1.0, 3, "1.00"),
        (99999.0, 3, "99999"),  # below 1e5: positional, no decimals
        (100000.0, 3, "1.00e+05"),  # 1e5: scientific
        (1234.56, 2, "1235"),  # more digits before the point than asked: none after it
    ],
)
def test_num_boundaries(value, sig, out):
    assert text.num(value, sig) == out


def test_mean_std_and_p_value():
    assert text.mean_std(0.0161, 8.3e-4, 3) == "0.0161 ± 8.3e-04"
    assert text.mean_std(0.0161, 8.3e-4, 3, "latex") == r"0.0161 $\pm$ 8.3e-04"
    assert text.mean_std(math.nan, math.nan, 0) == "n/a"
    assert [text.p_value(p) for p in (math.nan, 0.0004, 0.001, 0.04567)] == ["n/a", "4.0e-04", "0.001", "0.0457"]


def test_number_words():
    assert (text.fixed(12345.678), text.fixed(None)) == ("12,345.7", "-")
    assert (text.pct(12.4), text.pct(-3.0), text.share(0.123), text.times(2.54)) == ("+12%", "-3%", "12%", "x2.5")


def test_table_from_column_specs_drops_an_optional_column_no_row_has():
    rows = [{"E": 1, "speedup": 2.5}, {"E": 16}]
    columns = [
        Column("E", "E"),
        Column("speed-up", "speedup", text.times),  # missing in the second row: "-"
        Column("note", "note", optional=True),  # in no row: left out
        Column("E²", lambda r: r["E"] ** 2),
    ]
    assert text.table(rows, columns).splitlines() == [
        "| E  | speed-up | E²  |",
        "|----|----------|-----|",
        "| 1  | x2.5     | 1   |",
        "| 16 | -        | 256 |",
    ]
    rows[1]["note"] = "compiled"
    assert list(text.frame(rows, columns).columns) == ["E", "speed-up", "note", "E²"]


def test_markdown_pads_every_column_to_its_widest_cell():
    table = pd.DataFrame({"method": ["lora", "queryable"], "n": [5, 3]})
    assert text.markdown(table) == "| method    | n |\n|-----------|---|\n| lora      | 5 |\n| queryable | 3 |"
