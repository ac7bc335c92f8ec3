"""The paper's theory as plain formulas (Section 5 and the appendix "Additional Theoretical Analysis").

Functions of tensors and constants only: norms, the exact Jacobians the stability proofs use, the variational
objectives, and the right-hand side of every norm and Lipschitz statement. tests/properties checks these against
the real router, and `qlbench.theory.checks` (what `qlbench verify` reports) calls the same functions, so a bound
checked in CI is the bound verify reports. All matrix norms are spectral (operator 2-norms), as in the paper.
"""

from __future__ import annotations

import math

import torch


def opnorm(m: torch.Tensor) -> torch.Tensor:
    """Spectral norm over the last two dimensions."""
    return torch.linalg.matrix_norm(m, ord=2)


def vnorm(v: torch.Tensor) -> torch.Tensor:
    """Euclidean norm over the last dimension."""
    return torch.linalg.vector_norm(v, dim=-1)


def rms_eps(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS_eps(x) = sqrt(||x||^2 / d + eps) over the last dimension (paper Assumption 3)."""
    return torch.sqrt(x.pow(2).mean(dim=-1) + eps)


def active_set(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (..., k) of the top-k router's active set I (sorted ascending)."""
    return logits.topk(k, dim=-1).indices.sort(dim=-1).values


def topk_margin(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Gap between the k-th and (k+1)-st largest logit (inf when k = M): Assumption 4's margin."""
    if k == logits.shape[-1]:
        return torch.full(logits.shape[:-1], math.inf, dtype=logits.dtype, device=logits.device)
    top = logits.topk(k + 1, dim=-1).values
    return top[..., k - 1] - top[..., k]


# ---------------------------------------------------------------------------------------------------------------
# Lemmas: the exact Jacobians the stability proofs use


def rmsnorm_jacobian(x: torch.Tensor, eps: float) -> torch.Tensor:
    """lem:app_rmsnorm_jacobian: J(x) = I / r - x x^T / (d r^3), r = RMS_eps(x); x (..., d) -> (..., d, d)."""
    d = x.shape[-1]
    r = rms_eps(x, eps)[..., None, None]
    eye = torch.eye(d, dtype=x.dtype, device=x.device)
    return eye / r - x.unsqueeze(-1) * x.unsqueeze(-2) / (d * r**3)


def softmax_jacobian(alpha: torch.Tensor) -> torch.Tensor:
    """lem:app_softmax_jacobian: J = diag(alpha) - alpha alpha^T; alpha (..., k) -> (..., k, k)."""
    return torch.diag_embed(alpha) - alpha.unsqueeze(-1) * alpha.unsqueeze(-2)


def autograd_jacobian(fn, x: torch.Tensor) -> torch.Tensor:
    """Jacobian of a row-wise map fn: (n, d) -> (n, m) at each row, by autograd: (n, m, d)."""
    return torch.func.vmap(torch.func.jacrev(lambda v: fn(v.unsqueeze(0)).squeeze(0)))(x)


# ---------------------------------------------------------------------------------------------------------------
# Theorem (variational retrieval) and its corollary: objectives on the active-set simplex


def log_tempered_prior(log_p_active: torch.Tensor, tau: float) -> torch.Tensor:
    """log pi^(tau)_I = tau log p_m - log sum_{j in I} p_j^tau, from log p restricted to I (..., k)."""
    t = tau * log_p_active
    return t - t.logsumexp(dim=-1, keepdim=True)


def xlogx(a: torch.Tensor) -> torch.Tensor:
    return torch.special.xlogy(a, a)


def variational_objective(a: torch.Tensor, zeta: torch.Tensor, log_pi: torch.Tensor) -> torch.Tensor:
    """eq:app_variational_router_exact: <a, zeta_I> - KL(a || pi^tau_I) for a in the simplex on I (..., k)."""
    return (a * zeta).sum(-1) - (xlogx(a) - a * log_pi).sum(-1)


def entropy_objective(a: torch.Tensor, zeta: torch.Tensor, log_p: torch.Tensor, tau: float) -> torch.Tensor:
    """eq:app_entropy_router: <a, zeta_I + tau log p_I> + H(a)."""
    return (a * (zeta + tau * log_p)).sum(-1) - xlogx(a).sum(-1)


def state_prior_tradeoff(
    alpha_active: torch.Tensor, zeta_active: torch.Tensor, log_pi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cor:app_state_prior_tradeoff: (max_I zeta - <alpha, zeta_I>, log 1/pi^tau_{I, m*}) with m* = argmax_I zeta."""
    top, star = zeta_active.max(dim=-1)
    gap = top - (alpha_active * zeta_active).sum(-1)
    return gap, -log_pi.gather(-1, star.unsqueeze(-1)).squeeze(-1)


# ---------------------------------------------------------------------------------------------------------------
# Right-hand sides of the norm and Lipschitz statements (plain formulas of the paper, on given constants)


def layer_update_bound(scale: float, B_norm, g, R_C, A_norm):
    """eq:app_update_matrix_norm_bound: (alpha_L / r) ||B|| (1 + |g| R_C) ||A||."""
    return scale * B_norm * (1 + abs(g) * R_C) * A_norm


def query_norm_bound(R_w, Q_cur_norm, R_s, lambda_ctx, Q_ctx_norm, R_e, Q_dep_norm):
    """eq:app_query_norm_bound: R_w + ||Q_cur|| R_s + lambda_ctx ||Q_ctx|| R_e + ||Q_dep|| R_s."""
    return R_w + Q_cur_norm * R_s + lambda_ctx * Q_ctx_norm * R_e + Q_dep_norm * R_s


def summary_lipschitz(n_done, R_s, Q_dep_q_norm, lambda_ctx, Q_ctx_norm, t_dep, rho_min):
    """eq:app_summary_lipschitz: (b-1) R_s ||Q_dep,q|| lambda_ctx ||Q_ctx|| / (2 T_dep rho_min); n_done = b - 1."""
    return n_done * R_s * Q_dep_q_norm * lambda_ctx * Q_ctx_norm / (2 * t_dep * rho_min)


def depth_logit_lipschitz(Q_dep_q_norm, lambda_ctx, Q_ctx_norm, t_dep, rho_min):
    """Proof step of prop:app_summary_lipschitz: every depth logit moves by at most
    |xi_i(e) - xi_i(e')| <= ||Q_dep,q|| lambda_ctx ||Q_ctx|| / (T_dep rho_min) ||e - e'||."""
    return Q_dep_q_norm * lambda_ctx * Q_ctx_norm / (t_dep * rho_min)


def depth_logit_spread(beta1: torch.Tensor, beta2: torch.Tensor) -> torch.Tensor:
    """max_{i,j} |(xi_i - xi_j)(e) - (xi_i - xi_j)(e')| from the depth weights alone (xi = log beta + const):
    at most twice the per-logit bound above."""
    d = beta1.log() - beta2.log()
    return d.amax(-1) - d.amin(-1)


def depth_weight_lipschitz(n_done, Q_dep_q_norm, lambda_ctx, Q_ctx_norm, t_dep, rho_min):
    """eq:app_depth_weight_bound with eq:app_depth_logit_vector_bound:
    ||beta(e) - beta(e')|| <= (1/2) sqrt(b-1) ||Q_dep,q|| lambda_ctx ||Q_ctx|| / (T_dep rho_min) ||e - e'||."""
    return 0.5 * n_done**0.5 * Q_dep_q_norm * lambda_ctx * Q_ctx_norm / (t_dep * rho_min)


def query_lipschitz(n_done, R_s, Q_dep_norm, Q_dep_q_norm, lambda_ctx, Q_ctx_norm, t_dep, rho_min):
    """eq:app_query_lipschitz_constant: L_q = lambda ||Q_ctx|| (1 + (b-1) R_s ||Q_dep|| ||Q_dep,q|| / (2 T_dep rho))."""
    return lambda_ctx * Q_ctx_norm * (1 + n_done * R_s * Q_dep_norm * Q_dep_q_norm / (2 * t_dep * rho_min))


def router_lipschitz(k, rho_min, L_q, t_attn, tau_lang, R_ctx_norm, t_lang):
    """eq:app_router_lipschitz_constant: L_alpha = sqrt(k) / (2 rho) (L_q / T_attn + tau ||R_ctx|| / T_lang)."""
    return k**0.5 / (2 * rho_min) * (L_q / t_attn + tau_lang * R_ctx_norm / t_lang)


def state_logit_lipschitz(L_q, t_attn, rho_min):
    """Proof step of prop:app_router_operator_lipschitz: |zeta_m(e) - zeta_m(e')| <= L_q / (T_attn rho_min)
    ||e - e'||."""
    return L_q / (t_attn * rho_min)


def prior_logit_lipschitz(R_ctx_norm, t_lang, rho_min):
    """Proof step of prop:app_router_operator_lipschitz: |rho_m(e) - rho_m(e')| <= ||R_ctx|| / (T_lang rho_min)
    ||e - e'||."""
    return R_ctx_norm / (t_lang * rho_min)


def operator_lipschitz(R_C, k, L_alpha):
    """prop:app_router_operator_lipschitz: ||S_b(e) - S_b(e')|| <= R_C sqrt(k) L_alpha ||e - e'||."""
    return R_C * k**0.5 * L_alpha


def update_lipschitz(scale: float, B_norm, g, A_norm, L_S):
    """prop:app_router_operator_lipschitz and thm:app_attention_projection_norm_stability:
    ||Delta W^l(e) - Delta W^l(e')|| <= s ||B|| g ||A|| L_S ||e - e'|| with L_S = R_C sqrt(k) L_alpha."""
    return scale * B_norm * g * A_norm * L_S


def uniform_update_bound(scale: float, R_B, R_C, R_A):
    """The uniform form of eq:app_update_matrix_norm_bound (g <= 1): s R_B (1 + R_C) R_A."""
    return scale * R_B * (1 + R_C) * R_A
