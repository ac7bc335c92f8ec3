"""One record as it is written: what the run was (run_info: its config, seeds, device and every setting that can
change a number, with the git commit and library versions), what its training gave (train_info) and where it ran
(meta_info). The layout is records/results.py's; `results` reads records back.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.metadata
import os
import platform
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import qlbench
from qlbench.records.store import finite, stable_hash

SCHEMA = 1


def git_info() -> dict:
    """Commit and dirty flag of the qlbench checkout this code runs from (None outside a git checkout)."""
    root = Path(qlbench.__file__).resolve().parent.parent
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=10, check=True)
        commit = run("rev-parse", "HEAD").stdout.strip()
        dirty = bool(run("status", "--porcelain", "--untracked-files=no").stdout.strip())
        return {"commit": commit, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


VERSIONED = ("qlbench", "torch", "numpy", "scipy", "pandas", "peft", "transformers")  # libraries that make numbers


def library_versions() -> dict:
    """Python's and each VERSIONED library's installed version (None where it is not installed)."""
    out = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def settings(*, device, compile: bool, dtype: str, **chosen) -> dict:
    """Every setting that can change a record's numbers, at default values too: the caller's `chosen` ones (the
    optimiser's eps, the backbone init, the label noise ...), the device, compile, dtype, intra-op threads (a
    reduction's order) and the library versions. Not hashed: the config hash keeps its keys, so every record
    written before this field existed keeps a valid hash (run_info.settings is optional in schema.py)."""
    return chosen | {
        "device": str(device),
        "compile": bool(compile),
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "versions": library_versions(),
        "environment": environment(),
    }


def environment() -> dict:
    """What a machine's floating-point paths depend on, beyond the library versions: torch's build (its git commit,
    CUDA version, debug flag), the CPU's vector capability as torch dispatches on it, the BLAS torch was built with,
    the machine, the CPU model (Linux) and the intra-op threads."""
    blas = re.search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show())
    model = None
    with contextlib.suppress(OSError):
        model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), None)
    return {
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "cuda": torch.version.cuda,
        "debug": bool(torch.version.debug),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "blas": blas.group(1) if blas else None,
        "machine": platform.machine(),
        "cpu_model": model,
        "threads": torch.get_num_threads(),
    }


def card_changes(recorded, now: dict[str, str]) -> str:
    """Which cards a file's recorded versions (`recorded`, {name: digest}; None for a file written before files held
    them) say differ from `now`, as a phrase ("card ackley", "cards ackley, suite zoo-4"); "" when none do."""
    if not isinstance(recorded, dict):
        return ""
    changed = sorted(n for n in now if n in recorded and recorded[n] != now[n])
    changed += sorted(n for n in recorded if n not in now)
    return f"card{'s' if len(changed) > 1 else ''} {', '.join(changed)}" if changed else ""


def meta_info(device: torch.device) -> dict:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        # None where this process has no CUDA (a Ray driver recording a failed GPU task)
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" and torch.cuda.is_available() else None,
        "threads": torch.get_num_threads(),
    }


@dataclass(frozen=True)
class RunInfo:
    """What a record says about how it was made (its run_info): the cell's config, seeds, device, whether the step
    was compiled, and `chosen`, the run's settings beyond its config and device (eps, backbone init, noise, ...),
    recorded with the rest in run_info.settings (`settings`)."""

    config: dict
    seeds: list[int]
    device: torch.device
    compile: bool = False
    chosen: dict | None = None


@dataclass(frozen=True)
class TrainInfo:
    """What a record says about its training (its train_info). `resumed_epoch`: the epoch of the snapshot its
    training went on from after a stopped run (engine/snapshot.py; train_info.resumed_from_epoch)."""

    status: str
    message: str = ""
    wall_time_s: float = 0.0
    stacked_members: int = 0
    trainable_params: int | None = None
    total_params: int | None = None
    eval_epochs: list[int] | None = None
    grad_epochs: list[int] | None = None
    per_seed: list[dict] | None = None
    cost: dict | None = None
    resumed_epoch: int | None = None


def make_record(run: RunInfo, train: TrainInfo) -> dict:
    """A record of one cell or suite row, its per-seed floats made JSON-safe (`finite`)."""
    per_seed = [{k: (finite(v) if isinstance(v, float) else v) for k, v in s.items()} for s in train.per_seed or []]
    for s in per_seed:
        for k in ("train_curve", "test_curve", "grad_shared_norm"):
            if k in s:
                s[k] = [finite(float(v)) for v in s[k]]
        if "grad_layer_norms" in s:
            s["grad_layer_norms"] = [[finite(float(v)) for v in row] for row in s["grad_layer_norms"]]
    config, device = run.config, run.device
    return {
        "schema": SCHEMA,
        "run_info": {
            "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "qlbench_version": qlbench.__version__,
            "git": git_info(),
            "config": config,
            "config_hash": stable_hash(config),
            "budget": config["budget"]["name"],
            "device": str(device),
            "compile": run.compile,
            "dtype": config["dtype"],
            "seeds": run.seeds,
            "settings": settings(device=device, compile=run.compile, dtype=config["dtype"], **(run.chosen or {})),
        },
        "train_info": {
            "status": train.status,
            "message": train.message,
            "wall_time_s": train.wall_time_s,
            "stacked_members": train.stacked_members,
            "trainable_params": train.trainable_params,
            "total_params": train.total_params,
            "eval_epochs": train.eval_epochs or [],
            **({"grad_epochs": train.grad_epochs} if train.grad_epochs else {}),
            **({"cost": train.cost} if train.cost else {}),
            **({"resumed_from_epoch": train.resumed_epoch} if train.resumed_epoch is not None else {}),
            "per_seed": per_seed,
        },
        "meta_info": meta_info(device),
    }


def gradient_fields(curves, i: int) -> dict:
    """Member i's gradient diagnostics from `engine.Curves` as per-seed record fields (none when not recorded)."""
    out = {}
    if curves.grad_layers is not None:
        out["grad_layer_norms"] = curves.grad_layers[i].tolist()  # [epoch][layer]
    if curves.grad_shared is not None:
        out["grad_shared_norm"] = curves.grad_shared[i].tolist()  # [epoch]
    return out
