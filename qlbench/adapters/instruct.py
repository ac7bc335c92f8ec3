"""Instruction-Queryable LoRA: Queryable LoRA with the instruction channels on (the paper's title method).

    tau_lang = lambda_ctx = 1 (docs/methods.md), e(c) = the frozen embedding of the task's instruction sentence

Everything else (atoms, router, adapted layers) is queryable.py's. The instruction of member (function, seed) is
its function card's sentence, so in a sweep every stacked member routes with its own function's instruction.

qlbench interpretation: all-MiniLM-L6-v2 gives a 384-d e(c); Q_ctx and R_ctx on 384 dimensions would add 12,288
trainable parameters (1.8x LoRA's on the deep-narrow MLP, against the 10% parameter budget). So e(c) enters the
router through a frozen, seeded orthonormal projection to INSTRUCTION_DIM = 8 dimensions, scaled by sqrt(384 / 8)
so that norms are kept on average (Johnson-Lindenstrauss): the router's instruction input is e = sqrt(384/8) P
MiniLM(c), P (8, 384) with orthonormal rows. The theory (Lipschitz in e) is about that router input.

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
INSTRUCTION_DIM = 8  # the router's instruction input (after the frozen projection)
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
        if self.instruction_dim != INSTRUCTION_DIM:
            raise ValueError(f"instruction_dim is fixed at {INSTRUCTION_DIM} for {NAME} (the frozen projection)")
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

    def route(self, block, s_entry, summaries, instruction) -> Route:
        if self.config.query == "instruction-only":  # no state and no depth term in the query
            s_entry, summaries = torch.zeros_like(s_entry), None
        return super().route(block, s_entry, summaries, instruction)


def projection(dim: int, like: torch.Tensor) -> torch.Tensor:
    """The frozen (INSTRUCTION_DIM, dim) map sqrt(dim / INSTRUCTION_DIM) P, P with seeded orthonormal rows."""
    g = generator("instruction-projection", dim, INSTRUCTION_DIM)
    q = torch.linalg.qr(torch.randn(dim, INSTRUCTION_DIM, generator=g, dtype=torch.float64)).Q  # (dim, 8)
    return (q.T * math.sqrt(dim / INSTRUCTION_DIM)).to(like)


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
        """e (E, INSTRUCTION_DIM) float64 for members (function, seed): each member its function's instruction."""
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
        return raw @ projection(raw.shape[1], raw).T  # (E, INSTRUCTION_DIM)


METHOD = InstructQueryable()
