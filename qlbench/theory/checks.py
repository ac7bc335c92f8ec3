"""The checks `qlbench verify` reports: every norm and Lipschitz statement of the paper, observed on a traced
forward of the real model (qlbench.theory.tracing) against its right-hand side (qlbench.theory.formulas).

Right-hand sides are computed from the actual inputs, tight as stated, never padded: R_C = max_m ||C_m||,
R_s = the largest norm among the summaries (and the entry state) the statement involves, rho_min = the smallest
RMS_eps(x) = sqrt(mean(x^2) + eps) among the vectors that the statement's chain RMS-normalises.

Longer than 500 lines: one check per statement of the paper, kept in one module so they read in the paper's order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qlbench.adapters.queryable import QueryableMemory
from qlbench.adapters.routing import Route, rmsnorm, topk_softmax
from qlbench.theory.formulas import (
    active_set,
    autograd_jacobian,
    depth_logit_lipschitz,
    depth_logit_spread,
    depth_weight_lipschitz,
    layer_update_bound,
    operator_lipschitz,
    opnorm,
    prior_logit_lipschitz,
    query_lipschitz,
    query_norm_bound,
    rms_eps,
    router_lipschitz,
    state_logit_lipschitz,
    summary_lipschitz,
    uniform_update_bound,
    update_lipschitz,
    vnorm,
)
from qlbench.theory.tracing import LayerCall, Trace, gate, row_space_basis, trace, update_apply, update_matrix

# "holds" means observed <= bound * (1 + REL_TOL) (+ ABS_TOL * scale): float64 rounding of a few SVDs and sums.
REL_TOL = 1024 * torch.finfo(torch.float64).eps


@dataclass
class Bound:
    """A statement `observed <= bound` checked on many items (samples x blocks x layers ...)."""

    label: str  # the paper's label
    quantity: str  # what is bounded, in words
    observed: torch.Tensor  # (n,)
    bound: torch.Tensor  # (n,)
    scale: torch.Tensor | float = 0.0  # (n,) size of the operands when `observed` is a difference (rounding)
    note: str = ""

    def __post_init__(self):
        # on the CPU in float64, whatever device the model ran on (a float scale is a CPU tensor)
        obs = self.observed.detach().to("cpu", torch.float64)
        flat = lambda v: torch.broadcast_to(torch.as_tensor(v).detach().to("cpu", torch.float64), obs.shape).reshape(-1)
        self.bound, self.scale, self.observed = flat(self.bound), flat(self.scale), obs.reshape(-1)

    def extend(self, other: Bound) -> Bound:
        return Bound(
            self.label,
            self.quantity,
            torch.cat([self.observed, other.observed]),
            torch.cat([self.bound, other.bound]),
            torch.cat([self.scale, other.scale]),
            self.note or other.note,
        )

    @property
    def items(self) -> int:
        return self.observed.numel()

    def slack(self) -> torch.Tensor:
        """bound + REL_TOL * (|bound| + |observed| + scale) - observed, per item (>= 0 where the statement holds)."""
        return self.bound + REL_TOL * (self.bound.abs() + self.observed.abs() + self.scale) - self.observed

    def violations(self) -> torch.Tensor:
        return (self.slack() < 0) | ~torch.isfinite(self.observed) | torch.isnan(self.bound)

    def holds(self) -> bool:
        return not bool(self.violations().any())

    def ratios(self) -> torch.Tensor:
        """observed / bound per item (0 where both are 0)."""
        r = self.observed / self.bound
        return torch.where((self.observed == 0) & (self.bound == 0), torch.zeros_like(r), r)

    def summary(self) -> dict:
        """Worst item (largest observed / bound): its observed value, bound and ratio; plus the overall maxima."""
        if self.items == 0:
            return dict(
                label=self.label,
                quantity=self.quantity,
                items=0,
                observed=None,
                bound=None,
                ratio=None,
                max_observed=None,
                status="n/a",
                note=self.note or "no items",
            )
        r = self.ratios()
        i = int(torch.nan_to_num(r, nan=math.inf).argmax())
        vacuous = bool((self.bound == 0).all() and (self.observed == 0).all())
        status = "holds" if self.holds() else "VIOLATED"
        note = self.note or ("vacuous: both sides are 0" if vacuous else "")
        return dict(
            label=self.label,
            quantity=self.quantity,
            items=self.items,
            observed=float(self.observed[i]),
            bound=float(self.bound[i]),
            ratio=float(r[i]),
            max_observed=float(self.observed.max()),
            status=status,
            note=note,
        )


# Report order: the paper's order of statements, and within one statement the order of its proof.
STATEMENTS = (
    "prop:app_convex_hull_bound",
    "cor:app_update_norm_bound",
    "prop:app_depth_summary_bounded",
    "cor:app_query_norm_bound",
    "lem:app_rmsnorm_jacobian",
    "lem:app_softmax_jacobian",
    "prop:app_summary_lipschitz",
    "prop:app_router_operator_lipschitz",
    "thm:app_attention_projection_norm_stability",
)
_QUANTITY_ORDER = ("||u(", "|xi_i", "||beta(", "||q(", "|zeta", "|rho", "||alpha", "||S_b(e)", "||Delta W^l(e)")


def _rank(b: Bound) -> tuple[int, int]:
    label = STATEMENTS.index(b.label) if b.label in STATEMENTS else len(STATEMENTS)
    q = next((i for i, key in enumerate(_QUANTITY_ORDER) if b.quantity.startswith(key)), -1)
    return label, q


def _merge(bounds: list[Bound]) -> list[Bound]:
    """Pool the items of equal statements (label and quantity), in report order."""
    out: dict[tuple[str, str], Bound] = {}
    for b in bounds:
        key = (b.label, b.quantity)
        out[key] = out[key].extend(b) if key in out else b
    return sorted(out.values(), key=_rank)


# ---------------------------------------------------------------------------------------------------------------
# Norm statements on a trace


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


# ---------------------------------------------------------------------------------------------------------------
# Lipschitz statements in the instruction embedding e, with the block's states held fixed (their premise)


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


# ---------------------------------------------------------------------------------------------------------------
# Everything, over a data set

NORM_STATEMENTS = (convex_hull, layer_updates, depth_summaries, query_norms, rmsnorm_jacobians, softmax_jacobians)


def perturbed_instruction(e: torch.Tensor, generator: torch.Generator, rel: float = 1e-3) -> torch.Tensor:
    """e' = e + delta, a random direction per member with ||delta|| = rel * max(1, ||e||)."""
    d = torch.randn(e.shape, generator=generator, dtype=e.dtype).to(e.device)
    d = d / vnorm(d)[:, None] * (rel * vnorm(e).clamp(min=1))[:, None]
    return e + d


def check_model(
    model: torch.nn.Module,
    x: torch.Tensor,
    instruction: torch.Tensor | None = None,
    *,
    chunk: int = 200,
    seed: int = 0,
    tracer: Callable[..., Trace] = trace,
) -> list[Bound]:
    """Every norm and Lipschitz statement over the samples x (E, N, ...) in float64 (a float64 copy of the weights
    is made in place: pass a model you no longer train). Lipschitz statements probe e' = e + delta per chunk.
    `tracer(model, x_chunk, instruction)` traces one forward (a peft-wrapped model: qlbench.hf.verify)."""
    model.double()
    x = x.to(torch.float64)
    if instruction is not None:
        instruction = instruction.to(torch.float64)
    g = torch.Generator().manual_seed(seed)
    out: list[Bound] = []
    with torch.no_grad():
        for i in range(0, x.shape[1], chunk):
            t = tracer(model, x[:, i : i + chunk], instruction)
            for fn in NORM_STATEMENTS:
                out += fn(t)
            if instruction is not None:
                out += lipschitz(t, perturbed_instruction(instruction, g))
    return _merge(out)
