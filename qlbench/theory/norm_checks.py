"""The norm statements of the paper on a traced forward: the convex hull, the layer update, the depth summary and
query norm bounds, and the RMSNorm and softmax Jacobian lemmas.

Right-hand sides are computed from the actual inputs, tight as stated, never padded: R_C = max_m ||C_m||,
R_s = the largest norm among the summaries (and the entry state) the statement involves, rho_min = the smallest
RMS_eps(x) = sqrt(mean(x^2) + eps) among the vectors that the statement's chain RMS-normalises.
"""

from __future__ import annotations

import torch

from qlbench.adapters.queryable import QueryableMemory
from qlbench.adapters.routing import rmsnorm, topk_softmax
from qlbench.theory.bounds import Bound, _merge
from qlbench.theory.formulas import (
    autograd_jacobian,
    layer_update_bound,
    opnorm,
    query_norm_bound,
    rms_eps,
    uniform_update_bound,
    vnorm,
)
from qlbench.theory.tracing import LayerCall, Trace, gate, row_space_basis, update_matrix


def atom_radius(memory: QueryableMemory) -> torch.Tensor:
    """R_C = max_m ||C_m|| per member (E,)."""
    return opnorm(memory.atoms.detach()).max(dim=-1).values


def convex_hull(t: Trace) -> list[Bound]:
    """prop:app_convex_hull_bound: ||S_b|| <= sum_m alpha_m ||C_m|| <= max_m ||C_m||, per block and sample."""
    C = opnorm(t.memory.atoms.detach())  # (E, M)
    R_C = C.max(dim=-1).values[:, None]
    obs, mid, top = [], [], []
    for route in t.routes.values():
        S_norm = opnorm(route.S.detach())  # (E, N)
        obs.append(S_norm)
        mid.append((route.alpha.detach() * C[:, None]).sum(-1))
        top.append(R_C.expand_as(S_norm))
    obs, mid, top = torch.cat(obs, 1), torch.cat(mid, 1), torch.cat(top, 1)
    return [
        Bound("prop:app_convex_hull_bound", "||S_b|| <= sum_m alpha_m ||C_m||", obs, mid),
        Bound("prop:app_convex_hull_bound", "||S_b|| <= max_m ||C_m|| = R_C", obs, top),
    ]


def _statement_for(call: LayerCall) -> str:
    return (
        "thm:app_attention_projection_norm_stability"
        if call.role in ("q", "k", "v", "o")
        else "cor:app_update_norm_bound"
    )


def layer_updates(t: Trace, *, full_matrix: bool = False) -> list[Bound]:
    """cor:app_update_norm_bound (thm:app_attention_projection_norm_stability for q, k, v, o), per layer and sample:
    ||Delta W|| <= s ||B|| (1 + g R_C) ||A||, the uniform s R_B (1 + R_C) R_A, and the vector form on the layer's
    actual inputs ||Delta W x|| <= s ||B|| (1 + g R_C) ||A|| ||x||."""
    R_C = atom_radius(t.memory)  # (E,)
    layers = {c.name: c.layer for c in t.calls}
    R_A = torch.stack([opnorm(layer.queryable_A.detach()) for layer in layers.values()]).max(0).values
    R_B = torch.stack([opnorm(layer.queryable_B.detach()) for layer in layers.values()]).max(0).values
    out = []
    for c in t.calls:
        layer = c.layer
        A_n, B_n, g = opnorm(layer.queryable_A.detach()), opnorm(layer.queryable_B.detach()), gate(layer)
        rhs = layer_update_bound(layer.scale, B_n, g, R_C, A_n)[:, None]  # (E, 1)
        basis = None if full_matrix else row_space_basis(layer)
        W_norm = opnorm(update_matrix(layer, c.S.detach(), basis).detach())  # (E, N)
        label = _statement_for(c)
        role = f" [{c.role}]" if c.role != "hidden" else ""
        out.append(Bound(label, f"||Delta W^l||{role} <= s ||B|| (1 + g R_C) ||A||", W_norm, rhs.expand_as(W_norm)))
        uniform = uniform_update_bound(layer.scale, R_B, R_C, R_A)[:, None]
        out.append(Bound(label, f"||Delta W^l||{role} <= s R_B (1 + R_C) R_A", W_norm, uniform.expand_as(W_norm)))
        dWx = vnorm((c.out - layer.base(c.x)).detach())  # (E, N, [T])
        x_n = vnorm(c.x.detach())
        rhs_x = rhs.view(-1, *([1] * (x_n.dim() - 1))) * x_n
        out.append(Bound(label, f"||Delta W^l x||{role} <= s ||B|| (1 + g R_C) ||A|| ||x||", dWx, rhs_x))
    return _merge(out)


def depth_summaries(t: Trace) -> list[Bound]:
    """prop:app_depth_summary_bounded: ||u_{b-1}|| <= max_{i<b} ||sbar_i||, for every block b >= 2 and sample."""
    obs, rhs = [], []
    for b, route in t.routes.items():
        if route.u is None:
            continue
        obs.append(vnorm(route.u.detach()))
        rhs.append(vnorm(t.summaries(b).detach()).max(dim=-1).values)
    if not obs:
        return [
            Bound(
                "prop:app_depth_summary_bounded",
                "||u_{b-1}|| <= max_i ||sbar_i||",
                torch.zeros(0),
                torch.zeros(0),
                note="single block: u = 0",
            )
        ]
    return [
        Bound("prop:app_depth_summary_bounded", "||u_{b-1}|| <= max_i ||sbar_i||", torch.cat(obs, 1), torch.cat(rhs, 1))
    ]


def query_norms(t: Trace) -> list[Bound]:
    """cor:app_query_norm_bound: ||q_b|| <= ||w_b|| + ||Q_cur|| R_s + lambda ||Q_ctx|| ||e|| + ||Q_dep|| R_s with
    R_s = max(||s_entry||, max_i ||sbar_i||) per sample."""
    m, c = t.memory, t.config
    Q_cur, Q_dep = opnorm(m.Q_cur.detach())[:, None], opnorm(m.Q_dep.detach())[:, None]
    Q_ctx = R_e = 0.0
    if c.lambda_ctx:
        Q_ctx, R_e = opnorm(m.Q_ctx.detach())[:, None], vnorm(t.instruction.detach())[:, None]
    obs, rhs = [], []
    for b, route in t.routes.items():
        R_s = vnorm(t.entry_state(b).detach())
        if route.u is not None:
            R_s = torch.maximum(R_s, vnorm(t.summaries(b).detach()).max(dim=-1).values)
        R_w = vnorm(m.block_prior.detach()[:, b])[:, None]
        obs.append(vnorm(route.q.detach()))
        rhs.append(query_norm_bound(R_w, Q_cur, R_s, c.lambda_ctx, Q_ctx, R_e, Q_dep))
    return [
        Bound(
            "cor:app_query_norm_bound",
            "||q_b|| <= R_w + ||Q_cur|| R_s + lambda ||Q_ctx|| R_e + ||Q_dep|| R_s",
            torch.cat(obs, 1),
            torch.cat(rhs, 1),
        )
    ]


def normalised_vectors(t: Trace) -> list[torch.Tensor]:
    """Every vector the router RMS-normalises in this forward, each (E, n, d_k): q, keys, Q_dep,q q0, Q_dep,k sbar_i,
    R_ctx e (Assumption 3's region)."""
    m, c = t.memory, t.config
    vecs = [m.keys.detach()]
    for b, route in t.routes.items():
        vecs.append(route.q.detach())
        if route.u is not None:
            vecs.append(route.q0.detach() @ m.Q_dep_q.detach().transpose(1, 2))
            E, N, P, r = t.summaries(b).shape
            vecs.append(t.summaries(b).detach().reshape(E, N * P, r) @ m.Q_dep_k.detach().transpose(1, 2))
    if c.tau_lang:
        vecs.append(t.instruction.detach().unsqueeze(1) @ m.R_ctx.detach().transpose(1, 2))  # (E, 1, d_k)
    return vecs


def rmsnorm_jacobians(t: Trace) -> list[Bound]:
    """lem:app_rmsnorm_jacobian: ||J_RMSNorm(x)|| (autograd through routing.rmsnorm) <= 1/RMS_eps(x) <= 1/rho_min over
    every vector the router normalised (rho_min per member)."""
    eps = t.config.rms_eps
    vecs = normalised_vectors(t)
    rho_min = torch.stack([rms_eps(v, eps).min(dim=1).values for v in vecs]).min(0).values  # (E,)
    obs, own, glob = [], [], []
    for v in vecs:
        E, n, d = v.shape
        J = autograd_jacobian(lambda z: rmsnorm(z, eps), v.reshape(E * n, d)).reshape(E, n, d, d)
        obs.append(opnorm(J))
        own.append(1 / rms_eps(v, eps))
        glob.append((1 / rho_min)[:, None].expand(E, n))
    obs = torch.cat(obs, 1)
    return [
        Bound("lem:app_rmsnorm_jacobian", "||J_RMSNorm(x)|| <= 1 / RMS_eps(x)", obs, torch.cat(own, 1)),
        Bound("lem:app_rmsnorm_jacobian", "||J_RMSNorm(x)|| <= 1 / rho_min", obs, torch.cat(glob, 1)),
    ]


def softmax_jacobians(t: Trace) -> list[Bound]:
    """lem:app_softmax_jacobian: ||J|| <= 1/2 for the top-k router (autograd through routing.topk_softmax at the
    fused logits) and for the depth attention (torch softmax at log beta, which has beta's Jacobian)."""
    k = t.config.top_k
    obs = []
    for route in t.routes.values():
        z = route.logits.detach()
        E, N, M = z.shape
        J = autograd_jacobian(lambda z_: topk_softmax(z_, k), z.reshape(E * N, M))
        obs.append(opnorm(J).reshape(E, N))
        if route.beta is not None:
            logb = route.beta.detach().log()
            J = autograd_jacobian(lambda z_: z_.softmax(dim=-1), logb.reshape(E * N, -1))
            obs.append(opnorm(J).reshape(E, N))
    obs = torch.cat(obs, 1)
    return [Bound("lem:app_softmax_jacobian", "||J_softmax(z)|| <= 1/2", obs, torch.full_like(obs, 0.5))]
