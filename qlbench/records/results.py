"""Result records: one JSON file per (function, arch, method) cell, written atomically, and one loader that turns
any set of records into the tidy DataFrame every table, figure and notebook reads.

Record layout (schema 1), in the spirit of huggingface peft's method_comparison:
    run_info:   created_at, qlbench_version, git {commit, dirty}, config (fully resolved), config_hash, budget,
                device, compile, dtype, seeds, settings (every setting that can change a number, defaults
                included: eps, backbone_init, noise, device, compile, dtype, threads, library versions; not hashed)
    train_info: status (ok | diverged | failed), message, wall_time_s, stacked_members, trainable_params,
                total_params, eval_epochs, grad_epochs, per_seed [{seed, status, diverged_epoch, best_train_mse,
                best_train_epoch, best_test_mse (test-selected, as the paper), best_test_epoch,
                test_at_best_train (no peeking), source_train_mse, source_test_mse, train_curve, test_curve,
                grad_layer_norms, grad_shared_norm}]
    meta_info:  python, platform, torch, numpy, cpu, gpu, threads

Optional fields, without a schema change (a record without them stays valid): run_info.config
.backbone_init (only when not "default"; missing = "default"); train_info.grad_epochs and per seed
grad_layer_norms ([epoch][layer]) and grad_shared_norm ([epoch], only for methods with shared parameters): the
gradient diagnostics of qlbench/gradients.py at the evaluated epochs > 0, null after a divergence; per seed
source_test_mse_after: the adapted model's MSE on its source task's test set (how much of the source the adaptation
kept; source_test_mse is the pretrained backbone's), missing (NaN) in records written before it existed;
train_info.cost: what the adapter costs, measured on one member beside its frozen backbone (qlbench/cost.py):
adapter_bytes, peak_train_bytes and memory_method (cuda-allocator | cpu-accounting; null when nothing trains),
latency_s_per_sample {"1": {adapted, frozen}, "256": {adapted, frozen}}; missing in older records (NaN).
"""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd

from qlbench.backbones import DEFAULT_INIT
from qlbench.records import schema
from qlbench.records.record import SCHEMA  # noqa: F401  (results.SCHEMA: the version records are written at)
from qlbench.records.store import DamagedFile, Store, load_torch, read_json

# the MSE columns of the frame (and of the per-seed CSV, per_seed.SCHEMA): floats, inf for a diverged seed's best
MSES = (
    "best_train_mse",
    "best_test_mse",
    "test_at_best_train",
    "source_train_mse",
    "source_test_mse",
    "source_test_mse_after",
    "val_at_best_train",
)

GIT_COLUMNS = ("commit", "dirty")  # the loaders' columns of a record's git info (`git_fields`)


def git_fields(git: dict | None) -> dict:
    """A record's git info (a record's run_info.git, a real-model record's git) as the GIT_COLUMNS: commit (the full
    hash) and dirty; None where the record has none (written before git was recorded, or outside a checkout)."""
    git = git if isinstance(git, dict) else {}
    return {"commit": git.get("commit"), "dirty": git.get("dirty")}


def provenance(frame: pd.DataFrame) -> str:
    """The provenance of one table, from the records it is computed from: "Provenance: every record from commit
    <12 hex digits> (clean tree)." when they are one snapshot; otherwise the commits with their record counts (most
    records first; a record without git info counts as "unknown commit"), the records written from a dirty tree (or
    of no known tree state), and a second paragraph, a warning that the table is not one snapshot.

    `frame`: any loader's frame with the GIT_COLUMNS (a missing column reads as unknown); its rows of one record
    (column `record`, or `path` in `suite_stats.load`) count once, so per-seed rows do not weigh a record by its
    seeds. Markdown; the paragraphs are separated by a blank line."""
    if frame is None or frame.empty:
        return "Provenance: no records."
    key = next((c for c in ("record", "path") if c in frame), None)
    recs = frame.drop_duplicates(subset=key) if key else frame
    column = lambda c: recs[c].tolist() if c in recs else [None] * len(recs)
    commits = [v[:12] if isinstance(v, str) and v else None for v in column("commit")]
    dirty = [None if d is None or (isinstance(d, float) and math.isnan(d)) else bool(d) for d in column("dirty")]
    unknown = "unknown commit"
    counts = Counter(c or unknown for c in commits)
    counts = sorted(counts.items(), key=lambda kv: (kv[0] == unknown, -kv[1], kv[0]))  # most records first
    n_dirty = sum(d is True for d in dirty)
    n_untold = sum(d is None and c is not None for c, d in zip(commits, dirty))  # a commit without a dirty flag
    if len(counts) == 1 and counts[0][0] != unknown and n_dirty == n_untold == 0:
        return f"Provenance: every record from commit {counts[0][0]} (clean tree)."
    count = lambda n: f"{n} record{'s' if n != 1 else ''}"
    if len(counts) == 1:
        line = "every record from " + ("an unknown commit" if counts[0][0] == unknown else f"commit {counts[0][0]}")
    else:
        line = f"{len(counts)} commits ({', '.join(f'{c}: {count(n)}' for c, n in counts)})"
    line += f"; {count(n_dirty)} from a dirty tree" if n_dirty else ""
    line += f"; {count(n_untold)} of an unknown tree state" if n_untold else ""
    why = [f"{len(counts)} commits" if len(counts) > 1 else "", "an unknown commit" if unknown in dict(counts) else ""]
    why += ["a dirty tree" if n_dirty else "", "an unknown tree state" if n_untold else ""]
    return (
        f"Provenance: {line}.\n\n**Warning: not one snapshot** (records from {' and '.join(w for w in why if w)}): "
        "this table's numbers may not all come from one version of the code; rerun its records from one clean commit."
    )


def read_record(path: Path) -> dict:
    """A record; DamagedFile (a one-line ValueError) if the file is empty, truncated, not a record, or a record of
    the current schema whose contents are wrong (`schema.problem`: fields, types, its config hash against its
    config and its file name, a per-seed entry per seed)."""
    rec = read_json(path)
    if not {"run_info", "train_info"} <= rec.keys():
        raise DamagedFile(f"{path} is damaged (a JSON object without run_info and train_info)")
    if rec.get("schema") == SCHEMA:
        named = re.fullmatch(r".+-([0-9a-f]{16})", Path(path).stem)
        if found := schema.problem(rec, named.group(1) if named else None):
            raise DamagedFile(f"{path} is damaged ({found})")
    return rec


def find_records(root: Path) -> list[Path]:
    """The records of a results folder (or, for a folder of loose records, every JSON file below it; a results
    folder's other JSON files, such as suite or real-model records, are not cell records)."""
    store = Store(root)
    return store.records() or ([] if store.is_results_folder() else sorted(Path(root).rglob("*.json")))


PER_SEED_COLUMNS = (
    "status",
    "diverged_epoch",
    "best_train_mse",
    "best_train_epoch",
    "best_test_mse",
    "best_test_epoch",
    "test_at_best_train",
    "source_train_mse",
    "source_test_mse",
    "source_test_mse_after",
    "val_at_best_train",
)


DIVERGED_INF = ("best_train_mse", "best_test_mse", "test_at_best_train")  # inf for a diverged seed in `load`


def _paths(paths_or_root) -> list[Path]:
    if isinstance(paths_or_root, (str, Path)):
        p = Path(paths_or_root)
        return [p] if p.is_file() else find_records(p)
    return [Path(p) for p in paths_or_root]


def _records(paths_or_root, on_damaged) -> list[tuple[Path, dict]]:
    """(path, record) of every readable record of the current schema; a damaged one goes to on_damaged(message)
    (default: a warning) and is skipped, never a traceback."""
    out = []
    for path in _paths(paths_or_root):
        try:
            rec = read_record(path)
        except DamagedFile as err:
            (on_damaged or (lambda m: warnings.warn(m, stacklevel=3)))(f"{err}; skipped")
            continue
        if rec.get("schema") == SCHEMA and "suite" not in rec["run_info"].get("config", {}):  # suites: suite_stats
            out.append((path, rec))
    return out


def _cell(rec: dict) -> dict:
    """The key columns of a record's cell: function, arch, method, budget, backbone_init ("default" for records
    written before backbone inits existed)."""
    cfg, budget = rec["run_info"]["config"], rec["run_info"]["budget"]
    return {
        "function": cfg["function"],
        "arch": cfg["arch"],
        "method": cfg["method"],
        "budget": budget,
        "backbone_init": cfg.get("backbone_init", DEFAULT_INIT),
    }


COST_COLUMNS = (
    "adapter_bytes",
    "peak_train_bytes",
    "latency_b1_s",
    "latency_b256_s",
    "frozen_latency_b1_s",
    "frozen_latency_b256_s",
)


def cost_fields(train_info: dict) -> dict:
    """A record's cost (train_info.cost) as flat columns, NaN where the record has none (older records, failed
    cells, a value not measured)."""
    c = train_info.get("cost") or {}
    lat = c.get("latency_s_per_sample") or {}
    get = lambda b, k: (lat.get(b) or {}).get(k)
    values = (
        c.get("adapter_bytes"),
        c.get("peak_train_bytes"),
        get("1", "adapted"),
        get("256", "adapted"),
        get("1", "frozen"),
        get("256", "frozen"),
    )
    return {k: math.nan if v is None else float(v) for k, v in zip(COST_COLUMNS, values)}


def _adapt_lr(config: dict) -> float:
    """The adaptation learning rate a cell's config holds (NaN where it holds none)."""
    lr = ((config.get("budget") or {}).get("adapt") or {}).get("lr")
    return float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else math.nan


def load(paths_or_root, on_damaged=None) -> pd.DataFrame:
    """Tidy DataFrame, one row per (cell, seed): function, arch, method, budget, seed, cell_status, message,
    trainable_params, wall time and stacked members, the cell's cost (COST_COLUMNS), record, config_hash, its
    adaptation learning rate (lr), the
    record's commit and dirty flag (GIT_COLUMNS, None without git info), and the per-seed metrics. A
    failed cell (no per-seed results) gives one row per seed with status "failed" and no metrics, so it shows in
    every table. Accepts a results folder, one record path, or a list of record paths."""
    rows = []
    for path, rec in _records(paths_or_root, on_damaged):
        run, train = rec["run_info"], rec["train_info"]
        per_seed = train["per_seed"] or [{"seed": s, "status": "failed"} for s in run["seeds"]]
        for s in per_seed:
            rows.append(
                {
                    **_cell(rec),
                    "seed": s["seed"],
                    "cell_status": train["status"],
                    "message": train["message"],
                    "trainable_params": train["trainable_params"],
                    "total_params": train["total_params"],
                    "wall_time_s": train["wall_time_s"],
                    "stacked_members": train.get("stacked_members") or math.nan,
                    **cost_fields(train),
                    "record": str(path),
                    "config_hash": run["config_hash"],
                    "lr": _adapt_lr(run["config"]),
                    **git_fields(run.get("git")),
                    **{k: s.get(k) for k in PER_SEED_COLUMNS},
                }
            )
    frame = pd.DataFrame(rows)
    for col in (*MSES, "lr"):
        if col in frame:
            frame[col] = frame[col].astype(float)
    if "status" in frame:  # a diverged seed's best values are inf, as every table counts them (not its last finite)
        diverged = frame["status"] == "diverged"
        frame.loc[diverged, list(DIVERGED_INF)] = math.inf
    return frame


def load_curves(paths_or_root, on_damaged=None) -> pd.DataFrame:
    """Tidy learning curves, one row per (cell, seed, evaluated epoch): function, arch, method, budget, seed, status,
    epoch, train_mse, test_mse (NaN after a divergence). Accepts what `load` accepts."""
    rows = []
    for _, rec in _records(paths_or_root, on_damaged):
        train = rec["train_info"]
        for s in train["per_seed"]:
            for epoch, tr, te in zip(train["eval_epochs"], s.get("train_curve", []), s.get("test_curve", [])):
                rows.append(
                    {
                        **_cell(rec),
                        "seed": s["seed"],
                        "status": s["status"],
                        "epoch": epoch,
                        "train_mse": tr,
                        "test_mse": te,
                    }
                )
    frame = pd.DataFrame(
        rows,
        columns=[*CELL_COLUMNS, "seed", "status", "epoch", "train_mse", "test_mse"],
    )
    return frame.astype({"train_mse": float, "test_mse": float})


CELL_COLUMNS = ("function", "arch", "method", "budget", "backbone_init")


def load_gradients(paths_or_root, on_damaged=None) -> pd.DataFrame:
    """Tidy gradient diagnostics (qlbench/gradients.py), one row per (cell, seed, recorded epoch, entry): function,
    arch, method, budget, backbone_init, seed, status, epoch, layer (0 .. L-1, or -1 for the shared entry), norm
    (NaN after a divergence). Records without gradient diagnostics (older ones, reference rows) give no rows.
    `gradients_summary` turns it into concentration indices."""
    rows = []
    for _, rec in _records(paths_or_root, on_damaged):
        train = rec["train_info"]
        for s in train["per_seed"]:
            layers, shared = s.get("grad_layer_norms") or [], s.get("grad_shared_norm") or []
            for t, epoch in enumerate(train.get("grad_epochs", [])[: len(layers)]):
                base = {**_cell(rec), "seed": s["seed"], "status": s["status"], "epoch": epoch}
                rows += [base | {"layer": layer, "norm": v} for layer, v in enumerate(layers[t])]
                if t < len(shared):
                    rows.append(base | {"layer": SHARED_LAYER, "norm": shared[t]})
    frame = pd.DataFrame(rows, columns=[*CELL_COLUMNS, "seed", "status", "epoch", "layer", "norm"])
    return frame.astype({"norm": float})


SHARED_LAYER = -1  # the `layer` of the shared-parameter entry in `load_gradients`


def gradients_summary(grads: pd.DataFrame) -> pd.DataFrame:
    """One row per (cell, seed, epoch) of `load_gradients`: concentration (max / mean of the per-layer norms; the
    shared entry is not a layer; NaN when every layer is 0 or a norm is not finite), mean_norm over layers,
    shared_norm (NaN without a shared entry)."""
    keys = [*CELL_COLUMNS, "seed", "epoch"]
    layers = grads[grads["layer"] != SHARED_LAYER]
    by = layers.groupby(keys, sort=False)["norm"]
    out = pd.DataFrame({"max_norm": by.max(skipna=False), "mean_norm": by.mean(skipna=False)}).reset_index()
    out["concentration"] = np.where(out["mean_norm"] > 0, out["max_norm"] / out["mean_norm"], np.nan)
    shared = grads[grads["layer"] == SHARED_LAYER][keys + ["norm"]].rename(columns={"norm": "shared_norm"})
    return out.merge(shared, on=keys, how="left").drop(columns="max_norm")


def _model(record: Path, config_hash: str, on_damaged=None) -> str:
    """Whether the record's adapter weights are saved: "yes", "no" or "damaged" (a file that does not load, or holds
    another config's weights: said through `on_damaged`; `qlbench run` sets it aside and recomputes the cell)."""
    path = Store.model_of(record)
    if not path.exists():
        return "no"
    try:
        saved = load_torch(path)
        if not isinstance(saved, dict) or saved.get("config_hash") != config_hash:
            raise DamagedFile(f"{path} is damaged (not the weights of its record's config)")
    except DamagedFile as err:
        if on_damaged is not None:
            on_damaged(f"{err}; `qlbench run` sets it aside and recomputes the cell")
        return "damaged"
    return "yes"


def index(root, on_damaged=None) -> pd.DataFrame:
    """One row per record of a results folder: arch, function, method, budget, config_hash, status, seeds,
    diverged (count), created_at, has_model ("yes", "no", "damaged": its adapter weights), record. What `qlbench
    results` lists."""
    rows = []
    for path, rec in _records(Store(root).records(), on_damaged):
        run, train = rec["run_info"], rec["train_info"]
        cfg = run["config"]
        rows.append(
            {
                "arch": cfg["arch"],
                "function": cfg["function"],
                "method": cfg["method"],
                "budget": run["budget"],
                "backbone_init": cfg.get("backbone_init", DEFAULT_INIT),
                "config_hash": run["config_hash"],
                "status": train["status"],
                "seeds": len(run["seeds"]),
                "diverged": sum(s.get("status") == "diverged" for s in train["per_seed"]),
                "created_at": run["created_at"],
                "has_model": _model(path, run["config_hash"], on_damaged),
                "record": str(path),
            }
        )
    columns = [
        "arch",
        "function",
        "method",
        "budget",
        "backbone_init",
        "config_hash",
        "status",
        "seeds",
        "diverged",
        "created_at",
        "has_model",
        "record",
    ]
    return pd.DataFrame(rows, columns=columns)


def newest_config(frame: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """One config per (arch, budget, function, method), and per adaptation rate where the frame holds several (a
    learning-rate grid): the newest record's rows, and one note per cell whose older configs are left out (a table
    mixing hyper-parameters would be meaningless, so they are never averaged together). `frame` is `load`'s."""
    keys = ["arch", "budget", "function", "method"] + (["backbone_init"] if "backbone_init" in frame else [])
    if frame.empty:
        return frame, []
    if rated := "lr" in frame and frame["lr"].nunique() > 1:  # a learning-rate grid: one config per rate
        keys.append("lr")
    mtimes = {r: Path(r).stat().st_mtime_ns for r in set(frame["record"])}  # one stat per record, not per seed
    stamps = frame.assign(mtime=frame["record"].map(mtimes))
    newest = stamps.sort_values("mtime").groupby(keys)["record"].last().rename("newest")
    merged = stamps.join(newest, on=keys)
    older = merged[merged["record"] != merged["newest"]]
    name = lambda key: (
        "/".join(key[:4])
        + (f" (backbone init {key[4]})" if key[4:5] not in ((), (DEFAULT_INIT,)) else "")
        + (f" at lr {key[-1]:g}" if rated else "")
    )
    notes = [
        f"{name(key)}: {g['record'].nunique()} older config(s) not shown ({', '.join(sorted(set(g['config_hash'])))})"
        for key, g in older.groupby(keys)
    ]
    kept = merged[merged["record"] == merged["newest"]].drop(columns=["mtime", "newest"])
    return kept.reset_index(drop=True), notes
