"""The block query and its depth attention, as defined (paper appendix eqs. app_prequery, app_depth_summary,
app_depth_logits, app_final_query; Algorithm 2):

    q_b^(0) = w_b + Q_cur s_entry + lambda_ctx Q_ctx e(c)
    xi_i = <RMSNorm(Q_dep,q q_b^(0)), RMSNorm(Q_dep,k sbar_i)> / (sqrt(d_k) T_dep),  beta_{i->b} = softmax_i(xi)
    u_{b-1} = sum_i beta_{i->b} sbar_i  (u_0 = 0),  q_b = q_b^(0) + Q_dep u_{b-1}

The paper's bounds on u and q (tests/properties/test_norm_bounds.py, test_lipschitz.py) hold just as well for depth
weights that ignore the logits or for an instruction added after the depth attention, so these definitions are
checked directly: `paper_query` below recomputes them one member and one sample at a time from the raw inputs,
with its own RMSNorm and softmax (nothing from qlbench.adapters.routing), and the router's Route (routing.route,
and the real model's routes read from ctx.scratch) must agree with it to float64 rounding.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qlbench.theory import tracing

from models import ModelCase, model_cases
from strategies import generic_router_cases, router_cases, tol

MODEL_EXAMPLES = max(5, settings().max_examples // 4)
RECORDING_ROLES = ("hidden", "q", "k", "v")  # paper: the block state is the MLP layer's, or the mean of Q, K, V's


def rms(v: torch.Tensor, eps: float) -> torch.Tensor:
    """Assumption 3: v / sqrt(mean(v^2) + eps) for one vector v (d,)."""
    return v / math.sqrt(float((v * v).sum()) / len(v) + eps)


def paper_query(w, Q_cur, s_entry, lambda_ctx, Q_ctx, e, sbars, Q_dep_q, Q_dep_k, Q_dep, t_dep, eps) -> dict:
    """One member, one sample: vectors w (d_k,), s_entry (r,), e (d_c,), sbars a list of the b - 1 block means (r,),
    matrices as in the paper -> q0, beta (b - 1,) and u (r,) (None for the first block), q, and the magnitudes the
    rounding allowances scale with."""
    q0 = w + Q_cur @ s_entry  # eq. app_prequery
    mag = w.abs() + Q_cur.abs() @ s_entry.abs()  # the size of the terms summed into the query
    if lambda_ctx:
        q0 = q0 + lambda_ctx * (Q_ctx @ e)
        mag = mag + lambda_ctx * (Q_ctx.abs() @ e.abs())
    out = dict(q0=q0, beta=None, u=None, q=q0, mag=mag, d_k=len(q0), t_dep=t_dep, sbar_max=0.0)
    if not sbars:
        return out  # u_0 = 0, q = q0
    q_hat = rms(Q_dep_q @ q0, eps)  # eq. app_depth_logits
    xi = torch.stack([q_hat @ rms(Q_dep_k @ s, eps) for s in sbars]) / (math.sqrt(len(q0)) * t_dep)
    ex = torch.exp(xi - xi.max())
    beta = ex / ex.sum()  # eq. app_depth_summary
    u = torch.zeros_like(sbars[0])
    for b_i, s in zip(beta, sbars):
        u = u + b_i * s
    sbar_abs = torch.stack(sbars).abs().max(0).values
    out.update(beta=beta, u=u, q=q0 + Q_dep @ u, mag=mag + Q_dep.abs() @ sbar_abs, sbar_max=float(sbar_abs.max()))
    return out  # eq. app_final_query: q = q0 + Q_dep u


def assert_route_matches(R, e: int, n: int, ref: dict, where: str):
    """A Route's q0, beta, u and q at member e, sample n equal paper_query's, in that order (the first that differs
    names the culprit)."""
    logit_scale = math.sqrt(ref["d_k"]) / ref["t_dep"]  # |xi_i| <= sqrt(d_k) / T_dep
    checks = [("q0", R.q0[e, n], ref["q0"], tol(ref["mag"], ops=64))]
    if ref["beta"] is None:
        assert R.beta is None and R.u is None, f"{where}: the first block has no depth summary (u_0 = 0)"
    else:
        assert R.beta is not None and R.beta.shape[-1] == len(ref["beta"]), f"{where}: beta is over the b - 1 blocks"
        checks.append(("beta", R.beta[e, n], ref["beta"], tol(logit_scale, ops=256)))
        checks.append(("u", R.u[e, n], ref["u"], tol(ref["sbar_max"] * (1 + logit_scale), ops=256)))
    checks.append(("q", R.q[e, n], ref["q"], tol(ref["mag"] * (1 + logit_scale), ops=256)))
    for name, actual, want, atol in checks:
        torch.testing.assert_close(actual, want, rtol=0, atol=atol, msg=lambda m, name=name: f"{where}: {name}: {m}")


# ---------------------------------------------------------------------------------------------------------------
# the router on raw inputs


@given(case=st.one_of(generic_router_cases(), router_cases()))
def test_block_query_router_matches_paper(case):
    """routing.route's q0, beta_{i->b}, u_{b-1} and q_b equal the paper's equations recomputed from the raw inputs
    (w, Q_cur, s_entry, lambda_ctx Q_ctx e, the summaries sbar_i, Q_dep_q, Q_dep_k, Q_dep, T_dep, eps). Generic
    cases (distinct summaries, lambda_ctx > 0, >= 2 completed blocks) make a wrong query visible; element-wise cases
    add zeros, repeated values and the first block (no summaries)."""
    R = case.route()
    E, N, _ = case.s_entry.shape
    for e in range(E):
        for n in range(N):
            sbars = [case.summaries[e, n, i] for i in range(case.n_done)]
            ref = paper_query(
                case.w[e], case.Q_cur[e], case.s_entry[e, n], case.lambda_ctx, case.Q_ctx[e], case.instruction[e],
                sbars, case.Q_dep_q[e], case.Q_dep_k[e], case.Q_dep[e], case.t_dep, case.eps,
            )  # fmt: skip
            assert_route_matches(R, e, n, ref, f"router, block {case.n_done}, sample {n}")


# ---------------------------------------------------------------------------------------------------------------
# the real model: the router as queryable.py wires it


def layer_index(name: str) -> tuple[str, int]:
    """(layer key, layer number) of a traced call: hidden.3 -> (hidden.3, 3); layers.2.q -> (layers.2, 2)."""
    parts = name.split(".")
    key = name if parts[-1].isdigit() else ".".join(parts[:-1])
    return key, int(key.rsplit(".", 1)[-1])


def block_states(case: ModelCase, t: tracing.Trace) -> dict[int, list[torch.Tensor]]:
    """block -> [(E, N, r)] the rank state of each of its layers in order, recomputed from the traced layer inputs:
    A x for an MLP layer; the token mean of A^p x, averaged over the adapted Q, K, V projections, for an attention
    layer (paper eq. for r_attn). Blocks are contiguous: layer l of L is in block floor(l B / L) (qlbench's choice)."""
    per_layer: dict[str, list[torch.Tensor]] = {}
    number: dict[str, int] = {}
    for c in t.calls:
        if c.role not in RECORDING_ROLES:
            continue
        A = c.layer.queryable_A.detach()  # (E, r, d_in)
        x = c.x.detach()
        s = torch.einsum("end,erd->enr", x, A) if x.dim() == 3 else torch.einsum("entd,erd->entr", x, A).mean(2)
        key, number[key] = layer_index(c.name)
        per_layer.setdefault(key, []).append(s)
    blocks: dict[int, list[torch.Tensor]] = {}
    for key in sorted(per_layer, key=number.__getitem__):
        states = per_layer[key]
        blocks.setdefault(number[key] * case.n_blocks // case.n_layers, []).append(sum(states) / len(states))
    return blocks


@given(
    case=st.one_of(
        model_cases("deep-narrow", instruction=True, min_blocks=3),
        model_cases("transformer", instruction=True, min_blocks=3),
    )
)
@settings(max_examples=MODEL_EXAMPLES)
def test_block_query_real_model_matches_paper(case):
    """Through the real adapted model's forward (registry build, instruction channels on, >= 3 blocks so that a
    block attends over >= 2 completed blocks), every block's route in ctx.scratch has the q0, beta, u and q of the
    paper's equations, recomputed from the model's parameters (w_b, Q_cur, Q_dep, Q_dep_q, Q_dep_k, Q_ctx), the
    instruction e(c) given to the forward, and block-entry states and block means recomputed from the layer inputs."""
    model = case.build()
    x, e_c = case.inputs()
    with torch.no_grad():
        t = tracing.trace(model, x, e_c)
    mem = {name: getattr(t.memory, name).detach() for name in ("block_prior", "Q_cur", "Q_dep", "Q_dep_q", "Q_dep_k")}
    Q_ctx = t.memory.Q_ctx.detach()
    states = block_states(case, t)
    assert sorted(t.routes) == sorted(states) == list(range(case.n_blocks))
    sbar = {b: sum(s) / len(s) for b, s in states.items()}  # (E, N, r) the block means
    for b, R in t.routes.items():
        for e in range(case.members):
            for n in range(case.n_samples):
                sbars = [sbar[i][e, n] for i in range(b)]
                ref = paper_query(
                    mem["block_prior"][e, b], mem["Q_cur"][e], states[b][0][e, n], case.lambda_ctx, Q_ctx[e],
                    e_c[e], sbars, mem["Q_dep_q"][e], mem["Q_dep_k"][e], mem["Q_dep"][e], case.t_dep, case.rms_eps,
                )  # fmt: skip
                assert_route_matches(R, e, n, ref, f"{case.arch} block {b}, member {e}, sample {n}")
