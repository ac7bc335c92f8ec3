"""A causal-LM experiment beside `qlbench real` (`qlbench real-lm`): a tiny decoder adapted through peft to three
generation tasks over the same inputs, which only the task's instruction tells apart.

The model (qlbench's choice; built from a config, nothing downloaded): a 2-layer Llama-style decoder (width 64,
4 heads) over a 35-token vocabulary (PAD, BOS, SEP, EOS, the letters a-h and the 23 words of the instructions, WORDS),
pretrained here, per seed, on the source task: copy five letters (BOS x1..x5 SEP x1..x5 EOS, the loss on the answer).
Then each method adapts it to the three target tasks at once, each sample one (letters, task) pair:
- `reverse` ("Write the letters in reverse order."): x5..x1;
- `shift` ("Replace every letter by the next one in the alphabet, h by a."): x1+1..x5+1;
- `swap` ("Swap the letters in pairs: second first, fourth third, fifth last."): x2 x1 x4 x3 x5.
The input holds the letters only, so a method can tell the tasks apart only through the instruction: the rows that
see none can at best learn one task or a compromise. Rows: `base` (the pretrained decoder, no adaptation; a reference
row), `lora` (peft LoRA, r = 8, alpha 16, on q_proj and v_proj), `lora-matched` (the same LoRA at the rank whose
trainable parameter count is nearest instruct-queryable's, `matched_rank`; alpha 2 r), `lora-prompt` (LoRA as `lora`,
the task's instruction written into its prompt as words), `queryable` and `instruct-queryable` (qlbench.hf, r = 8,
8 atoms, top-2, 2 blocks, causal routing, the same targets; `instruct-queryable` routes on the frozen MiniLM embedding
of the task's instruction, qlbench.instructions.embed). Two rows tell the tasks apart: lora-prompt reads the
instruction's words, instruct-queryable routes on its embedding; base, lora, lora-matched and queryable see the letters
only (lora-matched asks whether instruct-queryable's gain is its parameter budget, lora-prompt whether routing on the
instruction beats the ordinary way of telling a decoder its task). AdamW (lr 3e-3, weight decay 0.01), batch 32, 15
pretraining and 20 adaptation epochs (on one seed at 20 epochs, lr 1e-3 left every method short of the tasks it
could learn: instruct-queryable's shift and swap exact match 0.74 and 0.70 at 1e-3, 0.99 and 0.96 at 3e-3).

Metric: exact match of the greedy answer (generated with the KV cache, so causal routing's cached path is what is
scored) on 100 fresh test inputs per task, per task and its mean; the answer's token cross-entropy beside it.

qlbench interpretation, how lora-prompt's prompt holds the instruction: a word-level vocabulary of the three
instructions (lower-cased, punctuation stripped, split on spaces; the sorted unique words), appended to every decoder's
vocabulary after the letters (so every method's decoder, and its initial weights, is the same); lora-prompt's sequence
is BOS, the instruction's word ids right-padded with PAD to the longest instruction's 13 words, x1..x5, SEP, the
answer (26 tokens); the other rows' stays BOS x1..x5 SEP y1..y5 EOS (13 tokens). Pretraining (copy) uses the plain
layout only, so the instruction's words are new to the decoder when lora-prompt adapts it (never fed to it, their
embeddings stay near their random initial values, and they are frozen, as every base weight is: LoRA on q_proj and
v_proj reads them through the attention). The answer starts ANSWER tokens before a sequence's end in either layout.

qlbench interpretation, how a language model trains through the engine's loop (engine.fit, which minimises a
per-member mean of squared errors): the wrapper `LMStack` returns, per sequence, sqrt(CE + 1e-12) against a target of
0, so the loop's squared error is the sequence's mean answer-token cross-entropy (+1e-12) and its gradient is the
cross-entropy's exactly.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn as nn

from qlbench import engine, instructions, text
from qlbench.adapters.base import check_positive_int
from qlbench.experiments import runner
from qlbench.metrics import stats
from qlbench.records import record, results, store
from qlbench.settings import DEFAULT_EXECUTION, Execution

PAD, BOS, SEP, EOS, FIRST = 0, 1, 2, 3, 4  # FIRST: the letter a; letters a..h are FIRST..FIRST+7
LETTERS, LENGTH = 8, 5
SOURCE = "copy"
TASKS = ("reverse", "shift", "swap")
INSTRUCTIONS = (
    "Write the letters in reverse order.",
    "Replace every letter by the next one in the alphabet, h by a.",
    "Swap the letters in pairs: second first, fourth third, fifth last.",
)
METHODS = ("base", "lora", "lora-matched", "lora-prompt", "queryable", "instruct-queryable")
TARGETS = ["q_proj", "v_proj"]
ANSWER = LENGTH + 1  # y1..y5 EOS: a sequence's last ANSWER tokens, in either layout


def words(instruction: str) -> list[str]:
    """The instruction's words: lower-cased, punctuation stripped, split on spaces."""
    return re.sub(r"[^\w\s]", "", instruction.lower()).split()


WORDS = tuple(sorted({w for s in INSTRUCTIONS for w in words(s)}))  # token FIRST + LETTERS + i: WORDS[i]
SAID = max(len(words(s)) for s in INSTRUCTIONS)  # the instructed prompt's word slots (the longest instruction's)
VOCAB = FIRST + LETTERS + len(WORDS)
POSITIONS = 1 + SAID + LENGTH + 1 + ANSWER  # the instructed layout's length, the longest sequence
CPU = torch.device("cpu")


def answer(task: str, x: np.ndarray) -> np.ndarray:
    """The answer letters (n, 5) of `task` for letters x (n, 5) in 0..7."""
    if task == "copy":
        return x
    if task == "reverse":
        return x[:, ::-1]
    if task == "shift":
        return (x + 1) % LETTERS
    if task == "swap":
        return x[:, [1, 0, 3, 2, 4]]
    raise ValueError(f"unknown task {task!r}; valid: {SOURCE}, {', '.join(TASKS)}")


def instruction_ids(task: str) -> np.ndarray:
    """(SAID,) the word ids of `task`'s instruction, right-padded with PAD (ValueError for the source task: it has
    none)."""
    if task not in TASKS:
        raise ValueError(f"task {task!r} has no instruction; valid: {', '.join(TASKS)}")
    ids = [FIRST + LETTERS + WORDS.index(w) for w in words(INSTRUCTIONS[TASKS.index(task)])]
    return np.array(ids + [PAD] * (SAID - len(ids)))


def sequences(task: str, n: int, seed: int, split: str, instructed: bool = False) -> torch.Tensor:
    """(n, 13) token ids BOS x SEP y EOS for n fresh letter strings, drawn from numpy's generator seeded by (seed,
    split, task); `instructed`: (n, 13 + SAID) BOS, the task's instruction_ids, x SEP y EOS (the same letters: the
    layouts differ in the instruction alone)."""
    key = [SOURCE, *TASKS].index(task)
    rng = np.random.default_rng([seed, {"train": 0, "test": 1}[split], key])
    x = rng.integers(0, LETTERS, (n, LENGTH))
    said = [np.tile(instruction_ids(task), (n, 1))] if instructed else []  # (n, SAID)
    ids = np.concatenate(
        [np.full((n, 1), BOS), *said, x + FIRST, np.full((n, 1), SEP), answer(task, x) + FIRST, np.full((n, 1), EOS)],
        1,
    )
    return torch.from_numpy(ids).long()


@dataclass(frozen=True)
class LMConfig(runner.SeedsConfig):
    """Everything that fixes a record's numbers (its hash names the record's folder)."""

    pretrain_samples: int = 2000
    pretrain_epochs: int = 15
    train_per_task: int = 300
    test_per_task: int = 100
    epochs: int = 20
    batch_size: int = 32
    lr: float = 3e-3
    r: int = 8
    n_atoms: int = 8
    top_k: int = 2
    seeds: tuple[int, ...] = (0, 1, 2)

    def __post_init__(self):
        check_positive_int(self, "pretrain_samples", "pretrain_epochs", "train_per_task", "test_per_task", "epochs",
                           "batch_size", "r", "n_atoms", "top_k")  # fmt: skip
        self.check_seeds()

    def key(self) -> dict:
        """runner.SeedsConfig's key and the decoder's vocabulary size: the vocabulary sets every decoder's initial
        weights, so a record of another vocabulary (the letters-only decoder's 12 tokens) is not resumed here."""
        return super().key() | {"vocab_size": VOCAB}


def decoder(seed: int) -> nn.Module:
    """The tiny Llama-style decoder, initialised from torch's generator seeded by `seed`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    c = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=POSITIONS, bos_token_id=BOS,
                    eos_token_id=EOS, pad_token_id=PAD)  # fmt: skip
    return LlamaForCausalLM(c)


class LMStack(nn.Module):
    """A causal LM as a stack of one member for engine.fit: x (1, n, L) token ids (either layout: the answer is the
    last ANSWER tokens), `instruction` (T, d_c) the tasks' embeddings (None: the model routes on none), task (1, n);
    returns sqrt(answer CE + 1e-12) (1, n) (the module docstring says why)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, instruction=None, task=None) -> torch.Tensor:
        ids = x[0]  # (n, L)
        start = ids.shape[1] - ANSWER  # the prompt's length
        kw = {} if instruction is None else {"instruction": instruction[task[0]]}
        logits = self.model(input_ids=ids, use_cache=False, **kw).logits[:, start - 1 : -1]  # (n, 6, V): answers
        ce = nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, start:], reduction="none").mean(1)  # (n,)
        return (ce + 1e-12).sqrt().unsqueeze(0)


def fit(model: nn.Module, ids: torch.Tensor, task: torch.Tensor, e, phase: engine.Phase, seed: int, progress) -> None:
    """Train `model`'s trainable parameters on the sequences ids (n, L) of tasks `task` (n,) through engine.fit, on
    the device they are on (the data order drawn by a CPU generator seeded by `seed` on any device)."""
    x, y, t = ids.unsqueeze(0), torch.zeros(1, len(ids), device=ids.device), task.unsqueeze(0)
    data = engine.StackedData(x, y, x[:, :1], y[:, :1], t, t[:, :1])  # evaluation: the engine's, on one sample
    optimizer = lambda: torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=phase.lr,
                                          weight_decay=phase.weight_decay)  # fmt: skip
    stage = engine.Stage(data, phase, optimizer, [torch.Generator().manual_seed(seed)], eval_every=phase.epochs)
    engine.fit(LMStack(model), [stage], instruction=e, progress=progress)


def pretrained(config: LMConfig, seed: int, progress, device: torch.device = CPU) -> nn.Module:
    """The decoder of `seed`, pretrained on the source task (every weight trains) on `device` (initialised on the
    CPU, so every device starts from the same weights); trained once per (pretraining settings, seed, device) in a
    process, a fresh copy of it for each method."""
    key = (config.pretrain_samples, config.pretrain_epochs, config.batch_size, seed, device.type)
    if key not in _PRETRAINED:
        model = decoder(seed).to(device).train()
        ids = sequences(SOURCE, config.pretrain_samples, seed, "train").to(device)
        phase = engine.Phase(config.pretrain_epochs, 3e-3, config.batch_size)
        fit(model, ids, torch.zeros(len(ids), dtype=torch.long, device=device), None, phase, seed, progress)
        _PRETRAINED[key] = {k: v.clone() for k, v in model.state_dict().items()}
    elif progress is not None:
        progress(engine.steps(engine.Phase(config.pretrain_epochs, 3e-3, config.batch_size), config.pretrain_samples))
    model = decoder(seed).to(device)
    model.load_state_dict(_PRETRAINED[key])
    return model.train()


_PRETRAINED: dict[tuple, dict[str, torch.Tensor]] = {}  # on the device each was trained on


def lora(r: int):
    """peft LoRA of rank r, alpha 2 r, on TARGETS."""
    import peft

    return peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS, task_type="CAUSAL_LM")


def trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@functools.cache
def matched_rank(config: LMConfig) -> int:
    """lora-matched's rank: the LoRA rank whose trainable parameter count is nearest instruct-queryable's (ties: the
    smaller), both counted on fresh decoders (LoRA's count is linear in r: its count at r = 1 is the per-rank one).
    Torch's CPU generator is left as it was, so a method's adapter initialisation does not move with this count."""
    import peft

    with torch.random.fork_rng(devices=[]):
        target = trainable(adapted("instruct-queryable", decoder(0), config))
        per_rank = trainable(peft.get_peft_model(decoder(0), lora(1)))
    return min(range(1, target // per_rank + 2), key=lambda r: (abs(r * per_rank - target), r))


def adapted(method: str, base: nn.Module, config: LMConfig) -> nn.Module:
    """The method's adapter on `base` (peft; `base`: no adapter, nothing trains; lora-prompt's adapter is lora's, its
    prompt differs)."""
    import peft

    from qlbench.hf import InstructQueryableLoraConfig, QueryableLoraConfig

    if method == "base":
        return base.requires_grad_(False)
    sizes = dict(r=config.r, n_atoms=config.n_atoms, top_k=config.top_k, n_blocks=2, task_type="CAUSAL_LM")
    if method in ("lora", "lora-prompt"):
        c = lora(config.r)
    elif method == "lora-matched":
        c = lora(matched_rank(config))
    elif method == "queryable":
        c = QueryableLoraConfig(target_modules=TARGETS, **sizes)
    elif method == "instruct-queryable":
        c = InstructQueryableLoraConfig(target_modules=TARGETS, **sizes)
    else:
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")
    return peft.get_peft_model(base, c)


@torch.no_grad()
def scores(model: nn.Module, e: torch.Tensor | None, config: LMConfig, seed: int, instructed: bool = False) -> dict:
    """Per task: exact match of the greedy answer (KV cache on) and the answer tokens' cross-entropy; `instructed`:
    the prompts hold the instruction's words (`sequences`)."""
    model.eval()
    out = {}
    device = next(model.parameters()).device
    for k, task in enumerate(TASKS):
        ids = sequences(task, config.test_per_task, seed, "test", instructed=instructed).to(device)  # (n, L)
        kw = {} if e is None else {"instruction": e[k].expand(len(ids), -1)}
        start = ids.shape[1] - ANSWER
        prompt = ids[:, :start]
        gen = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=ANSWER,
                             do_sample=False, pad_token_id=PAD, use_cache=True, **kw)  # fmt: skip
        got = nn.functional.pad(gen[:, start:], (0, ANSWER - (gen.shape[1] - start)), value=PAD)  # stopped at EOS
        exact = (got == ids[:, start:]).all(1).float().mean().item()
        ce = LMStack(model)(ids.unsqueeze(0), e, torch.full((1, len(ids)), k, device=device)).pow(2).mean().item()
        out[task] = {"exact_match": exact, "answer_ce": ce}
    model.train()
    return out


def train_one(
    method: str, config: LMConfig, seed: int, e: torch.Tensor, progress: Callable[[int], None], device=CPU
) -> dict:
    """Pretrain the seed's decoder, adapt it with `method` on the three tasks, score it, all on `device`: its per-seed
    entry."""
    t0 = time.perf_counter()
    model = adapted(method, pretrained(config, seed, progress, device), config)
    routed = e.to(device) if method == "instruct-queryable" else None  # (T, 384): each sample its task's instruction
    instructed = method == "lora-prompt"  # the instruction's words in the prompt
    if method != "base":
        ids = [sequences(t, config.train_per_task, seed, "train", instructed=instructed) for t in TASKS]
        ids = torch.cat(ids).to(device)
        task = torch.arange(len(TASKS), device=device).repeat_interleave(config.train_per_task)
        phase = engine.Phase(config.epochs, config.lr, config.batch_size)
        fit(model, ids, task, routed, phase, seed, progress)
    per_task = scores(model, routed, config, seed, instructed)
    finite = all(np.isfinite(v["answer_ce"]) for v in per_task.values())
    return {
        "seed": seed,
        "status": "ok" if finite else "diverged",
        "exact_match": float(np.mean([v["exact_match"] for v in per_task.values()])),
        "answer_ce": float(np.mean([v["answer_ce"] for v in per_task.values()])),
        "per_task": per_task,
        "trainable_params": trainable(model),
        "wall_time_s": time.perf_counter() - t0,
    }


def steps(config: LMConfig, method: str) -> int:
    """Optimizer steps of one (method, seed), pretraining included, for progress bars."""
    pre = engine.steps(engine.Phase(config.pretrain_epochs, 3e-3, config.batch_size), config.pretrain_samples)
    adapt = engine.steps(engine.Phase(config.epochs, config.lr, config.batch_size), config.train_per_task * len(TASKS))
    return pre + (adapt if method != "base" else 0)


def record_path(out: Path, config: LMConfig, method: str) -> Path:
    return Path(out) / "real-lm" / config.hash() / f"{method}.json"


def check_record(rec, path: Path) -> dict:
    """A record, checked by content: store.DamagedFile (one line) unless it holds its config hash and per-seed
    entries with an integer seed, a status, the per-task scores of every task and a parameter count."""
    entries = rec.get("per_seed") if isinstance(rec, dict) else None
    if not isinstance(rec, dict) or not isinstance(rec.get("config_hash"), str) or not isinstance(entries, list):
        raise store.DamagedFile(f"{path} is damaged (not a real-lm record: no config_hash and per_seed list)")
    for s in entries:
        tasks = s.get("per_task") if isinstance(s, dict) else None
        ok = isinstance(tasks, dict) and all(isinstance(tasks.get(t), dict) for t in TASKS)
        if not ok or not isinstance(s.get("seed"), int) or s.get("status") not in ("ok", "diverged"):
            raise store.DamagedFile(f"{path} is damaged (a per-seed entry without seed, status or every task)")
    return rec


@dataclass
class LMPlan(runner.MethodSeeds):
    """The experiment as a workload of the runner (runner.MethodSeeds): a unit is a method, its record one file under
    the config's hash, finished when it holds every seed of the config; each seed trains on `device`."""

    device: torch.device = CPU

    def record_path(self, method: str) -> Path:
        return record_path(self.out_dir, self.config, method)

    def check_record(self, rec, path: Path) -> dict:
        return check_record(rec, path)

    def prepare(self):
        return instructions.embed(list(INSTRUCTIONS))  # (T, 384), frozen

    def train_seed(self, method: str, seed: int, shared, progress) -> dict:
        return train_one(method, self.config, seed, shared, progress, self.device)

    def settings(self) -> dict:
        return record.settings(device=self.device, compile=False, dtype="float32")


def plan(methods: list[str], config: LMConfig, execution: Execution = DEFAULT_EXECUTION) -> LMPlan:
    """The experiment's workload (ValueError naming the valid methods or a method listed twice): `config` is what
    changes its numbers, `execution` where it runs (its device: auto, cpu or cuda, engine.resolve_device; ValueError
    otherwise) and writes (its out_dir)."""
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; valid: {', '.join(METHODS)}")
    if len(set(methods)) != len(methods):
        raise ValueError(f"method listed twice in {','.join(methods)}")
    return LMPlan(list(methods), config, execution.out_dir, device=engine.resolve_device(execution.device))


def provenance(paths: list[Path]) -> str:
    """The records' commits and tree state (results.provenance)."""
    rows = [{"record": str(p)} | results.git_fields(store.read_json(p).get("git")) for p in paths]
    return results.provenance(pd.DataFrame(rows))


def table(paths: list[Path]) -> tuple[pd.DataFrame, str]:
    """One row per method: exact match per task and its mean (mean ± std over seeds), answer cross-entropy,
    trainable parameters and their ratio to lora's, and the mean exact match paired with LoRA by seed (Holm over the
    table's comparisons); and the legend."""
    recs = {store.read_json(p)["method"]: store.read_json(p) for p in paths}
    seeds = lambda m: {s["seed"]: s for s in recs[m]["per_seed"]}
    count = lambda m: recs[m]["per_seed"][0]["trainable_params"]
    rows, tests = [], {}
    for m in [m for m in METHODS if m in recs]:
        entries = list(seeds(m).values())
        cell = lambda v: text.mean_std(float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else float("nan"),
                                       len(v))  # fmt: skip
        ratio = "-" if m == "base" or "lora" not in recs else f"{count(m) / count('lora'):.2f}"
        row = {"method": m, "trainable": f"{count(m):,}", "× LoRA": ratio}
        row |= {t: cell([s["per_task"][t]["exact_match"] for s in entries]) for t in TASKS}
        row |= {"exact match": cell([s["exact_match"] for s in entries]),
                "answer CE": cell([s["answer_ce"] for s in entries])}  # fmt: skip
        if m not in ("lora", "base") and "lora" in recs:  # base is a reference row: printed, not a hypothesis
            common = sorted(set(seeds(m)) & set(seeds("lora")))
            # higher exact match is better: paired_test's "win" is a lower score, so compare the error rates
            err = lambda who, common=common: [1 - seeds(who)[s]["exact_match"] for s in common]
            tests[m] = stats.paired_test(err(m), err("lora"))
        rows.append(row)
    holm = dict(zip(tests, stats.holm(np.array([t["p"] for t in tests.values()], float)))) if tests else {}
    for row in rows:
        t = tests.get(row["method"])
        outcome = t["outcome"] if t and holm[row["method"]] < stats.ALPHA else "tie"
        row["vs LoRA"] = (
            "-" if t is None else f"{outcome} (p {text.p_value(t['p'])}, Holm {text.p_value(holm[row['method']])})"
        )
    legend = (
        "Exact match of the greedy answer (KV cache on) on 100 fresh inputs per task, mean ± sample std over seeds; "
        "answer CE: the answer tokens' cross-entropy; vs LoRA: the mean exact match paired with LoRA by seed (paired "
        "t-test on the error rates), raw p and Holm-adjusted over the table's comparisons with LoRA; win / loss when "
        "the Holm p < 0.05 with at least 3 pairs; base, a reference row, is outside the Holm family. × LoRA: "
        "trainable parameters over lora's (lora-matched: LoRA at the rank nearest instruct-queryable's count). The "
        "inputs hold the letters only: the tasks differ in the instruction alone, which two rows see: lora-prompt "
        "reads the instruction's words in its prompt, instruct-queryable routes on its MiniLM embedding; base, lora, "
        "lora-matched and queryable see the letters only (qlbench/experiments/real_lm.py)."
    )
    return pd.DataFrame(rows), legend


def markdown(paths: list[Path]) -> str:
    """real-lm.md: the table of the records `paths`, its legend and their provenance (what `qlbench real-lm` writes
    beside the records, and what a committed copy is rebuilt from)."""
    rows, legend = table(paths)
    return (
        f"### A tiny decoder: three instructed generation tasks\n\n{text.markdown(rows)}\n\n{legend}\n\n"
        f"{provenance(paths)}\n"
    )
