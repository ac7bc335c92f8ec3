"""The Lipschitz statements of the paper in the instruction embedding e, with the block's states held fixed (their
premise): the depth summary and query, the router and routed operator, and the routed layer updates.

Right-hand sides are computed from the actual inputs, tight as stated, never padded: R_C = max_m ||C_m||,
R_s = max_i ||sbar_i||, rho_min = the smallest RMS_eps(x) = sqrt(mean(x^2) + eps) among the vectors that the
statement's chain RMS-normalises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qlbench.adapters.routing import Route
from qlbench.theory.bounds import Bound, _merge
from qlbench.theory.formulas import (
    active_set,
    depth_logit_lipschitz,
    depth_logit_spread,
    depth_weight_lipschitz,
    operator_lipschitz,
    opnorm,
    prior_logit_lipschitz,
    query_lipschitz,
    rms_eps,
    router_lipschitz,
    state_logit_lipschitz,
    summary_lipschitz,
    update_lipschitz,
    vnorm,
)
from qlbench.theory.norm_checks import atom_radius
from qlbench.theory.tracing import LayerCall, Trace, gate, row_space_basis, update_apply, update_matrix


@dataclass
class Probe:
    """Routes of one block at e and e' from the same entry state and completed-block summaries."""

    block: int
    r1: Route
    r2: Route
    summaries: torch.Tensor | None
    same_active_set: torch.Tensor  # (E, N) bool: Assumption 4 holds for the pair


def probe_routes(t: Trace, e2: torch.Tensor) -> list[Probe]:
    """Re-route every block at instruction e2 from the states recorded at e (the real QueryableMemory.route)."""
    probes = []
    k = t.config.top_k
    with torch.no_grad():
        for b, r1 in t.routes.items():
            summ = t.summaries(b)
            r2 = t.memory.route(b, t.entry_state(b), summ, e2)
            same = (active_set(r1.logits, k) == active_set(r2.logits, k)).all(-1)
            probes.append(Probe(b, r1, r2, summ, same))
    return probes


@dataclass
class Constants:
    """The operator norms and distances every Lipschitz statement of one (e, e') pair uses, per member (E, 1)."""

    de: torch.Tensor  # ||e - e'||
    Q_ctx: torch.Tensor
    R_ctx: torch.Tensor
    Q_dep: torch.Tensor
    Q_dep_q: torch.Tensor
    R_C: torch.Tensor  # max_m ||C_m||
    rho_lang: torch.Tensor  # min RMS_eps(R_ctx e) over e, e' (inf when tau_lang = 0)

    @classmethod
    def of(cls, t: Trace, e2: torch.Tensor) -> Constants:
        m, c = t.memory, t.config
        de = vnorm((t.instruction - e2).detach())[:, None]  # (E, 1)
        Q_ctx = opnorm(m.Q_ctx.detach())[:, None] if m.Q_ctx is not None else torch.zeros_like(de)
        R_ctx = opnorm(m.R_ctx.detach())[:, None] if m.R_ctx is not None else torch.zeros_like(de)
        rho_lang = torch.full_like(de, math.inf)
        if c.tau_lang:
            rho_lang = torch.minimum(
                *(rms_eps(e.unsqueeze(1) @ m.R_ctx.detach().transpose(1, 2), c.rms_eps) for e in (t.instruction, e2))
            )
        return cls(
            de,
            Q_ctx,
            R_ctx,
            opnorm(m.Q_dep.detach())[:, None],
            opnorm(m.Q_dep_q.detach())[:, None],
            atom_radius(m)[:, None],
            rho_lang,
        )


@dataclass
class ProbeRadii:
    """One block's radii: R_s = max_i ||sbar_i|| (E, N), and the rho_min of each proposition's chain (E, N)."""

    R_s: torch.Tensor
    rho11: torch.Tensor  # prop:app_summary_lipschitz: Q_dep,q q0 at e and e' (inf for the first block)
    rho12: torch.Tensor  # prop:app_router_operator_lipschitz: also q and R_ctx e (one rho_min for the chain)

    @classmethod
    def of(cls, t: Trace, p: Probe, k: Constants) -> ProbeRadii:
        m, eps = t.memory, t.config.rms_eps
        if p.block:
            R_s = vnorm(p.summaries).max(dim=-1).values  # (E, N)
            rho11 = torch.minimum(*(rms_eps(r.q0 @ m.Q_dep_q.detach().transpose(1, 2), eps) for r in (p.r1, p.r2)))
        else:
            R_s = torch.zeros_like(p.same_active_set, dtype=k.de.dtype)
            rho11 = torch.full_like(R_s, math.inf)
        rho12 = torch.minimum(
            torch.minimum(rho11, k.rho_lang), torch.minimum(rms_eps(p.r1.q, eps), rms_eps(p.r2.q, eps))
        )
        return cls(R_s, rho11, rho12)


def summary_statement(t: Trace, p: Probe, k: Constants, rad: ProbeRadii) -> list[Bound]:
    """prop:app_summary_lipschitz (u, and its proof steps xi and beta, for blocks with completed blocks) and the
    query's Lipschitz constant it implies, with rho_min of the summary chain."""
    c, n_done, r1, r2 = t.config, p.block, p.r1, p.r2
    lam = c.lambda_ctx
    out = []
    if n_done:
        L_u = summary_lipschitz(n_done, rad.R_s, k.Q_dep_q, lam, k.Q_ctx, c.t_dep, rad.rho11)
        out.append(
            Bound(
                "prop:app_summary_lipschitz",
                "||u(e) - u(e')|| <= L_u ||e - e'||",
                vnorm(r1.u - r2.u),
                L_u * k.de,
                vnorm(r1.u) + vnorm(r2.u),
            )
        )
        L_xi = depth_logit_lipschitz(k.Q_dep_q, lam, k.Q_ctx, c.t_dep, rad.rho11)
        out.append(
            Bound(
                "prop:app_summary_lipschitz",
                "|xi_i - xi_j|(e) - (e') <= 2 L_xi ||e - e'|| (proof step, xi = log beta + const)",
                depth_logit_spread(r1.beta, r2.beta),
                2 * L_xi * k.de,
                (r1.beta.log().abs() + r2.beta.log().abs()).amax(-1),
            )
        )
        L_beta = depth_weight_lipschitz(n_done, k.Q_dep_q, lam, k.Q_ctx, c.t_dep, rad.rho11)
        out.append(
            Bound(
                "prop:app_summary_lipschitz",
                "||beta(e) - beta(e')|| <= L_beta ||e - e'|| (proof step)",
                vnorm(r1.beta - r2.beta),
                L_beta * k.de,
                2.0,
            )
        )
    L_q = query_lipschitz(n_done, rad.R_s, k.Q_dep, k.Q_dep_q, lam, k.Q_ctx, c.t_dep, rad.rho11)
    out.append(
        Bound(
            "prop:app_summary_lipschitz",
            "||q(e) - q(e')|| <= L_q ||e - e'||",
            vnorm(r1.q - r2.q),
            L_q * k.de,
            vnorm(r1.q) + vnorm(r2.q),
        )
    )
    return out


def operator_constant(t: Trace, p: Probe, k: Constants, rad: ProbeRadii) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_q, L_alpha) of prop:app_router_operator_lipschitz: one rho_min for the whole chain, as stated."""
    c = t.config
    L_q = query_lipschitz(p.block, rad.R_s, k.Q_dep, k.Q_dep_q, c.lambda_ctx, k.Q_ctx, c.t_dep, rad.rho12)
    return L_q, router_lipschitz(c.top_k, rad.rho12, L_q, c.t_attn, c.tau_lang, k.R_ctx, c.t_lang)


def router_statement(t: Trace, p: Probe, k: Constants, rad: ProbeRadii) -> list[Bound]:
    """prop:app_router_operator_lipschitz for the router: state logits and prior logits (proof steps), routing
    weights alpha and the routed operator S_b, on samples whose active set is unchanged (Assumption 4)."""
    c, r1, r2, keep = t.config, p.r1, p.r2, p.same_active_set
    L_q, L_a = operator_constant(t, p, k, rad)
    out = [
        Bound(
            "prop:app_router_operator_lipschitz",
            "|zeta_m(e) - zeta_m(e')| <= L_q / (T_attn rho_min) ||e - e'|| (proof step)",
            (r1.zeta - r2.zeta).abs().amax(-1)[keep],
            (state_logit_lipschitz(L_q, c.t_attn, rad.rho12) * k.de)[keep],
            (r1.zeta.abs() + r2.zeta.abs()).amax(-1)[keep],
        )
    ]
    if c.tau_lang:
        out.append(
            Bound(
                "prop:app_router_operator_lipschitz",
                "|rho_m(e) - rho_m(e')| <= ||R_ctx|| / (T_lang rho_min) ||e - e'|| (proof step)",
                (r1.rho - r2.rho).abs().amax(-1).expand_as(keep)[keep],
                (prior_logit_lipschitz(k.R_ctx, c.t_lang, rad.rho12) * k.de)[keep],
                (r1.rho.abs() + r2.rho.abs()).amax(-1).expand_as(keep)[keep],
            )
        )
    out.append(
        Bound(
            "prop:app_router_operator_lipschitz",
            "||alpha_I(e) - alpha_I(e')|| <= L_alpha ||e - e'||",
            vnorm(r1.alpha - r2.alpha)[keep],
            (L_a * k.de)[keep],
            (r1.logits.abs() + r2.logits.abs()).amax(-1)[keep],
        )
    )
    out.append(
        Bound(
            "prop:app_router_operator_lipschitz",
            "||S_b(e) - S_b(e')|| <= R_C sqrt(k) L_alpha ||e - e'||",
            opnorm(r1.S - r2.S)[keep],
            (operator_lipschitz(k.R_C, c.top_k, L_a) * k.de)[keep],
            (k.R_C * (1 + (r1.logits.abs() + r2.logits.abs()).amax(-1)))[keep],
        )
    )
    return out


def update_statement(t: Trace, p: Probe, k: Constants, rad: ProbeRadii, call: LayerCall) -> list[Bound]:
    """The routed update of one layer of the block: prop:app_router_operator_lipschitz on Delta W^l x, and, for an
    attention projection, thm:app_attention_projection_norm_stability on the matrix Delta W^p."""
    layer, keep = call.layer, p.same_active_set
    _, L_a = operator_constant(t, p, k, rad)
    B_n, A_n, g = (
        v[:, None] for v in (opnorm(layer.queryable_B.detach()), opnorm(layer.queryable_A.detach()), gate(layer))
    )  # (E, 1) each
    coef = update_lipschitz(layer.scale, B_n, g, A_n, operator_lipschitz(k.R_C, t.config.top_k, L_a))  # (E, N)
    with torch.no_grad():
        u1, u2 = update_apply(layer, call.x, p.r1.S), update_apply(layer, call.x, p.r2.S)  # (E, N, [T,] d_out)
        basis = row_space_basis(layer)
        M1, M2 = update_matrix(layer, p.r1.S, basis), update_matrix(layer, p.r2.S, basis)  # (E, N, d_out, r)
        base = opnorm(layer.base.weight) + vnorm(layer.base.bias)  # (E,) rounding of the frozen path, subtracted
    x_n = vnorm(call.x.detach())
    extra = (1,) * (x_n.dim() - 2)
    rhs = coef * k.de  # (E, N)
    out = [
        Bound(
            "prop:app_router_operator_lipschitz",
            "||Delta W^l(e) x - Delta W^l(e') x|| <= s ||B|| g ||A|| R_C sqrt(k) L_alpha ||e - e'|| ||x||",
            vnorm(u1 - u2)[keep],
            (rhs.view(*rhs.shape, *extra) * x_n)[keep],
            (vnorm(u1) + vnorm(u2) + 2 * base.view(-1, 1, *extra) * (1 + x_n))[keep],
        )
    ]
    if call.role in ("q", "k", "v", "o"):
        out.append(
            Bound(
                "thm:app_attention_projection_norm_stability",
                f"||Delta W^p(e) - Delta W^p(e')|| [{call.role}] <= s ||B^p|| g^p ||A^p|| R_C sqrt(k) "
                f"L_alpha ||e - e'||",
                opnorm(M1 - M2)[keep],
                rhs[keep],
                (opnorm(M1) + opnorm(M2) + 2 * base[:, None])[keep],
            )
        )
    return out


def lipschitz(t: Trace, e2: torch.Tensor) -> list[Bound]:
    """Every Lipschitz statement between the traced instruction e and e2, per block and sample, states held fixed
    (their premise); the router's statements on pairs whose top-k active set is unchanged (Assumption 4)."""
    if t.instruction is None:  # no instruction channels: nothing depends on e (every statement is 0 <= 0)
        return []
    k = Constants.of(t, e2)
    calls_of: dict[int, list[LayerCall]] = {}
    for call in t.calls:
        calls_of.setdefault(call.layer.block, []).append(call)
    bounds: list[Bound] = []
    for p in probe_routes(t, e2):
        rad = ProbeRadii.of(t, p, k)
        bounds += summary_statement(t, p, k, rad) + router_statement(t, p, k, rad)
        for call in calls_of.get(p.block, []):
            bounds += update_statement(t, p, k, rad, call)
    return _merge(bounds)
