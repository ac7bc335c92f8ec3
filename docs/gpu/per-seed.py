"""Every seed's numbers of a results folder as one small CSV: `python docs/gpu/per-seed.py RESULTS OUT.csv`.

One row per (record, seed), from `qlbench.records.results.load` (the loader every table of `qlbench report` is computed
from): arch, budget, function, method, seed, the cell's and the seed's status, the epoch it diverged at, the three
test and train metrics of the paper's tables, the stage's wall time and members, the config hash and the record's
commit. `make gpu-check`'s part paper-table brings this file back from the GPU machine, where the records themselves
(each seed's curves and gradient norms at every evaluation: 515 kB a seed at the paper budget, about 71 MB gzipped
for the deep-narrow table) do not fit what a call can bring back; with the report's tables, it is what a reviewer
quotes and what the statistics need."""

from __future__ import annotations

import sys
from pathlib import Path

COLUMNS = [
    "arch",
    "budget",
    "function",
    "method",
    "seed",
    "cell_status",
    "status",
    "diverged_epoch",
    "best_train_mse",
    "best_test_mse",
    "test_at_best_train",
    "source_test_mse",
    "wall_time_s",
    "stacked_members",
    "config_hash",
    "commit",
    "dirty",
]


def main(folder: Path, out: Path) -> int:
    from qlbench.records import results, store  # here: the script's usage line works without the package on the path

    frame = results.load(folder, on_damaged=lambda message: print(message, file=sys.stderr))
    if frame.empty:
        print(f"no records under {folder}", file=sys.stderr)
        return 1
    frame = frame.reindex(columns=COLUMNS).sort_values(["arch", "budget", "function", "method", "seed"])
    store.write_text(frame.to_csv(index=False), out)  # atomic, as every file qlbench writes
    print(f"{out}: {len(frame)} rows, {frame[['function', 'method']].drop_duplicates().shape[0]} cells")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__.splitlines()[0], file=sys.stderr)
        sys.exit(2)
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
