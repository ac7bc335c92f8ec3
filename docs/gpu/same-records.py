"""Whether two results folders hold the same numbers: `python docs/gpu/same-records.py A B [RTOL]`.

For every cell record in A, the record of the same path in B (config hashes are in the paths; execution choices such
as --methods-at-once are not hashed): the largest relative difference of its per-seed train and test curves, one
line per record, then the largest overall. Exit 0 when every record of A is in B with every curve within RTOL
(default 1e-5, tests/test_cuda.py's CUDA_RTOL), 1 otherwise. `make gpu-check`'s part run-at-once compares the quick
run trained one method at a time with the same run trained with every method at once."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def curves(path: Path) -> list[list[float | None]]:
    rec = json.loads(path.read_text())
    return [s[k] for s in rec["train_info"]["per_seed"] for k in ("train_curve", "test_curve")]


def relative(a: float | None, b: float | None) -> float:
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return 0.0 if (a is None or math.isnan(a)) == (b is None or math.isnan(b)) else math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def main(a: Path, b: Path, rtol: float) -> int:
    worst, bad = 0.0, 0
    for path in sorted((a / "records").rglob("*.json")):
        other = b / path.relative_to(a)
        if not other.exists():
            print(f"{path.relative_to(a)}: not in {b}")
            bad += 1
            continue
        x, y = curves(path), curves(other)
        diff = max((relative(u, v) for cx, cy in zip(x, y) for u, v in zip(cx, cy)), default=0.0)
        if len(x) != len(y) or any(len(cx) != len(cy) for cx, cy in zip(x, y)):
            diff = math.inf
        worst = max(worst, diff)
        bad += diff > rtol
        print(f"{path.relative_to(a)}: largest relative difference {diff:.2e}")
    print(f"largest relative difference {worst:.2e} (rtol {rtol:g}); {bad} record(s) outside it")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__.splitlines()[0])
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) == 4 else 1e-5))
