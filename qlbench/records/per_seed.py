"""The per-seed CSV: the compact form of a report's records, one row per (arch, budget, backbone init, function,
method, seed), that a committed report sits beside and is rebuilt from (`qlbench report per-seed.csv.gz`;
docs/results-format.md, "The per-seed CSV")."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import pandas as pd

from qlbench.records import results, store
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


def load(path: Path) -> pd.DataFrame:
    """A per-seed CSV (`write`) as `results.load`'s frame: what every single-task table and test reads. DamagedFile
    (one line) for a file that does not read as one: not CSV, truncated, or without a column a table needs."""
    try:
        frame = pd.read_csv(path, dtype=_TEXT, keep_default_na=True)
    except (OSError, EOFError, ValueError, pd.errors.ParserError, UnicodeDecodeError) as err:
        reason = str(err).splitlines()[0] if str(err) else repr(err)
        raise DamagedFile(f"per-seed CSV {path} does not read: {reason}") from None
    missing = [c for c in COLUMNS if c not in frame]
    if missing:
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise DamagedFile(f"per-seed CSV {path} lacks column(s) {', '.join(missing[:4])}{more}")
    for c in OPTIONAL:
        frame[c] = frame[c].astype(float) if c in frame else math.nan
    frame["message"] = frame["message"].astype(object).where(frame["message"].notna(), None)
    frame["dirty"] = frame["dirty"].map({True: True, False: False, "True": True, "False": False})
    if frame["seed"].isna().any() or frame["status"].isna().any():
        raise DamagedFile(f"per-seed CSV {path} has rows without a seed or status")
    frame["seed"] = frame["seed"].astype(int)
    diverged = frame["status"] == "diverged"
    frame.loc[diverged, list(results.DIVERGED_INF)] = math.inf
    return frame
