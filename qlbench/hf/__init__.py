"""Queryable LoRA as a peft tuner: `peft.get_peft_model(model, QueryableLoraConfig(...))` on a `transformers` model.

    from qlbench.hf import QueryableLoraConfig
    model = peft.get_peft_model(model, QueryableLoraConfig(target_modules=["query", "value"], r=8, n_atoms=16, top_k=4))

Importing this package registers the method with peft (`registry.py`); it needs the `hf` extra
(`pip install qlbench[hf]`: peft and transformers), which the rest of qlbench never imports. The mathematics (the
router of the paper's Algorithm 2) is qlbench's own `qlbench.adapters.routing.route`, called with a stack of one.

- config.py   QueryableLoraConfig (and InstructQueryableLoraConfig, the instruction channels on)
- layer.py    the adapted linear: y = W0 x + b0 + s B (I + g S_b) A x
- model.py    the tuner: blocks in the model's layer order, the forward's hooks (its instruction, mask, KV cache
              and mixed-adapter rows), the adapter lifecycle
- routing.py  each adapter's memory, the routing state one forward shares across its layers, the causal route
              sums a KV cache keeps (RouteSums), the replay of that state in a checkpoint's recomputation
- registry.py peft's registration (and the PeftType member it requires)
"""

from qlbench.hf.config import InstructQueryableLoraConfig, QueryableLoraConfig
from qlbench.hf.model import QueryableLoraModel
from qlbench.hf.registry import register

register(QueryableLoraConfig, QueryableLoraModel)

__all__ = ["InstructQueryableLoraConfig", "QueryableLoraConfig", "QueryableLoraModel", "register"]
