"""Stability in the instruction embedding e: the depth summary and query (prop:app_summary_lipschitz), the router,
routed operator and layer update on a fixed active set (prop:app_router_operator_lipschitz), and the attention
projections (thm:app_attention_projection_norm_stability, stability part).

The statements' premise is that the block's states are fixed while e moves: Prop. 11 fixes the completed-block
means sbar_i, and its proof ("the only part of q0 that depends on e is lambda_ctx Q_ctx e") also fixes the entry
state s_entry. The router-level tests and `lipschitz_checks.lipschitz` hold both fixed (re-routing the real
QueryableMemory.route from the recorded states). In the running network that premise holds for the first block
only: later blocks' states depend on e through the earlier blocks' routed updates, and the end-to-end version of
the bound is false (test_instruction_stability_end_to_end_later_blocks, an expected failure with a counterexample).

rho_min is the smallest RMS_eps among the vectors the statement's chain normalises at e and at e' (Prop. 11:
Q_dep,q q0; Prop. 12 and Thm. 14: also q and R_ctx e); R_s = max_i ||sbar_i||; R_C = max_m ||C_m||.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, example, given, settings, target
from hypothesis import strategies as st

from qlbench.theory import formulas, lipschitz_checks, norm_checks, tracing

from models import ModelCase, model_cases
from strategies import instruction_pairs, positive_lambda_ctxs, ratio, reals, router_cases, tol

MODEL_EXAMPLES = max(5, settings().max_examples // 4)
SEARCH_EXAMPLES = 4 * settings().max_examples  # router-level bounds have slack: violations need a longer search


def _le(lhs, rhs, *scales):
    """lhs <= rhs up to float64 rounding of the quantities whose difference lhs measures."""
    return bool((lhs <= rhs * (1 + tol(ops=64)) + tol(*scales, ops=256)).all())


def assert_holds(bounds):
    assert bounds
    for b in bounds:
        bad = b.violations()
        assert not bad.any(), (
            f"{b.label}: {b.quantity}: observed {b.observed[bad][:3].tolist()} > bound {b.bound[bad][:3].tolist()}"
        )


# ---------------------------------------------------------------------------------------------------------------
# prop:app_summary_lipschitz


@given(case=router_cases(min_done=1, lam=positive_lambda_ctxs), data=st.data())
@settings(max_examples=SEARCH_EXAMPLES)
def test_summary_and_query_lipschitz_router(case, data):
    """||u(e) - u(e')|| <= (b-1) R_s ||Q_dep,q|| lambda ||Q_ctx|| / (2 T_dep rho_min) ||e - e'||; the proof steps
    |xi_i(e) - xi_i(e')| <= L_xi ||e - e'|| for every depth logit (seen through log beta, which fixes xi up to a shift:
    pairwise differences move by at most 2 L_xi ||e - e'||) and ||beta(e) - beta(e')|| <= sqrt(b-1) L_xi / 2 ||e - e'||;
    and ||q(e) - q(e')|| <= L_q ||e - e'||; sbar_i and s_entry fixed."""
    e2 = data.draw(instruction_pairs(case))
    de = formulas.vnorm(case.instruction - e2)[:, None]  # (E, 1)
    assume(bool((de > 0).all()))
    R1, R2 = case.route(), case.route(instruction=e2)
    rho = torch.minimum(*(formulas.rms_eps(R.q0 @ case.Q_dep_q.transpose(1, 2), case.eps) for R in (R1, R2)))
    R_s = formulas.vnorm(case.summaries).max(-1).values
    Qdq, Qctx, Qdep = (formulas.opnorm(m)[:, None] for m in (case.Q_dep_q, case.Q_ctx, case.Q_dep))
    b1 = case.n_done
    L_u = formulas.summary_lipschitz(b1, R_s, Qdq, case.lambda_ctx, Qctx, case.t_dep, rho)
    L_xi = formulas.depth_logit_lipschitz(Qdq, case.lambda_ctx, Qctx, case.t_dep, rho)
    L_beta = formulas.depth_weight_lipschitz(b1, Qdq, case.lambda_ctx, Qctx, case.t_dep, rho)
    L_q = formulas.query_lipschitz(b1, R_s, Qdep, Qdq, case.lambda_ctx, Qctx, case.t_dep, rho)
    target(ratio(formulas.vnorm(R1.u - R2.u), L_u * de), label="||du|| / (L_u ||de||)")
    target(ratio(formulas.vnorm(R1.q - R2.q), L_q * de), label="||dq|| / (L_q ||de||)")
    assert _le(formulas.vnorm(R1.u - R2.u), L_u * de, R1.u, R2.u)
    spread = formulas.depth_logit_spread(R1.beta, R2.beta)
    target(ratio(spread, 2 * L_xi * de), label="depth-logit spread / (2 L_xi ||de||)")
    assert _le(spread, 2 * L_xi * de, R1.beta.log(), R2.beta.log())
    assert _le(formulas.vnorm(R1.beta - R2.beta), L_beta * de, 1.0)
    assert _le(formulas.vnorm(R1.q - R2.q), L_q * de, R1.q, R2.q)


# ---------------------------------------------------------------------------------------------------------------
# prop:app_router_operator_lipschitz


@given(case=router_cases(tau=reals(0.0, 5.0), lam=reals(0.0, 3.0)), data=st.data())
@settings(max_examples=SEARCH_EXAMPLES)
def test_router_and_operator_lipschitz_router(case, data):
    """On pairs with the same top-k active set: the state-logit and language-logit proof steps,
    ||alpha_I(e) - alpha_I(e')|| <= L_alpha ||e - e'|| and ||S_b(e) - S_b(e')|| <= R_C sqrt(k) L_alpha ||e - e'||."""
    e2 = data.draw(instruction_pairs(case))
    de = formulas.vnorm(case.instruction - e2)[:, None]
    assume(bool((de > 0).all()))
    R1, R2 = case.route(), case.route(instruction=e2)
    k = case.top_k
    assume(torch.equal(formulas.active_set(R1.logits, k), formulas.active_set(R2.logits, k)))  # Assumption 4
    vecs = [R.q for R in (R1, R2)]
    if case.n_done:
        vecs += [R.q0 @ case.Q_dep_q.transpose(1, 2) for R in (R1, R2)]
    rho = torch.stack([formulas.rms_eps(v, case.eps) for v in vecs]).min(0).values  # (E, N)
    if case.tau_lang:
        for e in (case.instruction, e2):
            rho = torch.minimum(rho, formulas.rms_eps(e.unsqueeze(1) @ case.R_ctx.transpose(1, 2), case.eps))
    R_s = formulas.vnorm(case.summaries).max(-1).values if case.n_done else torch.zeros_like(rho)
    Qdq, Qctx, Qdep, Rctx = (formulas.opnorm(m)[:, None] for m in (case.Q_dep_q, case.Q_ctx, case.Q_dep, case.R_ctx))
    L_q = formulas.query_lipschitz(case.n_done, R_s, Qdep, Qdq, case.lambda_ctx, Qctx, case.t_dep, rho)
    L_a = formulas.router_lipschitz(k, rho, L_q, case.t_attn, case.tau_lang, Rctx, case.t_lang)
    R_C = formulas.opnorm(case.atoms).max(-1).values[:, None]
    target(ratio(formulas.vnorm(R1.alpha - R2.alpha), L_a * de), label="||dalpha|| / (L_alpha ||de||)")
    assert _le((R1.zeta - R2.zeta).abs().amax(-1), L_q / (case.t_attn * rho) * de, R1.zeta, R2.zeta)
    if case.tau_lang:
        assert _le((R1.rho - R2.rho).abs().amax(-1), Rctx / (case.t_lang * rho) * de, R1.rho, R2.rho)
    assert _le(formulas.vnorm(R1.alpha - R2.alpha), L_a * de, R1.logits, R2.logits)
    assert _le(formulas.opnorm(R1.S - R2.S), R_C * k**0.5 * L_a * de, R1.logits, R2.logits, case.atoms)


def _probe(case: ModelCase, size: float, seed: int):
    model = case.build()
    x, e = case.inputs()
    g = torch.Generator().manual_seed(seed)
    e2 = e + torch.randn(e.shape, generator=g, dtype=e.dtype) * size
    return model, x, e, e2


@given(
    case=model_cases("deep-narrow", instruction=True),
    size=st.sampled_from([1e-6, 1e-2, 1.0]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=MODEL_EXAMPLES)
def test_router_operator_and_layer_update_lipschitz_real_model(case, size, seed):
    """Every block of a real adapted MLP, re-routed from its recorded states (prop 11 and prop 12, including the
    layer-update bound ||Delta W^l(e) x - Delta W^l(e') x|| <= s ||B|| g ||A|| R_C sqrt(k) L_alpha ||e - e'|| ||x|| on
    the layer's actual inputs, with Delta W^l read off the real layer)."""
    model, x, e, e2 = _probe(case, size, seed)
    with torch.no_grad():
        t = tracing.trace(model, x, e)
        bounds = lipschitz_checks.lipschitz(t, e2)
    assert "prop:app_router_operator_lipschitz" in {b.label for b in bounds}
    assert_holds(bounds)


# ---------------------------------------------------------------------------------------------------------------
# thm:app_attention_projection_norm_stability (stability part)


@given(
    case=model_cases("transformer", instruction=True),
    size=st.sampled_from([1e-6, 1e-2, 1.0]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=max(4, MODEL_EXAMPLES // 2))
def test_attention_projection_stability_real_model(case, size, seed):
    """||Delta W^{l,p}(e) - Delta W^{l,p}(e')|| <= s ||B^p|| g^p ||A^p|| R_C sqrt(k) L_alpha ||e - e'|| for p = q, k, v,
    o of a real RegressionTransformer (states of each block held fixed)."""
    model, x, e, e2 = _probe(case, size, seed)
    with torch.no_grad():
        t = tracing.trace(model, x, e)
        bounds = lipschitz_checks.lipschitz(t, e2)
    stab = [b for b in bounds if b.label == "thm:app_attention_projection_norm_stability"]
    assert {b.quantity.split("[")[1][0] for b in stab} <= {"q", "k", "v", "o"}
    assert_holds(bounds)


# ---------------------------------------------------------------------------------------------------------------
# The same bounds end to end in the running network (e changes, every state follows)


def _end_to_end(case: ModelCase, size: float, seed: int, blocks: str):
    """Ratio ||S_b(e) - S_b(e')|| / (R_C sqrt(k) L_alpha,b ||e - e'||) with both full forwards, constants from both
    (R_s the largest summary norm, rho_min the smallest RMS_eps), on samples whose active set did not change."""
    model, x, e, e2 = _probe(case, size, seed)
    with torch.no_grad():
        t1, t2 = tracing.trace(model, x, e), tracing.trace(model, x, e2)
    m, c = t1.memory, t1.config
    de = formulas.vnorm(e - e2)[:, None]
    eps, k = c.rms_eps, c.top_k
    Qdq, Qctx, Qdep, Rctx = (formulas.opnorm(a.detach())[:, None] for a in (m.Q_dep_q, m.Q_ctx, m.Q_dep, m.R_ctx))
    R_C = norm_checks.atom_radius(m)[:, None]
    out = []
    for b in range(1, case.n_blocks) if blocks == "later" else [0]:
        r1, r2 = t1.routes[b], t2.routes[b]
        same = (formulas.active_set(r1.logits, k) == formulas.active_set(r2.logits, k)).all(-1)
        vecs = [r.q for r in (r1, r2)] + [r.q0 @ m.Q_dep_q.transpose(1, 2) for r in (r1, r2) if b]
        rho = torch.stack([formulas.rms_eps(v, eps) for v in vecs]).min(0).values
        for ee in (e, e2) if c.tau_lang else ():
            rho = torch.minimum(rho, formulas.rms_eps(ee.unsqueeze(1) @ m.R_ctx.transpose(1, 2), eps))
        R_s = (
            torch.maximum(*(formulas.vnorm(t.summaries(b)).max(-1).values for t in (t1, t2)))
            if b
            else torch.zeros_like(rho)
        )
        L_q = formulas.query_lipschitz(b, R_s, Qdep, Qdq, c.lambda_ctx, Qctx, c.t_dep, rho)
        L_a = formulas.router_lipschitz(k, rho, L_q, c.t_attn, c.tau_lang, Rctx, c.t_lang)
        ratio = formulas.opnorm(r1.S - r2.S) / (R_C * k**0.5 * L_a * de)
        out.append(ratio[same])
    return torch.cat(out) if out else torch.zeros(0)


@given(
    case=model_cases("deep-narrow", instruction=True), size=st.sampled_from([1e-6, 1e-2]), seed=st.integers(0, 2**16)
)
@settings(max_examples=MODEL_EXAMPLES)
def test_instruction_stability_end_to_end_first_block(case, size, seed):
    """In the running network the first block's states do not depend on e, so the bound holds end to end there."""
    ratio = _end_to_end(case, size, seed, "first")
    assert (ratio <= 1 + tol(ops=1024)).all()


COUNTEREXAMPLE = ModelCase(
    arch="deep-narrow",
    seed=9,
    n_layers=3,
    n_blocks=2,
    r=1,
    n_atoms=2,
    top_k=2,
    d_k=2,
    instruction_dim=1,
    lambda_ctx=0.05,
    tau_lang=0.0,
    t_attn=1.0,
    t_dep=1.0,
    t_lang=1.0,
    rms_eps=1e-6,
    scale_A=3.0,
    scale_B=3.0,
    scale_atoms=2.0,
    eta_mean=3.0,
    n_samples=1,
)


@pytest.mark.xfail(
    strict=True,
    reason=(
        "prop:app_summary_lipschitz / prop:app_router_operator_lipschitz / thm:app_attention_projection_norm_stability "
        "need s_entry and sbar_i fixed: end to end, a later block's states depend on e through the earlier blocks' "
        "routed updates, a path L_alpha,b does not account for. "
        f"Counterexample: {COUNTEREXAMPLE} (a 3-layer, 2-block MLP, "
        "r = 1, M = k = d_k = 2, d_c = 1, lambda_ctx = 0.05, tau_lang = 0) with e' = e + 1e-6 z: the second block's "
        "||S_2(e) - S_2(e')|| is 26 times R_C sqrt(k) L_alpha,2 ||e - e'||"
    ),
)
@given(
    case=model_cases("deep-narrow", instruction=True, min_blocks=2),
    size=st.sampled_from([1e-6, 1e-2]),
    seed=st.integers(0, 2**16),
)
@example(case=COUNTEREXAMPLE, size=1e-6, seed=0)
@settings(max_examples=MODEL_EXAMPLES)
def test_instruction_stability_end_to_end_later_blocks(case, size, seed):
    """The router Lipschitz bound read as a statement about the running network, for blocks b >= 2."""
    ratio = _end_to_end(case, size, seed, "later")
    assert (ratio <= 1 + tol(ops=1024)).all()
