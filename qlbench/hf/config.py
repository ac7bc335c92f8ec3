"""The tuner's configuration: the sizes and temperatures of qlbench's QueryableConfig, with peft's targeting."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from peft.config import PeftConfig

from qlbench import instructions
from qlbench.adapters.base import check_nonnegative, check_positive, check_positive_int
from qlbench.hf.registry import peft_type


@dataclass
class QueryableLoraConfig(PeftConfig):
    """Queryable LoRA on the linear layers named by `target_modules` (nn.Linear, or GPT-2's Conv1D).

    The adapted layers, in the model's layer order (the first integer of each module's path: `layers.3.` is layer 3),
    form `n_blocks` contiguous blocks (qlbench.adapters.queryable.block_of). The first adapted layer that runs in a
    block routes it from its own rank state, averaged over the sequence's tokens (attention_mask respected); every
    adapted layer's averaged state enters its block's summary for the depth attention of later blocks. With `causal`
    (the default for causal language models) the average at token t runs over tokens 0..t only, so each token has
    its own route and no position sees a later one, in training as in generation with a KV cache (docs/hf.md).
    """

    r: int = field(default=8, metadata={"help": "rank of A and B, and size of the r x r atoms"})
    lora_alpha: float = field(default=16.0, metadata={"help": "scale s = lora_alpha / r"})
    target_modules: list[str] | str | None = field(default=None, metadata={"help": "modules to adapt (peft syntax)"})
    exclude_modules: list[str] | str | None = field(default=None, metadata={"help": "modules not to adapt"})
    layers_to_transform: list[int] | int | None = field(default=None, metadata={"help": "layer indices to adapt"})
    layers_pattern: list[str] | str | None = field(default=None, metadata={"help": "the layers' module list name"})
    modules_to_save: list[str] | None = field(default=None, metadata={"help": "other modules trained and saved"})
    n_blocks: int = field(default=4, metadata={"help": "B contiguous blocks of adapted layers"})
    n_atoms: int = field(default=8, metadata={"help": "M shared r x r atoms"})
    top_k: int = field(default=2, metadata={"help": "atoms mixed per block and sample"})
    d_k: int = field(default=16, metadata={"help": "key and query dimension"})
    t_attn: float = field(default=1.0, metadata={"help": "temperature of the state logits"})
    t_dep: float = field(default=1.0, metadata={"help": "temperature of the depth attention"})
    t_lang: float = field(default=1.0, metadata={"help": "temperature of the language-prior logits"})
    tau_lang: float = field(default=0.0, metadata={"help": "strength of the language prior (0: state only)"})
    lambda_ctx: float = field(default=0.0, metadata={"help": "weight of the instruction in the pre-query"})
    instruction_dim: int | None = field(default=None, metadata={"help": "d_c of e(c); None: no instruction channels"})
    atom_std: float = field(default=0.02, metadata={"help": "std of the atoms at initialisation"})
    rms_eps: float = field(default=1e-6, metadata={"help": "RMSNorm epsilon of the router"})
    lora_dropout: float = field(
        default=0.0, metadata={"help": "dropout on the layer's input before A, as LoRA's (the adapter path only)"}
    )
    use_rslora: bool = field(default=False, metadata={"help": "scale s = lora_alpha / sqrt(r), as LoRA's rsLoRA"})
    init_weights: bool = field(
        default=True,
        metadata={"help": "True: B = 0, the base model at the start; False: B drawn too, a non-identity start"},
    )
    causal: bool | None = field(
        default=None,
        metadata={
            "help": "route each token from the tokens up to it (decoder models); False: one route per sequence from "
            "all its tokens; None: True for task_type CAUSAL_LM or a causal-LM base model, set at injection"
        },
    )

    def __post_init__(self):
        super().__post_init__()
        self.peft_type = peft_type()
        check_positive_int(self, "r", "n_blocks", "n_atoms", "d_k")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.n_atoms:
            raise ValueError(f"top_k must be an integer in [1, n_atoms={self.n_atoms}], got {self.top_k!r}")
        check_positive(self, "lora_alpha", "t_attn", "t_dep", "t_lang", "rms_eps")
        check_nonnegative(self, "tau_lang", "lambda_ctx", "atom_std")
        if isinstance(self.lora_dropout, bool) or not isinstance(self.lora_dropout, int | float):
            raise ValueError(f"lora_dropout must be a number in [0, 1), got {self.lora_dropout!r}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout must be a number in [0, 1), got {self.lora_dropout!r}")
        if (self.tau_lang or self.lambda_ctx) and self.instruction_dim is None:
            raise ValueError("tau_lang or lambda_ctx > 0 needs an instruction embedding: set instruction_dim")
        if self.target_modules is None:
            raise ValueError("target_modules is required: the linear layers to adapt, e.g. ['query', 'value']")
        if isinstance(self.target_modules, list):
            self.target_modules = set(self.target_modules)
        if isinstance(self.exclude_modules, list):
            self.exclude_modules = set(self.exclude_modules)

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


@dataclass
class InstructQueryableLoraConfig(QueryableLoraConfig):
    """Instruction-Queryable LoRA (qlbench's `instruct-queryable`): both instruction channels on, e(c) the frozen
    MiniLM embedding of the task's instruction (`qlbench.instructions.embed`), d_c = 384."""

    tau_lang: float = 1.0
    lambda_ctx: float = 1.0
    instruction_dim: int | None = instructions.DIM
