"""The adapter weights a trained cell saves beside its record: what is saved (`trainable_state`), the check that a
finished record's weights are there and intact (`model_intact`, `read_model`), and a cell rebuilt from its record
(`load_adapted`: the pretrained stack from the cache, the method built on it, the saved weights loaded)."""

from __future__ import annotations

from pathlib import Path

import torch

from qlbench import adapters, engine, zoo
from qlbench.backbones import DEFAULT_INIT
from qlbench.records import results
from qlbench.records.store import DamagedFile, Store, load_torch, set_aside
from qlbench.settings import DTYPES


def trainable_state(model: torch.nn.Module, rows: list[int]) -> dict[str, torch.Tensor]:
    """The trainable parameters of the given members (the adapter weights, peft-style; the frozen backbone is in
    the pretraining cache)."""
    return {n: p.detach()[rows].cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def load_adapted(record: Path, *, device: str = "cpu") -> tuple[torch.nn.Module, engine.StackedData, dict]:
    """Rebuild a finished adapter cell from its record: pretrained stack (from the cache, retrained if missing),
    the method built on it, and the saved final adapter weights. Returns (model, target data, record)."""
    rec = results.read_record(record)
    cfg = rec["run_info"]["config"]
    store = Store.of_record(record)
    if rec["train_info"]["status"] == "failed":
        raise ValueError(f"{record} is a failed cell ({rec['train_info']['message']}): nothing to rebuild")
    arch, function, method_name = cfg["arch"], cfg["function"], cfg["method"]
    method = adapters.get(method_name)
    config = method.config_cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg["method_config"].items()})
    b = cfg["budget"]
    pretrain_phase = engine.Phase(**b["pretrain"])
    members = [(function, s) for s in cfg["seeds"]]
    dtype, dev = DTYPES[cfg["dtype"]], engine.resolve_device(device)
    init, noise = cfg.get("backbone_init", DEFAULT_INIT), cfg.get("noise", zoo.LEGACY_NOISE)
    pre = engine.pretrain(engine.Backbones(arch, pretrain_phase, dtype, init, noise), members, device=dev, store=store)
    model, data = engine.build_model(pre, method_name, config, device=dev, dtype=dtype, noise=noise)
    path = Store.model_of(record)
    if not path.exists():
        if aside := sorted(path.parent.glob(f"{path.name}.damaged-*")):  # set aside by an earlier reader
            raise ValueError(f"{path} was damaged and set aside as {aside[-1].name}: `qlbench run` recomputes the cell")
        raise FileNotFoundError(f"no saved weights for {method_name} at {path}")
    try:
        saved = read_model(path, rec, map_location=dev)
        params = dict(model.named_parameters())
        if wrong := [n for n, v in saved["state"].items() if n not in params or params[n].shape != v.shape]:
            raise DamagedFile(f"{path} is damaged ({wrong[0]} is not a weight of this shape in {method_name})")
    except DamagedFile as err:
        raise ValueError(f"{err}; {set_aside(path)}: `qlbench run` recomputes the cell") from None
    with torch.no_grad():
        for name, value in saved["state"].items():
            params[name].copy_(value)
    return model, data, rec


def model_intact(record: Path, rec: dict, log) -> bool:
    """Whether the trained weights saved with a finished record (adapter methods) are there and readable; a damaged
    file is reported and set aside, and the cell counts as unfinished (recomputed)."""
    train, method = rec["train_info"], adapters.get(rec["run_info"]["config"]["method"])
    if not method.trains or train["trainable_params"] >= train["total_params"]:
        return True  # no weights are saved for reference rows and full fine-tuning
    path = Store.model_of(record)
    if not path.exists():
        log(f"{path} is missing; the cell is recomputed")
        return False
    try:
        read_model(path, rec)
    except DamagedFile as err:
        log(f"{err}; {set_aside(path)}, the cell is recomputed")
        return False
    return True


def read_model(path: Path, rec: dict, map_location="cpu") -> dict:
    """The adapter weights saved with a record, checked by content: DamagedFile (one line) unless the file holds
    {config_hash, state} with the record's config hash, and a state of tensors, one row per seed of the record,
    that add up to the record's trainable parameters per seed (a file of another cell or another config, an empty
    dict, a cut or widened tensor)."""
    saved = load_torch(path, map_location=map_location)
    run, train = rec["run_info"], rec["train_info"]
    seeds = len(run["seeds"])

    def damaged(why: str) -> DamagedFile:
        return DamagedFile(f"{path} is damaged ({why})")

    if not isinstance(saved, dict) or not {"config_hash", "state"} <= saved.keys():
        raise damaged("not an adapter file: no config_hash and state")
    if saved["config_hash"] != run["config_hash"]:
        raise damaged(f"it belongs to config {saved['config_hash']}, not to its record's {run['config_hash']}")
    state = saved["state"]
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise damaged("its state is not a non-empty table of tensors")
    if any(v.dim() == 0 or v.shape[0] != seeds for v in state.values()):
        raise damaged(f"a tensor without one row per seed ({seeds})")
    numel = sum(v[0].numel() for v in state.values())
    if numel != train["trainable_params"]:
        raise damaged(f"{numel} weights per seed, not the record's {train['trainable_params']} trainable parameters")
    return saved
