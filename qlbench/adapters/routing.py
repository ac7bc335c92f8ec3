"""The Queryable LoRA router as pure functions (paper Section 3, Algorithm 2, appendix eqs. app_prequery to
app_active_router).

The adapter module (queryable.py), the theory checks (qlbench/theory/, tests/properties) and `qlbench verify`
all call these same functions, so a theorem checked here is checked on the code that trains.

Shapes: parameters carry the member dimension E first; activations are (E, N, ...) with N samples (sequences).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Devices where route() stores S samples-last, (E, r, r, N) in memory. On the CPU the layers' products S s run as
# element-wise products and sums over N-long rows, about 5x faster than over r-long ones (docs/speed.md). Elsewhere
# (CUDA, and the meta device that counts CUDA's kernels) S is stored (E, N, r, r): a layer's S s is then one batched
# matmul, and so are its gradients' products, where the element-wise form launches a copy, products and sums; a
# deep-narrow Queryable LoRA step launches 7 fewer kernels per layer (qlbench.bench.dispatch; docs/speed.md). The
# values are the same sums; the bits may differ (a matmul adds in its own order), so the CPU keeps its layout and
# its numbers. tests/test_queryable.py runs both layouts on the CPU and compares them.
SAMPLES_LAST = ("cpu",)


def samples_last(t: torch.Tensor) -> bool:
    """Whether route() stores S samples-last on `t`'s device (SAMPLES_LAST), and the eager layer reads it so."""
    return ("cpu" if t.is_cpu else t.device.type) in SAMPLES_LAST  # is_cpu: no device object built


def rmsnorm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension; no learnable scale (paper Assumption 3)."""
    return F.rms_norm(x, x.shape[-1:], eps=eps)  # one fused kernel for x * rsqrt(mean(x^2) + eps)


def scaled_similarity(a: torch.Tensor, b: torch.Tensor, temperature: float, eps: float) -> torch.Tensor:
    """<RMSNorm(a_i), RMSNorm(b_j)> / (sqrt(d_k) T): a (E, N, d_k), b (E, M, d_k) -> (E, N, M)."""
    d_k = a.shape[-1]
    return rmsnorm(a, eps) @ rmsnorm(b, eps).transpose(-1, -2) / (math.sqrt(d_k) * temperature)


def topk_softmax(logits: torch.Tensor, k: int | tuple[int, ...]) -> torch.Tensor:
    """Softmax over the k largest logits, zero elsewhere: (E, ..., M) -> (E, ..., M) with exactly k non-zeros.

    `k` per member (a tuple of E, a stacked Pareto grid's points that differ in k alone:
    qlbench/experiments/pareto_stack.py): the members of each k are routed apart and put back in place. Every op is per
    row, so member e's weights and gradients are the bits it gets with its k alone (tests/test_pareto_stack.py)."""
    if not isinstance(k, int):
        if len(k) != logits.shape[0]:
            raise ValueError(f"one k per member: {len(k)} for {logits.shape[0]} members")
        if len(set(k)) > 1:
            out = torch.zeros_like(logits)
            for kk in sorted(set(k)):
                rows = _rows(tuple(k), kk, logits.device)
                out = out.index_copy(0, rows, topk_softmax(logits.index_select(0, rows), kk))
            return out
        k = k[0]
    top, idx = logits.topk(k, dim=-1)
    return torch.zeros_like(logits).scatter(-1, idx, top.softmax(dim=-1))


@functools.lru_cache(maxsize=64)
def _rows(ks: tuple[int, ...], k: int, device: torch.device) -> torch.Tensor:
    """The members whose k is `k`, as an index tensor on `device`; made once (at a step's first, ordinary call), so
    a step recorded in a CUDA graph copies nothing from the host."""
    return torch.tensor([e for e, v in enumerate(ks) if v == k], device=device)


def depth_summary(
    q0: torch.Tensor, summaries: torch.Tensor, Q_dep_q: torch.Tensor, Q_dep_k: torch.Tensor, t_dep: float, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over completed blocks: u = sum_i beta_i sbar_i.

    q0 (E, N, d_k) pre-query; summaries (E, N, P, r) block means sbar_1..sbar_P (P = b - 1 >= 1);
    Q_dep_q (E, d_k, d_k), Q_dep_k (E, d_k, r). Returns u (E, N, r) and beta (E, N, P).
    """
    E, N, P, r = summaries.shape
    d_k = q0.shape[-1]
    q_hat = rmsnorm(q0 @ Q_dep_q.transpose(1, 2), eps)  # (E, N, d_k)
    kappa = rmsnorm(summaries.reshape(E, N * P, r) @ Q_dep_k.transpose(1, 2), eps).reshape(E, N, P, d_k)
    xi = (kappa @ q_hat.unsqueeze(-1)).squeeze(-1) / (math.sqrt(d_k) * t_dep)  # (E, N, P)
    beta = xi.softmax(dim=-1)
    u = (beta.unsqueeze(-2) @ summaries).squeeze(-2)  # (E, N, r)
    return u, beta


@dataclass
class Route:
    """Everything one block's router computed, kept for inspection (tests, verify, notebooks)."""

    q0: torch.Tensor  # (E, N, d_k) pre-query
    u: torch.Tensor | None  # (E, N, r) depth summary (None for the first block: u = 0)
    beta: torch.Tensor | None  # (E, N, b-1) depth attention weights
    q: torch.Tensor  # (E, N, d_k) final query
    zeta: torch.Tensor  # (E, N, M) state logits
    rho: torch.Tensor | None  # (E, 1, M) language-prior logits, (E, N, M) per-sample instructions; None: tau_lang 0
    logits: torch.Tensor  # (E, N, M) fused logits zeta + tau_lang log p
    alpha: torch.Tensor  # (E, N, M) routing weights, exactly k non-zeros per row
    S: torch.Tensor  # (E, N, r, r) routed operator sum_m alpha_m C_m


@dataclass(frozen=True)
class Router:
    """One block's router parameters, each (E, ...): w (E, d_k) the block prior; Q_cur, Q_dep (E, d_k, r); Q_dep_q
    (E, d_k, d_k); Q_dep_k (E, d_k, r); keys (E, M, d_k); atoms (E, M, r, r); Q_ctx, R_ctx (E, d_k, d_c) or None
    without instruction channels."""

    w: torch.Tensor
    Q_cur: torch.Tensor
    Q_dep: torch.Tensor | None  # None where no block has an earlier one (B = 1)
    Q_dep_q: torch.Tensor | None  # None where no block has two earlier ones (B <= 2): attention over one is 1
    Q_dep_k: torch.Tensor | None
    keys: torch.Tensor
    atoms: torch.Tensor
    Q_ctx: torch.Tensor | None = None
    R_ctx: torch.Tensor | None = None


@dataclass(frozen=True)
class Temperatures:
    """The router's sizes and scalars: top_k (an int, or one per member), the attention, depth and language
    temperatures, the language prior's weight tau_lang, the context query's weight lambda_ctx and the RMS eps."""

    top_k: int | tuple[int, ...]
    t_attn: float = 1.0
    t_dep: float = 1.0
    t_lang: float = 1.0
    tau_lang: float = 0.0
    lambda_ctx: float = 0.0
    eps: float = 1e-6


def route(
    s_entry: torch.Tensor,
    summaries: torch.Tensor | None,
    router: Router,
    temperatures: Temperatures,
    instruction: torch.Tensor | None = None,
) -> Route:
    """One block's routing (Algorithm 2, lines 5-27).

    s_entry (E, N, r) block-entry rank state; summaries (E, N, b-1, r) or None for the first block; `router` the
    block's parameters (Router: shapes there); instruction (E, d_c) one per member, or (E, N, d_c) one per sample (a
    multi-task batch).
    """
    w, Q_cur, Q_dep, Q_dep_q, Q_dep_k = router.w, router.Q_cur, router.Q_dep, router.Q_dep_q, router.Q_dep_k
    keys, atoms, Q_ctx, R_ctx = router.keys, router.atoms, router.Q_ctx, router.R_ctx
    top_k, t_attn, t_dep, t_lang = temperatures.top_k, temperatures.t_attn, temperatures.t_dep, temperatures.t_lang
    tau_lang, lambda_ctx, eps = temperatures.tau_lang, temperatures.lambda_ctx, temperatures.eps
    E, N, r = s_entry.shape
    q0 = w.unsqueeze(1) + s_entry @ Q_cur.transpose(1, 2)  # (E, N, d_k)
    if instruction is not None and instruction.dim() == 2:
        instruction = instruction.unsqueeze(1)  # (E, 1, d_c): the same for every sample
    if lambda_ctx:
        q0 = q0 + lambda_ctx * (instruction @ Q_ctx.transpose(1, 2))  # + (E, 1 or N, d_k)
    u = beta = None
    q = q0
    if summaries is not None and Q_dep_q is None:  # one earlier block (the peft tuner at B = 2 has no Q_dep_q, Q_dep_k)
        if summaries.shape[2] != 1:
            raise ValueError(
                f"a router without Q_dep_q and Q_dep_k attends over one earlier block, not {summaries.shape[2]}"
            )
        u, beta = summaries[:, :, 0], summaries.new_ones(summaries.shape[:3])  # a softmax over one item is 1
    elif summaries is not None:
        u, beta = depth_summary(q0, summaries, Q_dep_q, Q_dep_k, t_dep, eps)
    if summaries is not None:
        q = q0 + u @ Q_dep.transpose(1, 2)  # (E, N, d_k)
    zeta = scaled_similarity(q, keys, t_attn, eps)  # (E, N, M)
    rho = None
    logits = zeta
    if tau_lang:
        rho = scaled_similarity(instruction @ R_ctx.transpose(1, 2), keys, t_lang, eps)  # (E, 1 or N, M)
        logits = zeta + tau_lang * rho.log_softmax(dim=-1)
    alpha = topk_softmax(logits, top_k)  # (E, N, M)
    if samples_last(alpha):
        # S (E, N, r, r) as a view of samples-last storage (E, r, r, N): the layers' per-sample products S s then
        # run over N-long contiguous rows instead of r-long ones (QueryableLinear.routed_update)
        S = torch.bmm(atoms.flatten(2).transpose(1, 2), alpha.transpose(1, 2)).view(E, r, r, N).permute(0, 3, 1, 2)
    else:  # S (E, N, r, r) contiguous: a layer's S s is one batched matmul over the E N samples
        S = torch.bmm(alpha, atoms.flatten(2)).view(E, N, r, r)
    return Route(q0, u, beta, q, zeta, rho, logits, alpha, S)
