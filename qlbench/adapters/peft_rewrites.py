"""Functional versions of the few peft layer methods that vmap cannot run, used on the stacked path only.

A `MemberStack` (member.py) runs a tuner's own code under vmap where it can (in one of member.WAYS). Three tuners
block it at one method each; here is that method's math, written without the blocking construct, computing what
peft's method computes. The looped path always runs peft's own method, and `MemberStack.probe` compares the two
(outputs and gradients, with the trainable tensors moved off their start) before the stacked path is used, so a
rewrite that drifts from peft's math leaves its tuner looped instead of training another method.

- frod and shira build their update as a sparse COO tensor, which vmap cannot batch: here it is the dense matrix of
  the same entries (`index_put` with accumulate, as coalescing sums repeated indices).
- vblora reads one of its logits in Python (`if ... .isinf().any()`, a guard against resuming training from a
  top-k-only checkpoint, which qlbench never loads); here the same matrices without that guard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _dense(indices: torch.Tensor, values: torch.Tensor, size) -> torch.Tensor:
    """The dense (rows, cols) matrix of a COO tensor: indices (2, nnz), values (nnz,); repeated indices add up."""
    return values.new_zeros(tuple(int(n) for n in size)).index_put((indices[0], indices[1]), values, accumulate=True)


def shira_delta_weight(layer, adapter: str) -> torch.Tensor:
    """peft's ShiraLayer.get_delta_weight, dense: (out_features, in_features)."""
    values = layer.shira_weight[adapter] * layer.scaling[adapter]  # (nnz,)
    return _dense(layer.shira_indices[adapter], values, (layer.out_features, layer.in_features))


def frod_tensors(layer, adapter: str, *, device: torch.device, dtype: torch.dtype):
    """peft's FrodLayer._get_frod_tensors with S dense: U (out, r), V (in, r), S (r, r), lambda_l (r,)."""
    U = layer.frod_U[adapter].to(device=device, dtype=dtype)
    V = layer.frod_V[adapter].to(device=device, dtype=dtype)
    indices = layer.frod_s_indices[adapter].to(device=device, dtype=torch.long)
    size = layer.frod_s_size[adapter].tolist()  # equal in every member: passed unbatched (MemberStack._shared)
    values = layer.frod_lambda_s_values[adapter].to(device=device, dtype=dtype)
    lambda_l = layer.frod_lambda_l[adapter].to(device=device, dtype=dtype)
    return U, V, _dense(indices, values, size), lambda_l


def frod_activation_mm(layer, z_flat: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """peft's FrodLayer._sparse_activation_mm with S dense (frod_tensors): z_flat (rows, r) -> (rows, r)."""
    return z_flat @ S.t()


def vblora_lora_matrices(layer, adapter: str, cast_to_fp32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """peft's VBLoRALayer._get_lora_matrices without its Python read of the logits: A (r, in), B (out, r)."""
    logits_A, logits_B = layer.vblora_logits_A[adapter], layer.vblora_logits_B[adapter]
    bank, topk = layer.vblora_vector_bank[adapter].to(logits_A.device), layer.topk[adapter]
    if cast_to_fp32:
        logits_A, logits_B, bank = logits_A.float(), logits_B.float(), bank.float()

    def low_rank(logits):  # (..., n_vectors) -> (..., vector_length): a softmax mix of the top-k bank vectors
        top, indices = logits.topk(topk, dim=-1)
        return (F.softmax(top, dim=-1).unsqueeze(-1) * bank[indices]).sum(-2)

    A = low_rank(logits_A).reshape(logits_A.shape[0], -1)  # (r, in_tiles, len) -> (r, in)
    B = low_rank(logits_B).transpose(1, 2).reshape(-1, logits_B.shape[1])  # (out_tiles, r, len) -> (out, r)
    return A, B


def rewrites(kind: str) -> tuple:
    """The member.Rewrite entries for peft tuner `kind` (none for most)."""
    if kind == "shira":
        from peft.tuners.shira.layer import ShiraLayer

        return ((ShiraLayer, "get_delta_weight", shira_delta_weight),)
    if kind == "frod":
        from peft.tuners.frod.layer import FrodLayer

        return (
            (FrodLayer, "_get_frod_tensors", frod_tensors),
            (FrodLayer, "_sparse_activation_mm", frod_activation_mm),
        )
    if kind == "vblora":
        from peft.tuners.vblora.layer import VBLoRALayer

        return ((VBLoRALayer, "_get_lora_matrices", vblora_lora_matrices),)
    return ()
