"""The two differential lemmas the stability proofs rest on, checked on qlbench's own routing.rmsnorm and
routing.topk_softmax against autograd (lem:app_rmsnorm_jacobian, lem:app_softmax_jacobian), plus the integrated
(two-point) forms that the proofs of prop:app_summary_lipschitz and prop:app_router_operator_lipschitz actually use.
"""

from __future__ import annotations

import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from qlbench.adapters.routing import rmsnorm, topk_softmax
from qlbench.theory import formulas

from strategies import rms_eps_values, tensors, tol, vectors

# ---------------------------------------------------------------------------------------------------------------
# lem:app_rmsnorm_jacobian


@given(x=vectors(), eps=rms_eps_values)
def test_rmsnorm_jacobian_formula(x, eps):
    """J(x) = I / r - x x^T / (d r^3) with r = RMS_eps(x), against autograd through routing.rmsnorm."""
    J = formulas.autograd_jacobian(lambda v: rmsnorm(v, eps), x)
    formula = formulas.rmsnorm_jacobian(x, eps)
    # rounding scales with the two terms (each up to 1 / r), which cancel along x when eps << mean(x^2)
    torch.testing.assert_close(J, formula, rtol=0, atol=tol(1 / formulas.rms_eps(x, eps), ops=64))


@given(x=vectors().filter(lambda v: v.abs().max() > 1e-3), eps=rms_eps_values)
def test_rmsnorm_gradcheck(x, eps):
    """Finite differences agree with autograd (docs/design.md, Style: gradcheck for custom math)."""
    x = (x / x.abs().max()).requires_grad_(True)  # unit scale: finite-difference steps of 1e-6 resolve it
    assert torch.autograd.gradcheck(lambda v: rmsnorm(v, eps), (x,))


@given(x=vectors(), eps=rms_eps_values)
def test_rmsnorm_jacobian_spectral_bound(x, eps):
    """||J(x)|| <= 1 / RMS_eps(x) <= 1 / rho_min; J has eigenvalue eps / r^3 along x and 1 / r orthogonal to it."""
    J = formulas.autograd_jacobian(lambda v: rmsnorm(v, eps), x)
    r = formulas.rms_eps(x, eps)
    norm = formulas.opnorm(J)
    assert (norm <= (1 / r) * (1 + tol(ops=64))).all()
    assert (norm <= (1 / r.min()) * (1 + tol(ops=64))).all()
    d = x.shape[-1]
    Jx = (J @ x.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(Jx, eps / r[:, None] ** 3 * x, rtol=0, atol=tol(x / r[:, None], ops=64 * d))
    if d > 1:  # a unit-order direction orthogonal to x: the basis vector of x's smallest entry, x projected out
        v = torch.zeros_like(x).scatter(-1, x.abs().argmin(-1, keepdim=True), 1.0)
        v = v - (v * x).sum(-1, keepdim=True) / (x * x).sum(-1, keepdim=True).clamp(min=1e-300) * x
        Jv = (J @ v.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(Jv, v / r[:, None], rtol=0, atol=tol(1 / r, ops=64 * d))


@given(
    xy=st.integers(1, 8).flatmap(lambda d: st.tuples(tensors(1, d), tensors(1, d))),
    sx=st.sampled_from([1.0, 1e-3, 30.0]),
    sy=st.sampled_from([1.0, 1e-3, 30.0]),
    eps=rms_eps_values,
)
def test_rmsnorm_lipschitz_between_points(xy, sx, sy, eps):
    """The step the stability proofs take ("RMS normalisation is 1/rho_min-Lipschitz on the non-degenerate region")
    holds between any two points with rho_min the smaller of their RMS_eps, although the region {RMS_eps >= rho_min}
    is not convex (the segment x -> -x passes through 0): ||f(x) - f(y)|| <= ||x - y|| / min(r(x), r(y))."""
    x, y = xy[0] * sx, xy[1] * sy
    lhs = formulas.vnorm(rmsnorm(x, eps) - rmsnorm(y, eps))
    rho = torch.minimum(formulas.rms_eps(x, eps), formulas.rms_eps(y, eps))
    rhs = formulas.vnorm(x - y) / rho
    assert (lhs <= rhs * (1 + tol(ops=64)) + tol(ops=64)).all()


# ---------------------------------------------------------------------------------------------------------------
# lem:app_softmax_jacobian


@st.composite
def logit_rows(draw):
    M = draw(st.integers(1, 7))
    z = draw(tensors(draw(st.integers(1, 3)), M, bound=5.0)) * draw(st.sampled_from([1.0, 10.0, 1e-3]))
    return z, draw(st.integers(1, M))


@given(zk=logit_rows())
def test_softmax_jacobian_formula(zk):
    """The Jacobian of routing.topk_softmax is diag(alpha) - alpha alpha^T on the active set, zero elsewhere."""
    z, k = zk
    J = formulas.autograd_jacobian(lambda z_: topk_softmax(z_, k), z)
    formula = formulas.softmax_jacobian(topk_softmax(z, k))
    torch.testing.assert_close(J, formula, rtol=0, atol=tol(ops=64))


@given(zk=logit_rows())
def test_softmax_jacobian_spectral_bound(zk):
    """||diag(alpha) - alpha alpha^T|| <= 1/2 (autograd Jacobian of the code's top-k softmax)."""
    z, k = zk
    J = formulas.autograd_jacobian(lambda z_: topk_softmax(z_, k), z)
    assert (formulas.opnorm(J) <= 0.5 + tol(ops=64)).all()


@given(zk=logit_rows(), dz=st.integers(0, 2**16), size=st.sampled_from([1e-6, 1e-2, 1.0, 10.0]))
def test_softmax_lipschitz_on_fixed_active_set(zk, dz, size):
    """Integrated form used by the proofs: on a fixed active set I, ||alpha(z) - alpha(z')|| <= 1/2 ||z_I - z'_I||."""
    z, k = zk
    g = torch.Generator().manual_seed(dz)
    z2 = z + torch.randn(z.shape, generator=g, dtype=z.dtype) * size
    I1, I2 = formulas.active_set(z, k), formulas.active_set(z2, k)
    assume(torch.equal(I1, I2))
    lhs = formulas.vnorm(topk_softmax(z, k) - topk_softmax(z2, k))
    rhs = 0.5 * formulas.vnorm(z.gather(-1, I1) - z2.gather(-1, I1))
    assert (lhs <= rhs * (1 + tol(ops=64)) + tol(ops=64)).all()
