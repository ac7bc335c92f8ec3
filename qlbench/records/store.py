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

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import math
import os
import pickle
import re
import shutil
import socket
import stat
import tempfile
import zipfile
from collections.abc import Callable, Iterator
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


_WRITER = f"{re.sub(r'[^A-Za-z0-9]', '', socket.gethostname())[:32] or 'host'}-{os.getpid()}"  # in temp names
_TEMP = re.compile(r"\..+\.(?P<host>[A-Za-z0-9]*)-(?P<pid>\d+)\.[^.]+\.tmp")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def clean_temps(root: Path) -> list[Path]:
    """Remove the temporary files that writers killed mid-write (kill -9, a crash) left under `root`, and return
    them: those named by a process of this machine that no longer runs. A live writer's temp file and another
    machine's (a shared folder) are left alone; a folder that does not exist yet has none."""
    host = _WRITER.rsplit("-", 1)[0]
    removed = []
    for tmp in Path(root).rglob(".*.tmp"):
        m = _TEMP.fullmatch(tmp.name)
        if m and m["host"] == host and int(m["pid"]) != os.getpid() and not _alive(int(m["pid"])):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Call write(tmp) on a temp file next to `path`, then rename it into place with the user's umask applied
    (mkstemp creates files 0600). On any error the temp file is removed and `path` is untouched. Only a regular file,
    a symbolic link (itself) or a missing path is replaced: anything else there (a device such as /dev/full, a pipe,
    a socket, a folder) is a ValueError, and nothing is written (`check_replaceable`)."""
    path = Path(path)
    check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{_WRITER}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        if err.filename is None and err.errno is not None:  # a file object's write names no file: name `path`
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_replaceable(path: Path) -> None:
    """ValueError (one line) unless `path` is missing, a regular file or a symbolic link (the rename replaces the
    link itself, never what it points to: a link loop or a link to a device is replaced by the file)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as err:
        raise ValueError(f"cannot write {path}: {err.strerror or err}") from None
    if stat.S_ISLNK(mode):
        return
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file (a device, a pipe or a socket)"
        raise ValueError(f"cannot write {path}: it is {kind}; qlbench writes only over regular files")


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
    """Atomic torch.save. The object is serialised in memory and its bytes written by Python's own file write, so
    that a failed write (a full disk) is the OSError it is: torch's zip writer reports one as a RuntimeError."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(buffer.getbuffer())

    atomic_write(path, write)


MIN_FREE_BYTES = 1 << 20  # an output folder's device must hold at least a record's worth of bytes before any work


def check_writable(folder: Path, what: str = "results folder") -> None:
    """ValueError (one line) unless `folder` is a folder this process can write in, or can be created: every
    existing part of the path a folder, the nearest existing one writable. Creates nothing, so a command refused
    later leaves no folder behind. A path the system cannot look up (a name too long) is refused too."""
    try:
        _check_writable(Path(folder), what)
    except OSError as err:
        raise ValueError(f"cannot use {what} {str(folder)[:80]}: {err.strerror or err}") from None


def _check_writable(folder: Path, what: str) -> None:
    if not str(folder).strip():
        raise ValueError(f"the {what} is empty; give a path")
    if folder.is_symlink() and not folder.exists():
        raise ValueError(f"{what} {folder} is a symbolic link to nothing (broken, or a loop)")
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{what} {folder} is a file, not a folder")
    base = next((a for a in (folder, *folder.absolute().parents) if a.exists()), None)
    if base is None or not base.is_dir():
        raise ValueError(f"cannot create {what} {folder}: {base} is a file, not a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write to {what} {folder}: {base} is not writable")
    try:  # what os.access cannot tell (root on a read-only or virtual file system such as /proc): try it
        if base == folder:
            tempfile.TemporaryFile(dir=folder).close()
        else:
            os.rmdir(tempfile.mkdtemp(dir=base, prefix=".qlbench-probe-"))
    except OSError as err:
        raise ValueError(
            f"cannot {'write to' if base == folder else 'create'} {what} {folder}: {err.strerror or err}"
        ) from None
    free = shutil.disk_usage(base).free
    if free < MIN_FREE_BYTES:
        raise ValueError(f"cannot write to {what} {folder}: its device has {free:,} bytes free (the disk is full)")
    if base == folder:
        # every folder already inside it may receive records, backbones or suite rows: a read-only one would fail
        # only after the training (records/) or the pretraining (backbones/)
        for inner, _, _ in os.walk(folder):
            if not os.access(inner, os.W_OK | os.X_OK):
                raise ValueError(f"cannot write to {what} {folder}: {inner} is not writable")


def _lock(path: Path) -> int | None:
    """An exclusive, non-blocking lock on the hidden file `.<name>.lock` next to `path` (flock): its descriptor, or
    None when another process holds it. Retried when the file was removed between open and lock."""
    lock = path.with_name(f".{path.name}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # its holder released and removed it: take the new one


def _unlock(path: Path, fd: int) -> None:
    path.with_name(f".{path.name}.lock").unlink(missing_ok=True)  # removed while held: no debris, no race
    os.close(fd)


def clean_locks(root: Path) -> list[Path]:
    """Remove the lock files of writers killed while they held them (kill -9 skips `claim`'s clean-up): a lock no
    process holds is taken and released, which removes it (`_lock` checks the file is still the one it locked, so a
    writer that locks it at the same moment keeps a lock of its own). Returns the record paths whose locks went."""
    removed = []
    for lock in Path(root).rglob(".*.json.lock"):
        path = lock.with_name(lock.name[1 : -len(".lock")])
        if (fd := _lock(path)) is not None:
            _unlock(path, fd)
            removed.append(path)
    return removed


@contextlib.contextmanager
def claim(paths: list[Path]) -> Iterator[set[Path]]:
    """Lock each record path for this process while it trains that cell; yields the paths it holds. A path that
    another process holds is left out (that process trains it), so two runs never train the same cell at once. The
    locks are released, and their files removed, on exit (a killed process's lock dies with it). POSIX flock:
    local file systems; on a network file system two machines may not see each other's locks."""
    held = {}
    try:
        for path in dict.fromkeys(Path(p) for p in paths):
            if (fd := _lock(path)) is not None:
                held[path] = fd
        yield set(held)
    finally:
        for path, fd in held.items():
            _unlock(path, fd)


class DamagedFile(ValueError):
    """A file that exists but cannot be read (truncated, empty, not what it should hold)."""


class Unreadable(Exception):
    """A file this process may not read (its mode or owner): not damage, so it is neither set aside nor replaced; the
    command line prints the message as one line and exits 2 (as for inputs.Refused). Not a ValueError, so that no
    handler of bad values in between can take it for one."""

    def __init__(self, path: Path):
        super().__init__(f"cannot read {path}: permission denied (its mode or owner); make it readable or move it away")


def set_aside(path: Path) -> str:
    """Move a damaged file to `<name>.damaged-<n>` next to it (the first free n) and say so ("moved to NAME").
    Safe when several processes set aside the same file at once: the new name is taken by an exclusive hard link,
    so no two take the same n and nothing is overwritten, and a process that finds the file already gone says
    "already set aside by another process"."""
    path = Path(path)
    n = 1
    while True:
        aside = path.with_name(f"{path.name}.damaged-{n}")
        try:
            os.link(path, aside)  # fails if `aside` exists: the name is ours alone
        except FileExistsError:
            n += 1
            continue
        except FileNotFoundError:
            return "already set aside by another process"
        except OSError:  # a file system without hard links: a plain rename (not race-safe)
            if aside.exists():
                n += 1
                continue
            try:
                os.replace(path, aside)
            except FileNotFoundError:
                return "already set aside by another process"
            return f"moved to {aside.name}"
        try:
            os.unlink(path)
        except FileNotFoundError:  # another process linked the same file and removed it first: one copy is enough
            os.unlink(aside)
            return "already set aside by another process"
        return f"moved to {aside.name}"


def _not_a_file(path: Path, err: OSError) -> DamagedFile | None:
    """DamagedFile for what stands where a file should (a folder, a symbolic-link loop), else None."""
    if isinstance(err, IsADirectoryError):
        return DamagedFile(f"{path} is damaged (a folder, not a file)")
    if err.errno == errno.ELOOP:
        return DamagedFile(f"{path} is damaged (a symbolic-link loop, not a file)")
    return None


def read_json(path: Path) -> dict:
    """A JSON object from `path`; DamagedFile (one line) if it is empty, truncated or not an object, or a folder or
    a symbolic-link loop stands in its place; Unreadable (one line) if this process may not read it."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except PermissionError:
        raise Unreadable(path) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DamagedFile(f"{path} is damaged ({err.__class__.__name__}: {err})") from None
    except OSError as err:
        if (damaged := _not_a_file(path, err)) is not None:
            raise damaged from None
        raise
    if not isinstance(obj, dict):
        raise DamagedFile(f"{path} is damaged (a JSON {type(obj).__name__}, not an object)")
    return obj


def load_torch(path: Path, map_location="cpu"):
    """torch.load, with DamagedFile (one line) for an empty, truncated or garbled file: whatever the reader raises
    on bad bytes (a truncated zip gives OSError EINVAL, garbage an unpickling or a lookup error), and for a folder
    or a symbolic-link loop in its place. A missing file, or no memory, is not damage and propagates; an unreadable
    one is Unreadable."""
    try:
        return torch.load(path, map_location=map_location)
    except PermissionError:
        raise Unreadable(path) from None
    except OSError as err:
        if (damaged := _not_a_file(path, err)) is not None:
            raise damaged from None
        if isinstance(err, FileNotFoundError | PermissionError):
            raise
        message = str(err).splitlines()[0] if str(err) else ""
        raise DamagedFile(f"{path} is damaged ({err.__class__.__name__}: {message})") from None
    except (
        RuntimeError,
        EOFError,
        pickle.UnpicklingError,
        zipfile.BadZipFile,
        ValueError,
        LookupError,
        AttributeError,
        TypeError,
    ) as err:
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
        """One suite run's record: a method on a suite under a schedule (qlbench/experiments/multitask.py)."""
        return self.root / "suites" / arch / suite / schedule / method / f"{budget}-{config_hash}.json"

    def suite_records(
        self, arch: str = "*", suite: str = "*", schedule: str = "*", method: str = "*", budget: str = "*"
    ) -> list[Path]:
        """Suite record files matching the pattern parts, sorted."""
        return sorted(self.root.glob(f"suites/{arch}/{suite}/{schedule}/{method}/{budget}-*.json"))

    def snapshot_dir(self, arch: str) -> Path:
        """Where the snapshots of stacks on `arch` live while they train (engine/snapshot.py)."""
        return self.root / "snapshots" / arch

    def snapshot_path(self, arch: str, method: str, budget: str, key: str) -> Path:
        """A stack's snapshot while it trains; `key` is the hash of what its numbers depend on."""
        return self.snapshot_dir(arch) / f"{method}-{budget}-{key}.pt"

    def snapshots(self, arch: str) -> list[Path]:
        """The snapshots in the folder of stacks on `arch` that stopped before their records were written (or that
        another process is training), sorted."""
        return sorted(self.snapshot_dir(arch).glob("*.pt"))

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
        """`qlbench real`'s records, one folder per configuration (qlbench/experiments/real.py)."""
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
