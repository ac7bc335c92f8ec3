"""Instruction-Queryable LoRA: Queryable LoRA with the instruction channels on (the paper's title method).

    tau_lang = lambda_ctx = 1 (docs/methods.md), e(c) = the frozen embedding of the task's instruction sentence

Everything else (atoms, router, adapted layers) is queryable.py's. The instruction of member (function, seed) is
its function card's sentence, so in a sweep every stacked member routes with its own function's instruction.

As in the paper, the router reads the frozen encoder's embedding itself: e(c) = MiniLM(c), d_c = 384 (a unit
vector), through the learned Q_ctx and R_ctx (d_k, 384) of queryable.py (2 x d_k x 384 trainable parameters, which
the table's parameter column shows). `instruction_dim` below 384 is a compressed path kept as an option: e(c)
enters through a frozen, seeded orthonormal projection to that many dimensions, scaled by sqrt(384 / d_c) so that
norms are kept on average (Johnson-Lindenstrauss), e = sqrt(384 / d_c) P MiniLM(c), P (d_c, 384) with orthonormal
rows. It distorts how alike the instructions look (`cosine_distortion`; docs/methods.md). The theory (Lipschitz in
e) is about the router's input, whichever path.

Ablation variants (`qlbench ablate`), all with the same trainable parameters:
    instruction_source  card | generic | shuffled | adversarial | random   (which sentence or vector is e(c))
    query               full | instruction-only                          (instruction-only: q = w_b + Q_ctx e)
and tau_lang / lambda_ctx = 0 for "state only" and "no prior".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qlbench import instructions, zoo
from qlbench.adapters import queryable
from qlbench.adapters.base import AdapterMethod
from qlbench.adapters.queryable import QueryableConfig, QueryableLinear, QueryableMemory
from qlbench.adapters.routing import Route
from qlbench.seeding import generator

NAME = "instruct-queryable"
INSTRUCTION_DIM = instructions.DIM  # d_c, the router's instruction input: the encoder's own embedding
SOURCES = ("card", "generic", "shuffled", "adversarial", "random", "text")
QUERIES = ("full", "instruction-only")


@dataclass
class InstructQueryableConfig(QueryableConfig):
    tau_lang: float = 1.0
    lambda_ctx: float = 1.0
    instruction_dim: int | None = INSTRUCTION_DIM
    instruction_source: str = "card"  # see SOURCES; "text" uses `instruction`
    instruction: str | None = None  # a sentence for every member (`qlbench run --instruction`)
    query: str = "full"  # see QUERIES

    def __post_init__(self):
        if self.instruction is not None:
            if not isinstance(self.instruction, str) or not self.instruction.strip():
                raise ValueError(f"instruction must be a non-empty sentence, got {self.instruction!r}")
            self.instruction_source = "text"
        super().__post_init__()
        if not (isinstance(self.instruction_dim, int) and 1 <= self.instruction_dim <= INSTRUCTION_DIM):
            raise ValueError(
                f"instruction_dim must be an integer from 1 to {INSTRUCTION_DIM} (the encoder's dimension: the "
                f"paper's path; below it a frozen projection compresses e(c)), got {self.instruction_dim!r}"
            )
        if self.instruction_source not in SOURCES:
            raise ValueError(f"instruction_source must be one of {', '.join(SOURCES)}, got {self.instruction_source!r}")
        if self.instruction_source == "text" and self.instruction is None:
            raise ValueError("instruction_source 'text' needs an instruction sentence")
        if self.query not in QUERIES:
            raise ValueError(f"query must be one of {', '.join(QUERIES)}, got {self.query!r}")
        if self.query == "instruction-only" and not self.lambda_ctx:
            raise ValueError("query 'instruction-only' needs lambda_ctx > 0 (the instruction is all the query has)")


class InstructQueryableMemory(QueryableMemory):
    """Queryable LoRA's memory; the instruction-only variant routes from w_b + lambda_ctx Q_ctx e alone."""

    def route(self, block, s_entry, summaries, instruction, task=None) -> Route:
        if self.config.query == "instruction-only":  # no state and no depth term in the query
            s_entry, summaries = torch.zeros_like(s_entry), None
        return super().route(block, s_entry, summaries, instruction, task)


def projection(dim: int, out_dim: int, like: torch.Tensor) -> torch.Tensor:
    """The frozen (out_dim, dim) map sqrt(dim / out_dim) P of the compressed path, P with seeded orthonormal rows."""
    g = generator("instruction-projection", dim, out_dim)
    q = torch.linalg.qr(torch.randn(dim, out_dim, generator=g, dtype=torch.float64)).Q  # (dim, out_dim)
    return (q.T * math.sqrt(dim / out_dim)).to(like)


def router_input(raw: torch.Tensor, instruction_dim: int) -> torch.Tensor:
    """The router's e (E, instruction_dim) from encoder embeddings raw (E, 384): raw itself at the encoder's
    dimension, else its frozen compressed projection."""
    if instruction_dim == raw.shape[1]:
        return raw
    return raw @ projection(raw.shape[1], instruction_dim, raw).T


def cosine(e: torch.Tensor) -> torch.Tensor:
    """(n, n) pairwise cosine similarities of the rows of e (n, d)."""
    u = e / e.norm(dim=1, keepdim=True)
    return u @ u.T


def cosine_distortion(instruction_dim: int, texts: list[str] | None = None) -> dict[str, float]:
    """How the compressed path changes how alike instructions look to the router, on `texts` (default: the nine
    card sentences): the largest absolute change of a pairwise cosine similarity between the encoder's embeddings
    and the router's input, its mean, and the share of pairs whose cosine changes sign."""
    texts = [zoo.card(f).instruction for f in zoo.names()] if texts is None else texts
    raw = instructions.embed(texts).to(torch.float64)  # (n, 384)
    before, after = cosine(raw), cosine(router_input(raw, instruction_dim))  # (n, n)
    pairs = torch.triu_indices(len(texts), len(texts), offset=1)
    a, b = before[pairs[0], pairs[1]], after[pairs[0], pairs[1]]
    return dict(
        max_abs_change=(a - b).abs().max().item(),
        mean_abs_change=(a - b).abs().mean().item(),
        sign_flips=((a > 0) != (b > 0)).double().mean().item(),
    )


def sentences(functions: list[str], config: InstructQueryableConfig) -> list[str | None]:
    """The instruction sentence of each function under the config's source (None: a random vector)."""
    names = zoo.names()
    source = config.instruction_source
    if source == "card":
        return [zoo.card(f).instruction for f in functions]
    if source == "generic":
        return [instructions.GENERIC_INSTRUCTION for _ in functions]
    if source == "shuffled":  # a fixed derangement: the next card in name order
        return [zoo.card(names[(names.index(f) + 1) % len(names)]).instruction for f in functions]
    if source == "adversarial":
        return [zoo.card(f).adversarial_instruction for f in functions]
    if source == "text":
        return [config.instruction for _ in functions]
    return [None for _ in functions]  # random


class InstructQueryable(AdapterMethod):
    def __init__(self):
        super().__init__(
            NAME,
            "Instruction-Queryable LoRA: queryable routing with the task instruction e(c) in the "
            "query and as a tempered prior (tau_lang = lambda_ctx = 1)",
            InstructQueryableConfig,
            QueryableLinear,
            shared_cls=InstructQueryableMemory,
            family=queryable.NAME,
            kind="routed",
        )

    def bind(self, model, members: list[tuple[str, int]], config: InstructQueryableConfig) -> None:
        """Each member routes with its own function's instruction (the memory keeps e, frozen)."""
        model.shared[self.family].bind_instruction(self.instructions(members, config))

    def instructions(self, members: list[tuple[str, int]], config: InstructQueryableConfig) -> torch.Tensor:
        """e (E, instruction_dim) float64 for members (function, seed): each member its function's instruction."""
        functions = [f for f, _ in members]
        texts = sentences(functions, config)
        if config.instruction_source == "random":  # a seeded random vector with the card embedding's norm
            cards = instructions.embed([zoo.card(f).instruction for f in functions]).to(torch.float64)
            raw = torch.stack(
                [
                    torch.randn(cards.shape[1], generator=generator("random-instruction", f), dtype=torch.float64)
                    for f in functions
                ]
            )
            raw = raw / raw.norm(dim=1, keepdim=True) * cards.norm(dim=1, keepdim=True)
        else:
            raw = instructions.embed(texts).to(torch.float64)  # (E, 384)
        return router_input(raw, config.instruction_dim)  # (E, instruction_dim)


METHOD = InstructQueryable()
