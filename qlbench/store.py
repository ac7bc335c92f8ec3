"""The results folder: where every file of a run lives, one stable hash and one atomic writer.

    <root>/records/<arch>/<function>/<method>.json          one record per cell (qlbench.results)
    <root>/models/<arch>/<function>/<method>.pt             the cell's trained adapter weights
    <root>/backbones/<arch>-<function>-seed<s>-<hash>.pt    source-pretrained backbones, one file per member
    <root>/bench/bench.json, bench.md                       `qlbench bench`

Every file is written to a temp file in its folder and renamed into place, so a reader never sees half a file and
an interrupted write leaves the old file (or none) behind. Nothing else in qlbench builds these paths.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def stable_hash(obj) -> str:
    """16 hex digits of sha256 over canonical JSON: the same config gives the same hash in every process."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def finite(x: float | None) -> float | None:
    """JSON has no NaN or inf: non-finite numbers are stored as null."""
    return None if x is None or not math.isfinite(x) else x


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Call write(tmp) on a temp file next to `path`, then rename it into place with the user's umask applied
    (mkstemp creates files 0600). On any error the temp file is removed and `path` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(obj, path: Path) -> None:
    """Atomic JSON (indented, no NaN: use `finite` for floats that may not be)."""

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, allow_nan=False)
            f.write("\n")

    atomic_write(path, write)


def write_text(text: str, path: Path) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def save_torch(obj, path: Path) -> None:
    """Atomic torch.save."""
    import torch

    atomic_write(path, lambda tmp: torch.save(obj, tmp))


class Store:
    """The layout of one results folder."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def record_path(self, arch: str, function: str, method: str) -> Path:
        return self.root / "records" / arch / function / f"{method}.json"

    def model_path(self, arch: str, function: str, method: str) -> Path:
        return self.root / "models" / arch / function / f"{method}.pt"

    @property
    def backbone_dir(self) -> Path:
        return self.root / "backbones"

    def backbone_path(self, arch: str, function: str, seed: int, key: str) -> Path:
        """A pretrained member; `key` is the stable hash of everything its weights depend on."""
        return self.backbone_dir / f"{arch}-{function}-seed{seed}-{key}.pt"

    @property
    def bench_dir(self) -> Path:
        return self.root / "bench"

    def records(self, arch: str = "*", function: str = "*", method: str = "*") -> list[Path]:
        """Record files matching the pattern parts, sorted."""
        return sorted(self.root.glob(f"records/{arch}/{function}/{method}.json"))

    @classmethod
    def of_record(cls, record: Path) -> Store:
        """The store a record file belongs to."""
        record = Path(record)
        if record.parent.parent.parent.name != "records":
            raise ValueError(
                f"{record} is not a record of a results folder (<root>/records/<arch>/<function>/<method>.json)"
            )
        return cls(record.parents[3])

    def cell_of(self, record: Path) -> tuple[str, str, str]:
        """(arch, function, method) of a record path in this store."""
        rel = Path(record).relative_to(self.root / "records")
        return rel.parts[0], rel.parts[1], rel.stem
