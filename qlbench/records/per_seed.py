"""The per-seed CSV: the compact form of a report's records, one row per (arch, budget, backbone init, function,
method, seed), that a committed report sits beside and is rebuilt from (`qlbench report per-seed.csv.gz`;
docs/results-format.md, "The per-seed CSV")."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import pandas as pd
import pandera.pandas as pa

from qlbench.records import results, schema, store
from qlbench.records.store import DamagedFile

FILE = "per-seed.csv.gz"
COLUMNS = (
    "arch",
    "budget",
    "backbone_init",
    "function",
    "method",
    "seed",
    "status",
    "best_train_mse",
    "best_test_mse",
    "test_at_best_train",
    "best_train_epoch",
    "best_test_epoch",
    "diverged_epoch",
    "source_train_mse",
    "source_test_mse",
    "source_test_mse_after",
    "trainable_params",
    "total_params",
    "cell_status",
    "message",
    "wall_time_s",
    "stacked_members",
    *results.COST_COLUMNS,
    "record",
    "config_hash",
    "commit",
    "dirty",
)  # one row per (arch, budget, backbone init, function, method, seed): everything a single-task table reads
# a validation run's (a learning-rate grid's): written only when some row has a validation score, so the CSVs of runs
# without one stay as they were; read as NaN where a file lacks them
OPTIONAL = ("lr", "val_at_best_train")
_TEXT = {"record": str, "config_hash": str, "commit": str, "message": str, "status": str, "cell_status": str}


def _record_id(path: str) -> str:
    """A record's path from its results folder's `records/` on (the folder itself differs between machines)."""
    parts = Path(path).parts
    return "/".join(parts[parts.index("records") :]) if "records" in parts else Path(path).name


def write(frame: pd.DataFrame, path: Path) -> Path:
    """Write `results.load`'s frame as a per-seed CSV (COLUMNS, gzipped when `path` ends in .gz; atomic, byte-for-byte
    the same for the same frame: rows sorted, no timestamp in the gzip header, floats written to round-trip)."""
    out = frame.assign(record=frame["record"].map(_record_id)) if "record" in frame else frame
    validated = "val_at_best_train" in out and out["val_at_best_train"].notna().any()
    extra = [c for c in OPTIONAL if c in out] if validated else []
    out = out.reindex(columns=list(COLUMNS) + extra)
    out = out.sort_values(["arch", "budget", "backbone_init", "function", "method", "seed"], kind="stable")
    data = out.to_csv(index=False).encode()
    data = gzip.compress(data, mtime=0) if str(path).endswith(".gz") else data  # no name, no time in the header
    store.atomic_write(Path(path), lambda tmp: Path(tmp).write_bytes(data))
    return Path(path)


def is_csv(path: Path) -> bool:
    """Whether `path` names a per-seed CSV (a file ending in .csv or .csv.gz) rather than a results folder."""
    return Path(path).name.endswith((".csv", ".csv.gz"))


MSES = results.MSES
COUNTS = ("best_train_epoch", "best_test_epoch", "diverged_epoch", "trainable_params", "total_params", "wall_time_s")
KEY = ["arch", "budget", "backbone_init", "function", "method", "seed", "lr"]  # one row per key: one config per rate


def _ok_has(metric: str) -> pa.Check:
    return pa.Check(
        lambda d: ~((d["status"] == "ok") & d[metric].isna()), error=f"an ok seed without {metric}", ignore_na=False
    )


# The per-seed format, declared once: what every CSV read is checked against (`load`), row by row.
SCHEMA = pa.DataFrameSchema(
    {
        **{c: pa.Column(str, nullable=False) for c in ("arch", "budget", "backbone_init", "function", "method")},
        "seed": pa.Column(int, pa.Check.ge(0), coerce=True),
        "status": pa.Column(str, pa.Check.isin([*schema.SEED_STATUSES, "failed"])),
        "cell_status": pa.Column(str, pa.Check.isin(["ok", "diverged", "failed"]), nullable=True),
        **{c: pa.Column(float, pa.Check.ge(0), nullable=True, coerce=True) for c in (*MSES, *COUNTS)},
        **{c: pa.Column(float, pa.Check.ge(0), nullable=True, coerce=True) for c in results.COST_COLUMNS},
        "stacked_members": pa.Column(float, pa.Check.ge(1), nullable=True, coerce=True),
        "lr": pa.Column(float, pa.Check.gt(0), nullable=True, coerce=True),
    },
    checks=[_ok_has(m) for m in ("best_train_mse", "best_test_mse", "test_at_best_train")],
    unique=KEY,
)


def check(frame: pd.DataFrame, where: str) -> None:
    """`frame` checked against SCHEMA (on a coerced copy); DamagedFile naming `where`, the first failing row (as the
    file's line: the header is line 1) and column, and what is wrong."""
    try:
        SCHEMA.validate(frame, lazy=True)
    except pa.errors.SchemaErrors as err:
        first = err.failure_cases.sort_values("index", kind="stable", na_position="last").iloc[0]
        row = "" if pd.isna(first["index"]) else f" line {int(first['index']) + 2}"
        frame_check = first["schema_context"] == "DataFrameSchema"
        what = first["check"] if frame_check else f"column {first['column']}: {first['check']}"
        if first["check"] == "multiple_fields_uniqueness":
            what = f"a second row of the same {', '.join(KEY[:-1])} (and lr)"
        case = first["failure_case"]
        value = "" if frame_check else f" (value {case!r})" if isinstance(case, str) else f" (value {case})"
        raise DamagedFile(f"{where}{row}: {what}{value}") from None


def load(path: Path) -> pd.DataFrame:
    """A per-seed CSV (`write`) as `results.load`'s frame: what every single-task table and test reads. DamagedFile
    (one line) for a file that does not read as one: not CSV, truncated, without a column a table needs, without
    rows, or a row that breaks SCHEMA (named by its line and column)."""
    try:
        frame = pd.read_csv(path, dtype=_TEXT, keep_default_na=True)
    except (OSError, EOFError, ValueError, pd.errors.ParserError, UnicodeDecodeError) as err:
        reason = str(err).splitlines()[0] if str(err) else repr(err)
        raise DamagedFile(f"per-seed CSV {path} does not read: {reason}") from None
    missing = [c for c in COLUMNS if c not in frame]
    if missing:
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise DamagedFile(f"per-seed CSV {path} lacks column(s) {', '.join(missing[:4])}{more}")
    if frame.empty:
        raise DamagedFile(f"per-seed CSV {path} has no rows")
    for c in OPTIONAL:
        frame[c] = frame[c].astype(float) if c in frame else math.nan
    check(frame, f"per-seed CSV {path}")  # the frame read stays as read: written again, the same bytes
    frame["seed"] = frame["seed"].astype(int)
    frame["message"] = frame["message"].astype(object).where(frame["message"].notna(), None)
    frame["dirty"] = frame["dirty"].map({True: True, False: False, "True": True, "False": False})
    diverged = frame["status"] == "diverged"
    frame.loc[diverged, list(results.DIVERGED_INF)] = math.inf
    return frame
