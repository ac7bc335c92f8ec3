"""Each method's adaptation time in a results folder: `python docs/gpu/stage-times.py RESULTS`.

A cell record's `train_info.wall_time_s` is the wall time of the training stage that trained it (the whole stack: all
the functions and seeds of a sweep's method, one stack on CUDA), so the cells of one stack share it. For every
(arch, budget, method), one line: its stages (distinct wall times), their total in seconds, the members they stacked
and the cells. What a whole-process time of `make gpu-check` leaves out (where its seconds went, method by method):
pretraining, process start and the writing of records are not in it."""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path


def main(folder: Path) -> int:
    stages: dict[tuple[str, str, str], set[tuple[float, int]]] = collections.defaultdict(set)
    cells: collections.Counter = collections.Counter()
    for path in sorted((folder / "records").rglob("*.json")):
        try:
            rec = json.loads(path.read_text())
            info, config = rec["train_info"], rec["run_info"]["config"]
            key = (config["arch"], config["budget"]["name"], config["method"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            print(f"{path}: not read ({type(err).__name__}: {err})")
            continue
        stages[key].add((info["wall_time_s"], info.get("stacked_members", 0)))
        cells[key] += 1
    if not stages:
        print(f"no cell records under {folder / 'records'}")
        return 1
    print(f"{'arch':<12} {'budget':<7} {'method':<20} {'stages':>6} {'total s':>9} {'members':>8} {'cells':>6}")
    for (arch, budget, method), seen in sorted(stages.items()):
        total, members, n = sum(t for t, _ in seen), sum(m for _, m in seen), cells[arch, budget, method]
        print(f"{arch:<12} {budget:<7} {method:<20} {len(seen):>6} {total:>9.1f} {members:>8} {n:>6}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.splitlines()[0])
    sys.exit(main(Path(sys.argv[1])))
