"""What a record must hold, checked by content and not only by parsing: the fields and types of a cell record
(experiment.py) and of a suite record (multitask.py), and the facts that tie them together (the config hash is
the hash of the config, every seed run has its per-seed entry, a finished seed has its metrics). `problem(rec)`
names the first thing wrong, or None; `results.read_record` turns it into a DamagedFile, so every reader sets the
record aside (or skips it) instead of trusting it. docs/results-format.md lists the fields.

Spec notation: a field maps to a type check, a nested dict of fields, or (check, "optional") for a field that
older records may lack.
"""

from __future__ import annotations

import math

from qlbench.records.store import stable_hash

STATUSES = ("ok", "diverged", "failed")  # a record's train_info.status
SEED_STATUSES = ("ok", "diverged")  # a per-seed entry's status


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _str(v) -> bool:
    return isinstance(v, str)


def _opt(check):
    return lambda v: v is None or check(v)


def _list(check):
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def _dict(v) -> bool:
    return isinstance(v, dict)


def _one_of(choices):
    return lambda v: v in choices


_NAMES = {_int: "an integer", _num: "a finite number", _str: "a string", _dict: "an object"}

RUN_INFO = {
    "config": _dict,
    "config_hash": _str,
    "budget": _str,
    "device": _str,
    "dtype": _str,
    "seeds": _list(_int),
    "settings": (_dict, "optional"),  # every setting that can change a number (record.settings); newer records
}
CELL_CONFIG = {
    "function": _str,
    "arch": _str,
    "method": _str,
    "method_config": _dict,
    "budget": {"name": _str},
    "seeds": _list(_int),
    "dtype": _str,
}
SUITE_CONFIG = {
    "suite": _str,
    "suite_card": {"tasks": lambda v: isinstance(v, list) and len(v) > 0 and all(_named(t) for t in v)},
    "schedule": lambda v: v in SUITE_STAGES,
    "arch": _str,
    "row": _str,
    "method": _str,
    "budget": {"name": _str},
    "backbone_init": _str,
    "seeds": _list(_int),
}


def _named(task) -> bool:
    return isinstance(task, dict) and isinstance(task.get("name"), str)


# stages a suite record holds, per schedule, for T tasks and the card's sequential `stages` (None: one per task;
# suites.Suite.schedule_stages)
SUITE_STAGES = {"joint": lambda T, n: 1, "sequential": lambda T, n: n or T, "held-out": lambda T, n: 1}


def _count(v) -> bool:
    return _int(v) and v >= 0


def _latencies(v) -> bool:
    """{"1": {"adapted": s, "frozen": s}, "256": ...}: seconds per sample, each a number >= 0 or null."""
    ok = lambda x: x is None or (_num(x) and x >= 0)
    return _dict(v) and all(_dict(b) and all(ok(x) for x in b.values()) for b in v.values())


COST = {  # train_info.cost (qlbench/cost.py); records written before costs were measured have none
    "adapter_bytes": (_opt(_count), "optional"),
    "peak_train_bytes": (_opt(_count), "optional"),
    "memory_method": (_opt(_str), "optional"),
    "latency_s_per_sample": (_latencies, "optional"),
}
_NAMES |= {_count: "a count (an integer >= 0)", _latencies: "seconds per sample by batch"}
TRAIN_INFO = {
    "status": _one_of(STATUSES),
    "message": _str,
    "wall_time_s": _num,
    "trainable_params": _opt(_int),
    "total_params": _opt(_int),
    "resumed_from_epoch": (_int, "optional"),
    "stacked_members": (_opt(_count), "optional"),
    "eval_epochs": (_list(_int), "optional"),
    "cost": (COST, "optional"),
    "per_seed": _list(_dict),
}
CELL_SEED = {
    "seed": _int,
    "status": _one_of(SEED_STATUSES),
    "diverged_epoch": _opt(_int),
    "best_train_mse": _opt(_num),
    "best_train_epoch": _opt(_int),
    "best_test_mse": _opt(_num),
    "best_test_epoch": _opt(_int),
    "test_at_best_train": _opt(_num),
    "backbone_digest": (_str, "optional"),  # instances.digest of the seed's pretrained backbone
    "val_at_best_train": (_opt(_num), "optional"),  # validation MSE at the best-train epoch (a validation run's)
    "source_train_mse": (_opt(_num), "optional"),
    "source_test_mse": (_opt(_num), "optional"),
    "source_test_mse_after": (_opt(_num), "optional"),
    "train_curve": _list(_opt(_num)),
    "test_curve": _list(_opt(_num)),
}
OK_SEED_METRICS = ("best_train_mse", "best_test_mse", "test_at_best_train")  # a seed that did not diverge has them
SUITE_SEED = {
    "seed": _int,
    "status": _one_of(SEED_STATUSES),
    "diverged_stage": _opt(_int),
    "stage_task_mse": _list(_list(_opt(_num))),  # (stages, T)
    "initial_task_mse": _list(_opt(_num)),  # (T,)
    "usage": (_opt(_list(_list(_list(_opt(_num))))), "optional"),  # (stages, T, M): routed rows only
}


def _check(obj: dict, spec: dict, where: str) -> str | None:
    for key, check in spec.items():
        optional = isinstance(check, tuple)
        if optional:
            check = check[0]
        if key not in obj:
            if optional:
                continue
            return f"{where}.{key} is missing"
        value = obj[key]
        if isinstance(check, dict):
            if not isinstance(value, dict):
                return f"{where}.{key} is {type(value).__name__}, not an object"
            if found := _check(value, check, f"{where}.{key}"):
                return found
        elif not check(value):
            what = _NAMES.get(check)
            return f"{where}.{key} = {_short(value)} is not " + (what or "valid")
    return None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _suite_seed_problem(s: dict, config: dict, where: str) -> str | None:
    """A suite seed's matrices against its card and schedule: stage_task_mse (stages, T) with the schedule's stage
    count, initial_task_mse (T,), usage (stages, T, M) when present; a finished seed's final stage all numbers."""
    T = len(config["suite_card"]["tasks"])
    S = SUITE_STAGES[config["schedule"]](T, config["suite_card"].get("stages"))
    R = s["stage_task_mse"]
    if len(R) != S or any(len(row) != T for row in R):
        return f"{where}.stage_task_mse is not {S} stage(s) x {T} task(s)"
    if len(s["initial_task_mse"]) != T:
        return f"{where}.initial_task_mse does not hold {T} task(s)"
    usage = s.get("usage")
    if usage is not None and (len(usage) != S or any(len(u) != T for u in usage)):
        return f"{where}.usage is not {S} stage(s) x {T} task(s)"
    if s["status"] == "ok" and any(v is None for v in R[-1]):
        return f"{where} finished but its last stage has no MSE for every task"
    return None


def problem(rec: dict, expected_hash: str | None = None) -> str | None:
    """The first thing wrong with a record of the current schema, as a phrase, or None. `expected_hash`: the hash
    its file name carries (a record stored under another config's name is wrong)."""
    for part in ("run_info", "train_info"):
        if not isinstance(rec.get(part), dict):
            return f"{part} is missing or not an object"
    run, train = rec["run_info"], rec["train_info"]
    if found := _check(run, RUN_INFO, "run_info"):
        return found
    suite = "suite" in run["config"]
    if found := _check(run["config"], SUITE_CONFIG if suite else CELL_CONFIG, "run_info.config"):
        return found
    if run["config_hash"] != stable_hash(run["config"]):
        return f"run_info.config_hash {_short(run['config_hash'])} is not the hash of its config"
    if expected_hash is not None and run["config_hash"] != expected_hash:
        return f"its config hash {run['config_hash']} is not the {expected_hash} of its file name"
    if run["seeds"] != run["config"]["seeds"]:
        return "run_info.seeds differ from run_info.config.seeds"
    if found := _check(train, TRAIN_INFO, "train_info"):
        return found
    if train["status"] == "failed":
        return None  # a failed cell holds no per-seed results
    seed_spec = SUITE_SEED if suite else CELL_SEED
    for i, s in enumerate(train["per_seed"]):
        if found := _check(s, seed_spec, f"train_info.per_seed[{i}]"):
            return found
        if suite and (found := _suite_seed_problem(s, run["config"], f"train_info.per_seed[{i}]")):
            return found
        if not suite and s["status"] == "ok":
            if missing := [k for k in OK_SEED_METRICS if s[k] is None]:
                return f"train_info.per_seed[{i}] finished but has no {missing[0]}"
    if [s["seed"] for s in train["per_seed"]] != run["seeds"]:
        return "train_info.per_seed does not hold one entry per seed of run_info.seeds"
    diverged = any(s["status"] == "diverged" for s in train["per_seed"])
    if diverged != (train["status"] == "diverged"):
        return f"train_info.status {train['status']!r} disagrees with its seeds' statuses"
    return None
