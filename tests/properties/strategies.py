"""Hypothesis strategies for the router's inputs, all float64 (paper Section 3; routing.route's arguments).

Raw arrays are drawn element by element (so hypothesis shrinks them towards zeros, ties and tiny vectors: the cases
where RMSNorm's eps and top-k ties matter). One member (E = 1) keeps examples small; the member dimension is
exercised by the real-model strategies in models.py (E = 2).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from qlbench.adapters.routing import Route, Router, Temperatures, route

EPS = torch.finfo(torch.float64).eps


def tol(*scales: float | torch.Tensor, ops: int = 64) -> float:
    """A float64 rounding allowance: ops * eps * (1 + the largest magnitude involved)."""
    ts = [torch.as_tensor(s).detach() for s in scales]
    m = max([float(t.abs().max()) for t in ts if t.numel()] + [0.0])
    return ops * EPS * (1.0 + m)


def reals(lo: float, hi: float):
    """Floats in [lo, hi] without subnormals (tests/conftest.py flushes denormals to zero, and hypothesis refuses to
    draw subnormals it cannot represent)."""
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False, allow_subnormal=False, width=64)


def elements(bound: float = 3.0):
    return reals(-bound, bound)


def tensors(*shape: int, bound: float = 3.0):
    """float64 torch tensors of the given shape with entries in [-bound, bound]."""
    return arrays(np.float64, shape, elements=elements(bound)).map(torch.from_numpy)


@st.composite
def maybe_zero(draw, *shape: int):
    """A router matrix that is exactly zero in about one draw out of four: the degenerate cases where the
    triangle-inequality bounds are tight (e.g. Q_dep = 0 leaves only the other terms of the query bound)."""
    t = draw(tensors(*shape))
    return torch.zeros_like(t) if draw(st.integers(0, 3)) == 0 else t


def ratio(observed: torch.Tensor, bound: torch.Tensor) -> float:
    """max observed / bound (0 where both vanish), for hypothesis.target: search towards tight cases."""
    r = observed / bound
    r = torch.where((observed == 0) & (bound == 0), torch.zeros_like(r), r)
    return float(r.max()) if r.numel() and torch.isfinite(r).all() else 0.0


# Scalars of the router (strictly positive temperatures; strengths >= 0). A separate scale multiplies the states and
# keys so hypothesis also visits vectors far below RMSNorm's eps and large ones.
temperatures = reals(0.1, 10.0)
tau_langs = reals(0.0, 5.0)
positive_tau_langs = reals(0.05, 5.0)
lambda_ctxs = reals(0.0, 3.0)
positive_lambda_ctxs = reals(0.05, 3.0)
rms_eps_values = st.sampled_from([1e-6, 1e-3, 1e-1])  # the code's default first
scales = st.sampled_from([1.0, 1e-3, 20.0])
ranks = st.integers(1, 4)
key_dims = st.integers(1, 8)
instruction_dims = st.integers(1, 5)


@dataclass
class RouterCase:
    """One block's routing inputs (routing.route's arguments) for E = 1 member."""

    s_entry: torch.Tensor  # (E, N, r)
    summaries: torch.Tensor | None  # (E, N, b-1, r)
    w: torch.Tensor  # (E, d_k)
    Q_cur: torch.Tensor  # (E, d_k, r)
    Q_dep: torch.Tensor  # (E, d_k, r)
    Q_dep_q: torch.Tensor  # (E, d_k, d_k)
    Q_dep_k: torch.Tensor  # (E, d_k, r)
    keys: torch.Tensor  # (E, M, d_k)
    atoms: torch.Tensor  # (E, M, r, r)
    instruction: torch.Tensor  # (E, d_c)
    Q_ctx: torch.Tensor  # (E, d_k, d_c)
    R_ctx: torch.Tensor  # (E, d_k, d_c)
    top_k: int
    t_attn: float
    t_dep: float
    t_lang: float
    tau_lang: float
    lambda_ctx: float
    eps: float

    @property
    def M(self) -> int:
        return self.keys.shape[1]

    @property
    def n_done(self) -> int:
        """Completed blocks b - 1 (the code's block index)."""
        return 0 if self.summaries is None else self.summaries.shape[2]

    def route(self, **changes) -> Route:
        """qlbench's router (routing.route) on this case, with any field replaced."""
        c = replace(self, **changes) if changes else self
        router = Router(
            w=c.w, Q_cur=c.Q_cur, Q_dep=c.Q_dep, Q_dep_q=c.Q_dep_q, Q_dep_k=c.Q_dep_k, keys=c.keys, atoms=c.atoms,
            Q_ctx=c.Q_ctx, R_ctx=c.R_ctx,
        )  # fmt: skip
        temperatures = Temperatures(
            top_k=c.top_k, t_attn=c.t_attn, t_dep=c.t_dep, t_lang=c.t_lang, tau_lang=c.tau_lang,
            lambda_ctx=c.lambda_ctx, eps=c.eps,
        )  # fmt: skip
        return route(c.s_entry, c.summaries, router, temperatures, c.instruction)


@st.composite
def router_cases(
    draw,
    *,
    min_done: int = 0,
    max_done: int = 3,
    tau=tau_langs,
    lam=lambda_ctxs,
    min_atoms: int = 1,
    max_atoms: int = 6,
    min_key_dim: int = 1,
    max_samples: int = 3,
) -> RouterCase:
    E = 1
    N = draw(st.integers(1, max_samples))
    r, d_k, d_c = draw(ranks), draw(st.integers(min_key_dim, 8)), draw(instruction_dims)
    M = draw(st.integers(min_atoms, max_atoms))
    k = draw(st.integers(1, M))
    P = draw(st.integers(min_done, max_done))
    state_scale, key_scale = draw(scales), draw(scales)
    s_entry = draw(tensors(E, N, r)) * state_scale
    summaries = draw(tensors(E, N, P, r)) * state_scale if P else None
    return RouterCase(
        s_entry=s_entry,
        summaries=summaries,
        w=draw(maybe_zero(E, d_k)),
        Q_cur=draw(maybe_zero(E, d_k, r)),
        Q_dep=draw(maybe_zero(E, d_k, r)),
        Q_dep_q=draw(maybe_zero(E, d_k, d_k)),
        Q_dep_k=draw(maybe_zero(E, d_k, r)),
        keys=draw(tensors(E, M, d_k)) * key_scale,
        atoms=draw(tensors(E, M, r, r)),
        instruction=draw(tensors(E, d_c)),
        Q_ctx=draw(maybe_zero(E, d_k, d_c)),
        R_ctx=draw(maybe_zero(E, d_k, d_c)),
        top_k=k,
        t_attn=draw(temperatures),
        t_dep=draw(temperatures),
        t_lang=draw(temperatures),
        tau_lang=draw(tau),
        lambda_ctx=draw(lam),
        eps=draw(rms_eps_values),
    )


def instruction_pairs(case: RouterCase):
    """A second instruction e' for `case`: a perturbation of e that is either tiny (the local Lipschitz constant) or
    of the order of e itself."""
    d_c = case.instruction.shape[1]
    return st.tuples(tensors(1, d_c), st.sampled_from([1e-6, 1e-2, 1.0])).map(lambda t: case.instruction + t[0] * t[1])


@st.composite
def vectors(draw, *, max_dim: int = 8, max_count: int = 4):
    """(n, d) float64 vectors at a drawn scale (RMSNorm / Jacobian lemmas)."""
    d, n = draw(st.integers(1, max_dim)), draw(st.integers(1, max_count))
    return draw(tensors(n, d)) * draw(st.sampled_from([1.0, 1e-4, 1e-2, 30.0]))


@st.composite
def generic_router_cases(
    draw, *, min_done: int = 2, max_done: int = 3, lam=positive_lambda_ctxs, max_samples: int = 3
) -> RouterCase:
    """A RouterCase whose arrays are Gaussian from a drawn seed (sizes, scalars and scales still drawn).

    router_cases' element-wise arrays are mostly one repeated fill value: block summaries that are all the same
    vector, router matrices of equal entries, so the depth weights come out uniform and the instruction does not move
    them. Here every summary is distinct, every matrix generic, d_k >= 2, the instruction non-zero and, by default,
    lambda_ctx > 0 and at least two completed blocks: the inputs on which a wrong block query (depth weights that
    ignore the logits, the instruction left out of q0) shows."""
    E = 1
    N = draw(st.integers(1, max_samples))
    r, d_k, d_c = draw(ranks), draw(st.integers(2, 8)), draw(instruction_dims)
    M = draw(st.integers(1, 6))
    k = draw(st.integers(1, M))
    P = draw(st.integers(min_done, max_done))
    state_scale, key_scale = draw(scales), draw(scales)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    randn = lambda *shape: torch.randn(shape, generator=g, dtype=torch.float64)
    return RouterCase(
        s_entry=randn(E, N, r) * state_scale,
        summaries=randn(E, N, P, r) * state_scale if P else None,
        w=randn(E, d_k),
        Q_cur=randn(E, d_k, r),
        Q_dep=randn(E, d_k, r),
        Q_dep_q=randn(E, d_k, d_k),
        Q_dep_k=randn(E, d_k, r),
        keys=randn(E, M, d_k) * key_scale,
        atoms=randn(E, M, r, r),
        instruction=randn(E, d_c),
        Q_ctx=randn(E, d_k, d_c),
        R_ctx=randn(E, d_k, d_c),
        top_k=k,
        t_attn=draw(temperatures),
        t_dep=draw(temperatures),
        t_lang=draw(temperatures),
        tau_lang=draw(tau_langs),
        lambda_ctx=draw(lam),
        eps=draw(rms_eps_values),
    )
