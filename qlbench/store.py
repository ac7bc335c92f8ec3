"""The results folder: where every file of a run lives, one stable hash and one atomic writer.

    <root>/records/<arch>/<function>/<method>/<budget>-<config hash>.json   one record per cell and config
    <root>/records/<arch>/<function>/<method>/<budget>-<config hash>.pt     its trained adapter weights
    <root>/suites/<arch>/<suite>/<schedule>/<method>/<budget>-<hash>.json  one record per suite run (multi-task)
    <root>/backbones/<arch>-<function>-seed<s>-<hash>.pt                    source-pretrained backbones
    <root>/bench/bench.json, bench.md                                       `qlbench bench`

A cell's files are keyed by its budget and the hash of its full resolved config, so runs of other budgets or
hyper-parameters live side by side and nothing is overwritten (a finished cell of the same config is skipped, or
re-run with an explicit --force). Every file is written to a temp file in its folder and renamed into place, so a
reader never sees half a file. A damaged file is moved aside (`<name>.damaged-<n>`), never deleted. Nothing else
in qlbench builds these paths.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch


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
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


class DamagedFile(ValueError):
    """A file that exists but cannot be read (truncated, empty, not what it should hold)."""


def set_aside(path: Path) -> Path:
    """Move a damaged file to `<name>.damaged-<n>` next to it (the first free n) and return the new path."""
    path = Path(path)
    n = 1
    while (aside := path.with_name(f"{path.name}.damaged-{n}")).exists():
        n += 1
    os.replace(path, aside)
    return aside


def read_json(path: Path) -> dict:
    """A JSON object from `path`; DamagedFile (one line) if it is empty, truncated or not an object."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DamagedFile(f"{path} is damaged ({err.__class__.__name__}: {err})") from None
    if not isinstance(obj, dict):
        raise DamagedFile(f"{path} is damaged (a JSON {type(obj).__name__}, not an object)")
    return obj


def load_torch(path: Path, map_location="cpu"):
    """torch.load, with DamagedFile (one line) for an empty or truncated file."""
    try:
        return torch.load(path, map_location=map_location)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as err:
        message = str(err).splitlines()[0] if str(err) else ""
        raise DamagedFile(f"{path} is damaged ({err.__class__.__name__}: {message})") from None


class Store:
    """The layout of one results folder."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def cell_stem(self, arch: str, function: str, method: str, budget: str, config_hash: str) -> Path:
        """The path, without suffix, of one cell's record (.json) and model (.pt)."""
        return self.root / "records" / arch / function / method / f"{budget}-{config_hash}"

    def record_path(self, arch: str, function: str, method: str, budget: str, config_hash: str) -> Path:
        return self.cell_stem(arch, function, method, budget, config_hash).with_suffix(".json")

    def suite_record_path(
        self, arch: str, suite: str, schedule: str, method: str, budget: str, config_hash: str
    ) -> Path:
        """One suite run's record: a method on a suite under a schedule (qlbench/multitask.py)."""
        return self.root / "suites" / arch / suite / schedule / method / f"{budget}-{config_hash}.json"

    def suite_records(
        self, arch: str = "*", suite: str = "*", schedule: str = "*", method: str = "*", budget: str = "*"
    ) -> list[Path]:
        """Suite record files matching the pattern parts, sorted."""
        return sorted(self.root.glob(f"suites/{arch}/{suite}/{schedule}/{method}/{budget}-*.json"))

    @staticmethod
    def model_of(record: Path) -> Path:
        """The adapter weights saved with a record."""
        return Path(record).with_suffix(".pt")

    @property
    def backbone_dir(self) -> Path:
        return self.root / "backbones"

    def backbone_path(self, arch: str, function: str, seed: int, key: str) -> Path:
        """A pretrained member; `key` is the stable hash of everything its weights depend on."""
        return self.backbone_dir / f"{arch}-{function}-seed{seed}-{key}.pt"

    @property
    def bench_dir(self) -> Path:
        return self.root / "bench"

    @property
    def real_dir(self) -> Path:
        """`qlbench real`'s records, one folder per configuration (qlbench/real.py)."""
        return self.root / "real"

    def is_results_folder(self) -> bool:
        """Whether the folder holds any part of this layout (records, suites, real-model runs, backbones, bench)."""
        parts = ("records", "suites", self.real_dir.name, self.backbone_dir.name, self.bench_dir.name)
        return any((self.root / part).is_dir() for part in parts)

    def records(self, arch: str = "*", function: str = "*", method: str = "*", budget: str = "*") -> list[Path]:
        """Record files matching the pattern parts, sorted."""
        return sorted(self.root.glob(f"records/{arch}/{function}/{method}/{budget}-*.json"))

    @classmethod
    def of_record(cls, record: Path) -> Store:
        """The store a record file belongs to."""
        record = Path(record)
        if len(record.parents) < 5 or record.parents[3].name != "records":
            raise ValueError(
                f"{record} is not a record of a results folder "
                "(<root>/records/<arch>/<function>/<method>/<budget>-<hash>.json)"
            )
        return cls(record.parents[4])

    def cell_of(self, record: Path) -> tuple[str, str, str, str]:
        """(arch, function, method, budget) of a record path in this store."""
        rel = Path(record).relative_to(self.root / "records")
        return rel.parts[0], rel.parts[1], rel.parts[2], rel.stem.rsplit("-", 1)[0]
