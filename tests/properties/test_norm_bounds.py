"""Norm control: the routed operator lies in the atoms' convex hull, the layer update and the depth summary and query
stay bounded (prop:app_convex_hull_bound, cor:app_update_norm_bound, prop:app_depth_summary_bounded,
cor:app_query_norm_bound, and the norm part of thm:app_attention_projection_norm_stability).

Router-level checks draw raw float64 inputs; model-level checks read the quantities off a real adapted model's
forward (tracing.trace) and compute only the right-hand sides.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings, target

from qlbench.theory import formulas, norm_checks, tracing
from qlbench.theory.bounds import Bound

from models import model_cases
from strategies import ratio, router_cases, tol

MODEL_EXAMPLES = max(5, settings().max_examples // 4)


def assert_holds(bounds: list[Bound]):
    assert bounds
    for b in bounds:
        bad = b.violations()
        assert not bad.any(), (
            f"{b.label}: {b.quantity}: observed {b.observed[bad][:3].tolist()} > bound {b.bound[bad][:3].tolist()}"
        )


# ---------------------------------------------------------------------------------------------------------------
# prop:app_convex_hull_bound


@given(case=router_cases())
def test_convex_hull_router(case):
    """alpha is in the simplex with at most k atoms, S_b = sum_m alpha_m C_m, and
    ||S_b|| <= sum_m alpha_m ||C_m|| <= max_m ||C_m||."""
    R = case.route()
    assert (R.alpha >= 0).all()
    assert (R.alpha.sum(-1) - 1).abs().max() <= tol(ops=16)
    assert ((R.alpha > 0).sum(-1) <= case.top_k).all()
    torch.testing.assert_close(
        R.S, torch.einsum("enm,emij->enij", R.alpha, case.atoms), rtol=0, atol=tol(case.atoms, ops=64)
    )
    C = formulas.opnorm(case.atoms)  # (E, M)
    S = formulas.opnorm(R.S)
    mid = (R.alpha * C[:, None]).sum(-1)
    t = tol(C, ops=256)
    target(ratio(S, C.max(-1).values[:, None]), label="||S|| / R_C")
    assert (S <= mid + t).all()
    assert (mid <= C.max(-1).values[:, None] + t).all()


@given(case=model_cases("deep-narrow"))
@settings(max_examples=MODEL_EXAMPLES)
def test_convex_hull_real_model(case):
    """The same on every block route of a real adapted model."""
    model = case.build()
    x, e = case.inputs()
    with torch.no_grad():
        t = tracing.trace(model, x, e)
    for R in t.routes.values():
        torch.testing.assert_close(
            R.S, torch.einsum("enm,emij->enij", R.alpha, t.memory.atoms), rtol=0, atol=tol(t.memory.atoms, ops=64)
        )
    assert_holds(norm_checks.convex_hull(t))


# ---------------------------------------------------------------------------------------------------------------
# cor:app_update_norm_bound


@given(case=model_cases("deep-narrow"))
@settings(max_examples=MODEL_EXAMPLES)
def test_layer_update_norm_bound(case):
    """||Delta W^l|| <= s ||B|| (1 + g R_C) ||A|| <= s R_B (1 + R_C) R_A and ||Delta W^l x|| <= ... ||x|| on the layer's
    actual inputs, for every layer and sample (Delta W^l read off the real layer on the identity basis)."""
    model = case.build()
    x, e = case.inputs()
    with torch.no_grad():
        t = tracing.trace(model, x, e)
        bounds = norm_checks.layer_updates(t, full_matrix=True)
    assert {b.label for b in bounds} == {"cor:app_update_norm_bound"}
    assert_holds(bounds)


@given(case=model_cases("deep-narrow"))
@settings(max_examples=MODEL_EXAMPLES)
def test_update_matrix_row_space_shortcut(case):
    """verify's shortcut ||Delta W|| = ||Delta W Q_A|| (Q_A spanning A's row space) agrees with the full matrix, and
    the full matrix applied to x is the layer's own output minus the frozen base."""
    model = case.build()
    x, e = case.inputs()
    with torch.no_grad():
        t = tracing.trace(model, x, e)
        for c in t.calls:
            full = tracing.update_matrix(c.layer, c.S)
            short = tracing.update_matrix(c.layer, c.S, tracing.row_space_basis(c.layer))
            n = formulas.opnorm(full)
            torch.testing.assert_close(formulas.opnorm(short), n, rtol=0, atol=tol(n, ops=256))
            torch.testing.assert_close(
                (full @ c.x.unsqueeze(-1)).squeeze(-1), c.out - c.layer.base(c.x), rtol=0, atol=tol(c.out, ops=1024)
            )


# ---------------------------------------------------------------------------------------------------------------
# thm:app_attention_projection_norm_stability (norm part): per projection p in {Q, K, V, O}


@given(case=model_cases("transformer"))
@settings(max_examples=max(4, MODEL_EXAMPLES // 2))
def test_attention_projection_norm_bound(case):
    """||Delta W^{l,p}|| <= s ||B^p|| (1 + g^p R_C) ||A^p|| for p = q, k, v, o of a real RegressionTransformer, every
    layer and sequence, with the projection's own A^p, B^p and gate."""
    model = case.build()
    x, e = case.inputs()
    with torch.no_grad():
        t = tracing.trace(model, x, e)
        bounds = norm_checks.layer_updates(t, full_matrix=True)
    roles = {c.role for c in t.calls}
    assert roles == {"q", "k", "v", "o"}
    assert {b.label for b in bounds} == {"thm:app_attention_projection_norm_stability"}
    assert_holds(bounds)


# ---------------------------------------------------------------------------------------------------------------
# prop:app_depth_summary_bounded


@given(case=router_cases(min_done=1))
def test_depth_summary_bounded_router(case):
    """u_{b-1} = sum_i beta_i sbar_i with beta in the simplex, so ||u|| <= max_i ||sbar_i||."""
    R = case.route()
    assert R.beta.shape[-1] == case.n_done
    assert (R.beta >= 0).all() and (R.beta.sum(-1) - 1).abs().max() <= tol(ops=16)
    torch.testing.assert_close(
        R.u, torch.einsum("enp,enpr->enr", R.beta, case.summaries), rtol=0, atol=tol(case.summaries, ops=64)
    )
    R_s = formulas.vnorm(case.summaries).max(-1).values
    target(ratio(formulas.vnorm(R.u), R_s), label="||u|| / R_s")
    assert (formulas.vnorm(R.u) <= R_s + tol(R_s, ops=64)).all()


@given(case=model_cases("deep-narrow", min_blocks=2))
@settings(max_examples=MODEL_EXAMPLES)
def test_depth_summary_bounded_real_model(case):
    """On a real model: block b's summary attends over exactly the b - 1 completed blocks, whose means sbar_i are
    the averages of the rank states A_l x_l the layers of block i computed; and ||u|| <= max_i ||sbar_i||."""
    model = case.build()
    x, e = case.inputs()
    with torch.no_grad():
        t = tracing.trace(model, x, e)
    per_block: dict[int, list[torch.Tensor]] = {}
    for c in t.calls:
        per_block.setdefault(c.layer.block, []).append(c.s)
    sbar = {b: torch.stack(s).mean(0) for b, s in per_block.items()}  # (E, N, r)
    assert sorted(t.routes) == list(range(case.n_blocks))
    for b, R in t.routes.items():
        if b == 0:
            assert R.u is None  # u_0 = 0
            continue
        assert R.beta.shape[-1] == b
        done = torch.stack([sbar[i] for i in range(b)], dim=2)  # (E, N, b, r)
        torch.testing.assert_close(R.u, torch.einsum("enp,enpr->enr", R.beta, done), rtol=0, atol=tol(done, ops=64))
    assert_holds(norm_checks.depth_summaries(t))


# ---------------------------------------------------------------------------------------------------------------
# cor:app_query_norm_bound


@given(case=router_cases())
def test_query_norm_bound_router(case):
    """||q_b|| <= ||w|| + ||Q_cur|| R_s + lambda ||Q_ctx|| ||e|| + ||Q_dep|| R_s,
    R_s = max(||s_entry||, max_i ||sbar_i||)."""
    R = case.route()
    R_s = formulas.vnorm(case.s_entry)
    if case.summaries is not None:
        R_s = torch.maximum(R_s, formulas.vnorm(case.summaries).max(-1).values)
    rhs = formulas.query_norm_bound(
        formulas.vnorm(case.w)[:, None],
        formulas.opnorm(case.Q_cur)[:, None],
        R_s,
        case.lambda_ctx,
        formulas.opnorm(case.Q_ctx)[:, None],
        formulas.vnorm(case.instruction)[:, None],
        formulas.opnorm(case.Q_dep)[:, None],
    )
    target(ratio(formulas.vnorm(R.q), rhs), label="||q|| / bound")
    assert (formulas.vnorm(R.q) <= rhs + tol(rhs, ops=256)).all()


@given(case=model_cases("deep-narrow"))
@settings(max_examples=MODEL_EXAMPLES)
def test_query_norm_bound_real_model(case):
    model = case.build()
    x, e = case.inputs()
    with torch.no_grad():
        t = tracing.trace(model, x, e)
    assert_holds(norm_checks.query_norms(t))
