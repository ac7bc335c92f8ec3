"""The routing distribution: raw-logit fusion, the variational characterisation, the state-prior trade-off and the
limiting language regimes (paper appendix: lem:app_equivalent_raw_logit_fusion,
thm:app_variational_instruction_retrieval, cor:app_state_prior_tradeoff, prop:app_limiting_language_regimes).

Every check runs qlbench's router (routing.route / topk_softmax, QueryableLinear through the registry); a test only
computes the statement's other side (a prior, an objective, a scipy optimum).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize

from qlbench import adapters
from qlbench.adapters.routing import topk_softmax
from qlbench.theory import formulas

from models import model_cases
from strategies import positive_tau_langs, reals, router_cases, tensors, tol


def _fused_margin_ok(case, R) -> bool:
    """Assumption 4: the k-th and (k+1)-st fused logits are separated (else the active set is a tie-break)."""
    return bool((formulas.topk_margin(R.logits, case.top_k) > tol(R.logits, ops=1024)).all())


def _active(R, k):
    """Active set I of the router, and zeta, alpha, log p restricted to it."""
    idx = formulas.active_set(R.logits, k)
    zeta = R.zeta.gather(-1, idx)
    alpha = R.alpha.gather(-1, idx)
    log_p = (R.rho.log_softmax(-1).expand_as(R.zeta) if R.rho is not None else torch.zeros_like(R.zeta)).gather(-1, idx)
    return idx, zeta, alpha, log_p


# ---------------------------------------------------------------------------------------------------------------
# lem:app_equivalent_raw_logit_fusion


@given(case=router_cases(tau=positive_tau_langs))
def test_raw_logit_fusion_same_router(case):
    """zeta + tau log p and zeta + tau rho differ by a constant, so the softmax and the top-k softmax routers agree."""
    R = case.route()
    z = R.zeta + case.tau_lang * R.rho  # raw fusion (E, N, M)
    assume(_fused_margin_ok(case, R))
    assume(bool((formulas.topk_margin(z, case.top_k) > tol(z, ops=1024)).all()))
    t = tol(R.logits, z)
    shift = R.logits - z
    assert (shift - shift.mean(-1, keepdim=True)).abs().max() <= t
    assert torch.equal(formulas.active_set(R.logits, case.top_k), formulas.active_set(z, case.top_k))
    torch.testing.assert_close(R.alpha, topk_softmax(z, case.top_k), rtol=0, atol=t)  # top-k router
    dense = case.route(top_k=case.M)  # the usual softmax router
    torch.testing.assert_close(dense.alpha, torch.softmax(z, -1), rtol=0, atol=t)
    torch.testing.assert_close(dense.alpha, topk_softmax(z, case.M), rtol=0, atol=t)


# ---------------------------------------------------------------------------------------------------------------
# thm:app_variational_instruction_retrieval


def _simplex_points(k: int, n: int, seed: int) -> torch.Tensor:
    """n points of the k-simplex: Dirichlet at several concentrations plus every vertex."""
    g = torch.Generator().manual_seed(seed)
    pts = []
    for conc in (0.05, 0.5, 1.0, 5.0):
        gam = torch._standard_gamma(torch.full((n, k), conc, dtype=torch.float64), generator=g)
        pts.append(gam / gam.sum(-1, keepdim=True).clamp(min=1e-300))
    pts.append(torch.eye(k, dtype=torch.float64))
    pts = torch.cat(pts)
    return pts[torch.isfinite(pts).all(-1) & (pts.sum(-1) > 0.5)]


@given(case=router_cases(), seed=st.integers(0, 2**16))
def test_variational_retrieval_beats_simplex_points(case, seed):
    """alpha_I maximises <a, zeta_I> - KL(a || pi^tau_I) over the simplex on I; by the Gibbs variational principle
    Phi(alpha) - Phi(a) = KL(a || alpha) >= 0, which is zero only at a = alpha (uniqueness)."""
    R = case.route()
    assume(_fused_margin_ok(case, R))
    idx, zeta, alpha, log_p = _active(R, case.top_k)
    k = case.top_k
    assert R.alpha.sum(-1).sub(1).abs().max() <= tol(ops=16)
    outside = torch.ones_like(R.alpha, dtype=torch.bool).scatter(-1, idx, False)
    assert (R.alpha[outside] == 0).all()  # no mass outside I
    log_pi = formulas.log_tempered_prior(log_p, case.tau_lang)
    phi_star = formulas.variational_objective(alpha, zeta, log_pi)  # (E, N)
    pts = _simplex_points(k, 16, seed)[:, None, None, :]  # (n, 1, 1, k)
    phi = formulas.variational_objective(pts, zeta, log_pi)  # (n, E, N)
    scale = tol(zeta, log_pi, ops=256)
    assert (phi <= phi_star + scale).all()
    kl = (formulas.xlogx(pts) - pts * alpha.log()).sum(-1)  # KL(a || alpha)
    torch.testing.assert_close(phi_star - phi, kl, rtol=1e-9, atol=scale)


@given(case=router_cases(max_samples=1), seed=st.integers(0, 2**16))
@settings(max_examples=max(5, settings().max_examples // 4))
def test_variational_retrieval_matches_scipy(case, seed):
    """An independent solver (scipy SLSQP on the simplex) finds the same maximiser, no better than alpha."""
    R = case.route()
    assume(_fused_margin_ok(case, R))
    _, zeta, alpha, log_p = _active(R, case.top_k)
    log_pi = formulas.log_tempered_prior(log_p, case.tau_lang)
    z, lp, a_code = zeta[0, 0].numpy(), log_pi[0, 0].numpy(), alpha[0, 0].numpy()
    k = z.size
    assume(z.max() - z.min() + lp.max() - lp.min() < 40)  # SLSQP's working range (a_m > 1e-17)

    def neg_phi(a):
        a = np.clip(a, 0, None)
        return -(a @ z - np.sum(np.where(a > 0, a * np.log(np.where(a > 0, a, 1)), 0) - a * lp))

    def neg_grad(a):
        return -(z + lp - np.log(np.clip(a, 1e-300, None)) - 1)

    x0 = np.random.default_rng(seed).dirichlet(np.ones(k))
    res = minimize(
        neg_phi,
        x0,
        jac=neg_grad,
        method="SLSQP",
        bounds=[(0, 1)] * k,
        constraints=[{"type": "eq", "fun": lambda a: a.sum() - 1, "jac": lambda a: np.ones_like(a)}],
        options=dict(ftol=1e-15, maxiter=1000),
    )
    a_sp = np.clip(res.x, 0, None)
    a_sp /= a_sp.sum()
    assert -neg_phi(a_sp) <= -neg_phi(a_code) + tol(zeta, log_pi, ops=256)
    assert np.abs(a_sp - a_code).max() <= 1e-5


@given(case=router_cases(), seed=st.integers(0, 2**16))
def test_variational_retrieval_entropy_form(case, seed):
    """<a, zeta_I + tau log p_I> + H(a) equals the KL objective plus a constant in a, so alpha maximises it too."""
    R = case.route()
    assume(_fused_margin_ok(case, R))
    _, zeta, alpha, log_p = _active(R, case.top_k)
    log_pi = formulas.log_tempered_prior(log_p, case.tau_lang)
    pts = torch.cat(
        [_simplex_points(case.top_k, 8, seed)[:, None, None, :].expand(-1, *alpha.shape), alpha.unsqueeze(0)]
    )
    psi = formulas.entropy_objective(pts, zeta, log_p, case.tau_lang)
    phi = formulas.variational_objective(pts, zeta, log_pi)
    scale = tol(zeta, case.tau_lang * log_p, ops=256)
    diff = psi - phi
    assert (diff - diff[-1]).abs().max() <= scale
    assert (psi <= psi[-1] + scale).all()


# ---------------------------------------------------------------------------------------------------------------
# cor:app_state_prior_tradeoff


@given(case=router_cases())
def test_state_prior_tradeoff(case):
    """0 <= max_I zeta - <alpha_I, zeta_I> <= log 1 / pi^tau_{I, m*}."""
    R = case.route()
    assume(_fused_margin_ok(case, R))
    _, zeta, alpha, log_p = _active(R, case.top_k)
    gap, bound = formulas.state_prior_tradeoff(alpha, zeta, formulas.log_tempered_prior(log_p, case.tau_lang))
    t = tol(zeta, bound, ops=256)
    assert (gap >= -t).all()
    assert (gap <= bound + t).all()


# ---------------------------------------------------------------------------------------------------------------
# prop:app_limiting_language_regimes


@given(case=router_cases(tau=st.just(0.0), lam=st.just(0.0)), other=tensors(1, 5))
def test_limit_a_state_only_router(case, other):
    """(a) lambda_ctx = tau_lang = 0: the route does not depend on the instruction at all (none needed)."""
    base = case.route(instruction=None, Q_ctx=None, R_ctx=None)
    e2 = other[:, : case.instruction.shape[1]] * 10
    for R in (case.route(), case.route(instruction=e2)):
        assert R.rho is None
        for name in ("q0", "q", "zeta", "logits", "alpha", "S"):
            assert torch.equal(getattr(R, name), getattr(base, name)), name


@given(case=model_cases("deep-narrow", instruction=None))
@settings(max_examples=max(5, settings().max_examples // 4))
def test_limit_b_zero_gate_is_lora(case):
    """(b) g_l = 0 for every layer (eta = -inf): the queryable model is exactly LoRA with the same A, B."""
    model = case.build()
    x, e = case.inputs()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("queryable_eta"):
                p.fill_(-math.inf)
        lora_method = adapters.get("lora")
        lora = lora_method.build(case.backbone(), lora_method.make_config(r=case.r), case.generators(1), None)
        qp = dict(model.named_parameters())
        for name, p in lora.named_parameters():
            if p.requires_grad:
                p.copy_(qp[name.replace("lora_", "queryable_")])
        y_q, y_l = model(x, e), lora(x)
    torch.testing.assert_close(y_q, y_l, rtol=0, atol=tol(y_l, ops=256))


@given(case=router_cases(tau=st.just(1.0)))
def test_limit_c_language_prior_dominates(case):
    """(c) tau_lang -> infinity: alpha -> e_{m+} with m+ = argmax rho, and S_b -> C_{m+}. Quantitatively, once m+ is
    active, 1 - alpha_{m+} <= (k - 1) exp(max_m (zeta_m - zeta_{m+}) - tau (rho_{m+} - max_{m != m+} rho_m))."""
    R = case.route()
    top2 = R.rho.topk(min(2, case.M), dim=-1)
    m_plus = top2.indices[..., 0]  # (E, 1)
    gap = (
        (top2.values[..., 0] - top2.values[..., 1])
        if case.M > 1
        else torch.full_like(m_plus, math.inf, dtype=R.rho.dtype)
    )
    assume(bool((gap > 1e-6).all()))  # a unique maximiser of rho
    m_plus = m_plus.expand(R.zeta.shape[:2])  # (E, N)
    spread = (R.zeta - R.zeta.gather(-1, m_plus.unsqueeze(-1))).amax(-1)  # max_m zeta_m - zeta_{m+}
    g = gap.expand_as(spread)
    tau_inf = float(((60 + spread.abs()) / g).max()) if case.M > 1 else 1.0
    for tau in (1.0, 10.0, 100.0, 1e4, tau_inf):
        Rt = case.route(tau_lang=tau)
        a_plus = Rt.alpha.gather(-1, m_plus.unsqueeze(-1)).squeeze(-1)
        active = (formulas.active_set(Rt.logits, case.top_k) == m_plus.unsqueeze(-1)).any(-1)
        bound = (case.top_k - 1) * torch.exp(spread - tau * g)
        assert ((1 - a_plus <= bound + tol(ops=64)) | ~active).all()
    assert active.all()
    assert (1 - a_plus).abs().max() <= tol(ops=64)
    C_plus = case.atoms[0][m_plus[0]].unsqueeze(0)  # (E, N, r, r)
    torch.testing.assert_close(Rt.S, C_plus, rtol=0, atol=tol(case.atoms, ops=64))


@given(
    case=router_cases(min_key_dim=2, min_atoms=2, tau=positive_tau_langs | st.just(1.0)),
    a=reals(-3, 3),
    c=reals(0.1, 3),
)
def test_limit_d_constant_state_logits_give_tempered_prior(case, a, c):
    """(d) zeta constant on I: alpha_I = pi^tau_I; for tau = 1 the renormalised language prior p_I / sum_I p.
    Constant state logits are built, not assumed: q = w (no state, no instruction in the query, first block) and keys
    k_m = a w/|w| + v_m with v_m orthogonal to w and |v_m| = c, so every key has the same RMS and the same
    inner product with q."""
    w = case.w[0]
    w_hat = w / w.norm() if w.norm() > 0 else torch.zeros_like(w)
    v = case.keys[0] - (case.keys[0] @ w_hat)[:, None] * w_hat
    assume(bool((v.norm(dim=-1) > 1e-3).all()))
    keys = (a * w_hat + c * v / v.norm(dim=-1, keepdim=True)).unsqueeze(0)
    R = case.route(keys=keys, Q_cur=torch.zeros_like(case.Q_cur), lambda_ctx=0.0, summaries=None)
    d_k = keys.shape[-1]  # the premise, on the code, up to the rounding of a d_k-term inner product:
    assert (R.zeta - R.zeta[..., :1]).abs().max() <= tol(math.sqrt(d_k) / case.t_attn, ops=64 * d_k)
    assume(_fused_margin_ok(case, R))
    _, zeta, alpha, log_p = _active(R, case.top_k)
    pi = formulas.log_tempered_prior(log_p, case.tau_lang).exp()
    t = tol(R.logits, ops=256)
    torch.testing.assert_close(alpha, pi, rtol=0, atol=t)
    if case.tau_lang == 1.0:
        p = log_p.exp()
        torch.testing.assert_close(alpha, p / p.sum(-1, keepdim=True), rtol=0, atol=t)
