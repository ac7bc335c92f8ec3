"""The paper's theory as numbers (Section 5 and the appendix "Additional Theoretical Analysis").

For every norm and Lipschitz statement this module computes, on the code that runs, the observed quantity and the
statement's right-hand side. tests/properties (hypothesis checks of every statement) and `qlbench verify` (a
trained model over its target test set) share it, so a bound checked in CI is the bound verify reports.

- Observed quantities come from the real forward: the Route of every block (ctx.scratch["queryable"]), and every
  QueryableLinear's input x, rank state s = A x, routed operator S_b and output, recorded by `trace`.
  Delta W^l is read off the real layer by feeding it basis vectors (`update_matrix`), never rebuilt from the formula.
- Right-hand sides are computed from the actual inputs, tight as stated, never padded: R_C = max_m ||C_m||,
  R_s = the largest norm among the summaries (and the entry state) the statement involves, rho_min = the smallest
  RMS_eps(x) = sqrt(mean(x^2) + eps) among the vectors that the statement's chain RMS-normalises.
- All matrix norms are spectral (operator 2-norms), as in the paper.

Paper -> code indexing: the paper's block b = 1..B is the code's block index b - 1, so the number of completed blocks
(b - 1) is the code's block index.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from qlbench.adapters.queryable import QueryableConfig, QueryableLinear, QueryableMemory, RoutingState
from qlbench.adapters.routing import Route, rmsnorm, topk_softmax
from qlbench.stacked import ForwardContext, rank_project

# The QueryableLinear method that applies the routed update: (x, s = A x, S) -> W0 x + b0 + s B (s + g S s).
UPDATE_METHOD = "routed_update"

# "holds" means observed <= bound * (1 + REL_TOL) (+ ABS_TOL * scale): float64 rounding of a few SVDs and sums.
REL_TOL = 1024 * torch.finfo(torch.float64).eps


# ---------------------------------------------------------------------------------------------------------------
# Small helpers

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
    return eye / r - x.unsqueeze(-1) * x.unsqueeze(-2) / (d * r ** 3)


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


def state_prior_tradeoff(alpha_active: torch.Tensor, zeta_active: torch.Tensor,
                         log_pi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    return 0.5 * n_done ** 0.5 * Q_dep_q_norm * lambda_ctx * Q_ctx_norm / (t_dep * rho_min)


def query_lipschitz(n_done, R_s, Q_dep_norm, Q_dep_q_norm, lambda_ctx, Q_ctx_norm, t_dep, rho_min):
    """eq:app_query_lipschitz_constant: L_q = lambda ||Q_ctx|| (1 + (b-1) R_s ||Q_dep|| ||Q_dep,q|| / (2 T_dep rho))."""
    return lambda_ctx * Q_ctx_norm * (1 + n_done * R_s * Q_dep_norm * Q_dep_q_norm / (2 * t_dep * rho_min))


def router_lipschitz(k, rho_min, L_q, t_attn, tau_lang, R_ctx_norm, t_lang):
    """eq:app_router_lipschitz_constant: L_alpha = sqrt(k) / (2 rho) (L_q / T_attn + tau ||R_ctx|| / T_lang)."""
    return k ** 0.5 / (2 * rho_min) * (L_q / t_attn + tau_lang * R_ctx_norm / t_lang)


# ---------------------------------------------------------------------------------------------------------------
# Reading the real model: one traced forward

@dataclass
class LayerCall:
    """One QueryableLinear application in a traced forward (q, k and v of a block each get their own)."""

    name: str
    layer: QueryableLinear
    x: torch.Tensor  # (E, N, [T,] d_in) the layer's input
    s: torch.Tensor  # (E, N, [T,] r) its rank state A x, as the layer computed it
    S: torch.Tensor  # (E, N, r, r) the routed operator it used
    out: torch.Tensor  # (E, N, [T,] d_out) its output W0 x + b0 + Delta W x

    @property
    def role(self) -> str:
        """The projection of a Transformer layer (q, k, v, o, ... from layers.3.q), or hidden for an MLP layer."""
        last = self.name.rsplit(".", 1)[-1]
        return "hidden" if last.isdigit() else last


@dataclass
class Trace:
    """Everything one forward computed that the theory talks about."""

    memory: QueryableMemory
    config: QueryableConfig
    instruction: torch.Tensor | None  # (E, d_c)
    output: torch.Tensor
    state: RoutingState
    calls: list[LayerCall] = field(default_factory=list)

    @property
    def routes(self) -> dict[int, Route]:
        return self.state.routes

    def entry_state(self, block: int) -> torch.Tensor:
        """s_entry of a block (E, N, r): the first recorded rank state of the block (its entry layer)."""
        return self.state.states[block][0]

    def summaries(self, block: int) -> torch.Tensor | None:
        """(E, N, block, r) block means sbar_i of the completed blocks, as the router received them."""
        return self.state.summaries(block)


def queryable_layers(model: torch.nn.Module) -> list[tuple[str, QueryableLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QueryableLinear)]


def memory_of(model: torch.nn.Module) -> QueryableMemory:
    try:
        memory = model.shared["queryable"]
    except (AttributeError, KeyError):
        raise ValueError("model has no queryable adapter (no shared['queryable'] memory)") from None
    return memory


def _update_fn(layer: QueryableLinear):
    return getattr(type(layer), UPDATE_METHOD).__get__(layer)


@contextmanager
def _recording(model: torch.nn.Module, calls: list[LayerCall]):
    """Record every QueryableLinear update call (instance-level wrapper; removed on exit)."""
    layers = queryable_layers(model)
    for name, layer in layers:
        def record(x, s, S, _name=name, _layer=layer, _fn=_update_fn(layer)):
            out = _fn(x, s, S)
            calls.append(LayerCall(_name, _layer, x, s, S, out))
            return out
        object.__setattr__(layer, UPDATE_METHOD, record)
    try:
        yield
    finally:
        for _, layer in layers:
            layer.__dict__.pop(UPDATE_METHOD, None)


def trace(model: torch.nn.Module, x: torch.Tensor, instruction: torch.Tensor | None = None) -> Trace:
    """Run model(x) once with a fresh ForwardContext and record routes, rank states and every adapted layer call.

    The forward is the model's own (autograd stays on, so tests can backpropagate through the recorded tensors)."""
    memory = memory_of(model)
    ctx = ForwardContext(model.shared, instruction)
    calls: list[LayerCall] = []
    with _recording(model, calls):
        out = model(x, instruction, ctx=ctx)
    return Trace(memory, memory.config, instruction, out, ctx.scratch["queryable"], calls)


def update_apply(layer: QueryableLinear, x: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """Delta W x as the real layer computes it for input x (E, N, [T,] d_in) and routed operator S (E, N, r, r)."""
    return _update_fn(layer)(x, rank_project(x, layer.queryable_A), S) - layer.base(x)


def update_matrix(layer: QueryableLinear, S: torch.Tensor, basis: torch.Tensor | None = None) -> torch.Tensor:
    """Delta W (E, N, d_out, n) applied to the columns of `basis` (E, d_in, n), read off the real layer.

    basis None: the identity, i.e. the full matrix Delta W. `row_space_basis(layer)` gives Delta W's norm from only
    r columns: exact for any update that reads x through A x only (tests/properties check the two agree)."""
    E, N = S.shape[:2]
    d_in = layer.base.d_in
    if basis is None:
        basis = torch.eye(d_in, dtype=S.dtype, device=S.device).expand(E, d_in, d_in)
    x = basis.transpose(1, 2).unsqueeze(1).expand(E, N, basis.shape[2], d_in)  # (E, N, n, d_in): columns as tokens
    return update_apply(layer, x, S).transpose(-1, -2)


def row_space_basis(layer: QueryableLinear) -> torch.Tensor:
    """(E, d_in, r) orthonormal columns spanning the row space of A (Delta W = Delta W Q Q^T)."""
    return torch.linalg.qr(layer.queryable_A.detach().transpose(1, 2)).Q


def gate(layer: QueryableLinear) -> torch.Tensor:
    """g_l = sigmoid(eta_l) per member (E,)."""
    return torch.sigmoid(layer.queryable_eta.detach())


# ---------------------------------------------------------------------------------------------------------------
# One statement over many items: the observed values and the right-hand sides

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
        obs = self.observed.detach().to(torch.float64)
        flat = lambda v: torch.broadcast_to(torch.as_tensor(v).detach().to(torch.float64), obs.shape).reshape(-1)
        self.bound, self.scale, self.observed = flat(self.bound), flat(self.scale), obs.reshape(-1)

    def extend(self, other: Bound) -> Bound:
        return Bound(self.label, self.quantity, torch.cat([self.observed, other.observed]),
                     torch.cat([self.bound, other.bound]), torch.cat([self.scale, other.scale]),
                     self.note or other.note)

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
            return dict(label=self.label, quantity=self.quantity, items=0, observed=None, bound=None, ratio=None,
                        max_observed=None, status="n/a", note=self.note or "no items")
        r = self.ratios()
        i = int(torch.nan_to_num(r, nan=math.inf).argmax())
        vacuous = bool((self.bound == 0).all() and (self.observed == 0).all())
        status = "holds" if self.holds() else "VIOLATED"
        note = self.note or ("vacuous: both sides are 0" if vacuous else "")
        return dict(label=self.label, quantity=self.quantity, items=self.items, observed=float(self.observed[i]),
                    bound=float(self.bound[i]), ratio=float(r[i]), max_observed=float(self.observed.max()),
                    status=status, note=note)


# Report order: the paper's order of statements, and within one statement the order of its proof.
STATEMENTS = ("prop:app_convex_hull_bound", "cor:app_update_norm_bound", "prop:app_depth_summary_bounded",
              "cor:app_query_norm_bound", "lem:app_rmsnorm_jacobian", "lem:app_softmax_jacobian",
              "prop:app_summary_lipschitz", "prop:app_router_operator_lipschitz",
              "thm:app_attention_projection_norm_stability")
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
    return [Bound("prop:app_convex_hull_bound", "||S_b|| <= sum_m alpha_m ||C_m||", obs, mid),
            Bound("prop:app_convex_hull_bound", "||S_b|| <= max_m ||C_m|| = R_C", obs, top)]


def _statement_for(call: LayerCall) -> str:
    return ("thm:app_attention_projection_norm_stability" if call.role in ("q", "k", "v", "o")
            else "cor:app_update_norm_bound")


def layer_updates(t: Trace, *, full_matrix: bool = False) -> list[Bound]:
    """cor:app_update_norm_bound (thm:app_attention_projection_norm_stability for q, k, v, o), per layer and sample:
    ||Delta W|| <= s ||B|| (1 + g R_C) ||A||, the uniform s R_B (1 + R_C) R_A, and the vector form on the layer's
    actual inputs ||Delta W x|| <= s ||B|| (1 + g R_C) ||A|| ||x||."""
    R_C = atom_radius(t.memory)  # (E,)
    layers = {c.name: c.layer for c in t.calls}
    R_A = torch.stack([opnorm(l.queryable_A.detach()) for l in layers.values()]).max(0).values
    R_B = torch.stack([opnorm(l.queryable_B.detach()) for l in layers.values()]).max(0).values
    out = []
    for c in t.calls:
        L = c.layer
        A_n, B_n, g = opnorm(L.queryable_A.detach()), opnorm(L.queryable_B.detach()), gate(L)
        rhs = layer_update_bound(L.scale, B_n, g, R_C, A_n)[:, None]  # (E, 1)
        basis = None if full_matrix else row_space_basis(L)
        W_norm = opnorm(update_matrix(L, c.S.detach(), basis).detach())  # (E, N)
        label = _statement_for(c)
        role = f" [{c.role}]" if c.role != "hidden" else ""
        out.append(Bound(label, f"||Delta W^l||{role} <= s ||B|| (1 + g R_C) ||A||", W_norm, rhs.expand_as(W_norm)))
        uniform = (L.scale * R_B * (1 + R_C) * R_A)[:, None]
        out.append(Bound(label, f"||Delta W^l||{role} <= s R_B (1 + R_C) R_A", W_norm, uniform.expand_as(W_norm)))
        dWx = vnorm((c.out - L.base(c.x)).detach())  # (E, N, [T])
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
        return [Bound("prop:app_depth_summary_bounded", "||u_{b-1}|| <= max_i ||sbar_i||", torch.zeros(0),
                      torch.zeros(0), note="single block: u = 0")]
    return [Bound("prop:app_depth_summary_bounded", "||u_{b-1}|| <= max_i ||sbar_i||", torch.cat(obs, 1),
                  torch.cat(rhs, 1))]


def query_norms(t: Trace) -> list[Bound]:
    """cor:app_query_norm_bound: ||q_b|| <= ||w_b|| + ||Q_cur|| R_s + lambda ||Q_ctx|| ||e|| + ||Q_dep|| R_s with
    R_s = max(||s_entry||, max_i ||sbar_i||) per sample."""
    m, c = t.memory, t.config
    Q_cur, Q_dep = opnorm(m.Q_cur.detach())[:, None], opnorm(m.Q_dep.detach())[:, None]
    ctx = 0.0
    if c.lambda_ctx:
        ctx = c.lambda_ctx * opnorm(m.Q_ctx.detach())[:, None] * vnorm(t.instruction.detach())[:, None]
    obs, rhs = [], []
    for b, route in t.routes.items():
        R_s = vnorm(t.entry_state(b).detach())
        if route.u is not None:
            R_s = torch.maximum(R_s, vnorm(t.summaries(b).detach()).max(dim=-1).values)
        R_w = vnorm(m.block_prior.detach()[:, b])[:, None]
        obs.append(vnorm(route.q.detach()))
        rhs.append(R_w + Q_cur * R_s + ctx + Q_dep * R_s)
    return [Bound("cor:app_query_norm_bound", "||q_b|| <= R_w + ||Q_cur|| R_s + lambda ||Q_ctx|| R_e + ||Q_dep|| R_s",
                  torch.cat(obs, 1), torch.cat(rhs, 1))]


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
    return [Bound("lem:app_rmsnorm_jacobian", "||J_RMSNorm(x)|| <= 1 / RMS_eps(x)", obs, torch.cat(own, 1)),
            Bound("lem:app_rmsnorm_jacobian", "||J_RMSNorm(x)|| <= 1 / rho_min", obs, torch.cat(glob, 1))]


def softmax_jacobians(t: Trace) -> list[Bound]:
    """lem:app_softmax_jacobian: ||J|| <= 1/2 for the top-k router (autograd through routing.topk_softmax at the
    fused logits) and for the depth attention (torch softmax at log beta, which has beta's Jacobian)."""
    k = t.config.top_k
    obs = []
    for route in t.routes.values():
        z = route.logits.detach()
        E, N, M = z.shape
        J = autograd_jacobian(lambda l: topk_softmax(l, k), z.reshape(E * N, M))
        obs.append(opnorm(J).reshape(E, N))
        if route.beta is not None:
            logb = route.beta.detach().log()
            J = autograd_jacobian(lambda l: l.softmax(dim=-1), logb.reshape(E * N, -1))
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


def lipschitz(t: Trace, e2: torch.Tensor) -> list[Bound]:
    """prop:app_summary_lipschitz, prop:app_router_operator_lipschitz and the attention-projection stability bound
    of thm:app_attention_projection_norm_stability, between the traced instruction e and e2, per block and sample,
    states held fixed, on pairs whose top-k active set is unchanged (Assumption 4).

    rho_min is the smallest RMS_eps among the vectors the statement's chain normalises at e and e'
    (prop 11: Q_dep,q q0; prop 12: also q and R_ctx e); R_s = max_i ||sbar_i||; R_C = max_m ||C_m||."""
    m, c = t.memory, t.config
    e1 = t.instruction
    if e1 is None:  # no instruction channels: nothing depends on e (every statement is 0 <= 0)
        return []
    eps, k = c.rms_eps, c.top_k
    de = vnorm((e1 - e2).detach())[:, None]  # (E, 1)
    lam, tau = c.lambda_ctx, c.tau_lang
    Q_ctx = opnorm(m.Q_ctx.detach())[:, None] if m.Q_ctx is not None else torch.zeros_like(de)
    R_ctx = opnorm(m.R_ctx.detach())[:, None] if m.R_ctx is not None else torch.zeros_like(de)
    Q_dep, Q_dep_q = opnorm(m.Q_dep.detach())[:, None], opnorm(m.Q_dep_q.detach())[:, None]
    R_C = atom_radius(m)[:, None]
    rho_lang = torch.full_like(de, math.inf)
    if tau:
        rho_lang = torch.minimum(*(rms_eps(e.unsqueeze(1) @ m.R_ctx.detach().transpose(1, 2), eps) for e in (e1, e2)))
    layers_of = {}
    for call in t.calls:
        layers_of.setdefault(call.layer.block, []).append(call)
    B: list[Bound] = []
    for p in probe_routes(t, e2):
        keep = p.same_active_set  # (E, N)
        r1, r2, n_done = p.r1, p.r2, p.block
        if n_done:
            R_s = vnorm(p.summaries).max(dim=-1).values  # (E, N)
            rho11 = torch.minimum(*(rms_eps(r.q0 @ m.Q_dep_q.detach().transpose(1, 2), eps) for r in (r1, r2)))
        else:
            R_s = torch.zeros_like(keep, dtype=de.dtype)
            rho11 = torch.full_like(R_s, math.inf)
        rho12 = torch.minimum(torch.minimum(rho11, rho_lang),
                              torch.minimum(rms_eps(r1.q, eps), rms_eps(r2.q, eps)))
        if n_done:
            L_u = summary_lipschitz(n_done, R_s, Q_dep_q, lam, Q_ctx, c.t_dep, rho11)
            B.append(Bound("prop:app_summary_lipschitz", "||u(e) - u(e')|| <= L_u ||e - e'||",
                           vnorm(r1.u - r2.u), L_u * de, vnorm(r1.u) + vnorm(r2.u)))
            L_xi = depth_logit_lipschitz(Q_dep_q, lam, Q_ctx, c.t_dep, rho11)
            B.append(Bound("prop:app_summary_lipschitz",
                           "|xi_i - xi_j|(e) - (e') <= 2 L_xi ||e - e'|| (proof step, xi = log beta + const)",
                           depth_logit_spread(r1.beta, r2.beta), 2 * L_xi * de,
                           (r1.beta.log().abs() + r2.beta.log().abs()).amax(-1)))
            L_beta = depth_weight_lipschitz(n_done, Q_dep_q, lam, Q_ctx, c.t_dep, rho11)
            B.append(Bound("prop:app_summary_lipschitz", "||beta(e) - beta(e')|| <= L_beta ||e - e'|| (proof step)",
                           vnorm(r1.beta - r2.beta), L_beta * de, 2.0))
        L_q11 = query_lipschitz(n_done, R_s, Q_dep, Q_dep_q, lam, Q_ctx, c.t_dep, rho11)
        B.append(Bound("prop:app_summary_lipschitz", "||q(e) - q(e')|| <= L_q ||e - e'||", vnorm(r1.q - r2.q),
                       L_q11 * de, vnorm(r1.q) + vnorm(r2.q)))
        # prop 12: one rho_min for the whole chain, as stated
        L_q = query_lipschitz(n_done, R_s, Q_dep, Q_dep_q, lam, Q_ctx, c.t_dep, rho12)
        L_a = router_lipschitz(k, rho12, L_q, c.t_attn, tau, R_ctx, c.t_lang)
        B.append(Bound("prop:app_router_operator_lipschitz",
                       "|zeta_m(e) - zeta_m(e')| <= L_q / (T_attn rho_min) ||e - e'|| (proof step)",
                       (r1.zeta - r2.zeta).abs().amax(-1)[keep], (L_q / (c.t_attn * rho12) * de)[keep],
                       (r1.zeta.abs() + r2.zeta.abs()).amax(-1)[keep]))
        if tau:
            B.append(Bound("prop:app_router_operator_lipschitz",
                           "|rho_m(e) - rho_m(e')| <= ||R_ctx|| / (T_lang rho_min) ||e - e'|| (proof step)",
                           (r1.rho - r2.rho).abs().amax(-1).expand_as(keep)[keep],
                           (R_ctx / (c.t_lang * rho12) * de)[keep],
                           (r1.rho.abs() + r2.rho.abs()).amax(-1).expand_as(keep)[keep]))
        B.append(Bound("prop:app_router_operator_lipschitz", "||alpha_I(e) - alpha_I(e')|| <= L_alpha ||e - e'||",
                       vnorm(r1.alpha - r2.alpha)[keep], (L_a * de)[keep],
                       (r1.logits.abs() + r2.logits.abs()).amax(-1)[keep]))
        L_S = R_C * k ** 0.5 * L_a
        B.append(Bound("prop:app_router_operator_lipschitz",
                       "||S_b(e) - S_b(e')|| <= R_C sqrt(k) L_alpha ||e - e'||",
                       opnorm(r1.S - r2.S)[keep], (L_S * de)[keep],
                       (R_C * (1 + (r1.logits.abs() + r2.logits.abs()).amax(-1)))[keep]))
        for call in layers_of.get(p.block, []):
            L = call.layer
            coef = L.scale * opnorm(L.queryable_B.detach()) * gate(L) * opnorm(L.queryable_A.detach())  # (E,)
            with torch.no_grad():
                u1, u2 = update_apply(L, call.x, r1.S), update_apply(L, call.x, r2.S)  # (E, N, [T,] d_out)
                basis = row_space_basis(L)
                M1, M2 = update_matrix(L, r1.S, basis), update_matrix(L, r2.S, basis)  # (E, N, d_out, r)
                base = opnorm(L.base.weight) + vnorm(L.base.bias)  # (E,) rounding of the frozen path, subtracted
            x_n = vnorm(call.x.detach())
            extra = (1,) * (x_n.dim() - 2)
            rhs = (coef[:, None] * L_S * de)  # (E, N)
            B.append(Bound("prop:app_router_operator_lipschitz",
                           "||Delta W^l(e) x - Delta W^l(e') x|| <= s ||B|| g ||A|| R_C sqrt(k) L_alpha ||e - e'|| ||x||",
                           vnorm(u1 - u2)[keep], (rhs.view(*rhs.shape, *extra) * x_n)[keep],
                           (vnorm(u1) + vnorm(u2) + 2 * base.view(-1, 1, *extra) * (1 + x_n))[keep]))
            if call.role in ("q", "k", "v", "o"):
                B.append(Bound("thm:app_attention_projection_norm_stability",
                               f"||Delta W^p(e) - Delta W^p(e')|| [{call.role}] <= s ||B^p|| g^p ||A^p|| R_C sqrt(k) "
                               f"L_alpha ||e - e'||", opnorm(M1 - M2)[keep], rhs[keep],
                               (opnorm(M1) + opnorm(M2) + 2 * base[:, None])[keep]))
    return _merge(B)


# ---------------------------------------------------------------------------------------------------------------
# Everything, over a data set

NORM_STATEMENTS = (convex_hull, layer_updates, depth_summaries, query_norms, rmsnorm_jacobians, softmax_jacobians)


def probe_instruction(e: torch.Tensor, generator: torch.Generator, rel: float = 1e-3) -> torch.Tensor:
    """e' = e + delta, a random direction per member with ||delta|| = rel * max(1, ||e||)."""
    d = torch.randn(e.shape, generator=generator, dtype=e.dtype).to(e.device)
    d = d / vnorm(d)[:, None] * (rel * vnorm(e).clamp(min=1))[:, None]
    return e + d


def check_model(model: torch.nn.Module, x: torch.Tensor, instruction: torch.Tensor | None = None, *,
                chunk: int = 200, seed: int = 0) -> list[Bound]:
    """Every norm and Lipschitz statement over the samples x (E, N, ...) in float64 (a float64 copy of the weights
    is made in place: pass a model you no longer train). Lipschitz statements probe e' = e + delta per chunk."""
    model.double()
    x = x.to(torch.float64)
    if instruction is not None:
        instruction = instruction.to(torch.float64)
    g = torch.Generator().manual_seed(seed)
    out: list[Bound] = []
    with torch.no_grad():
        for i in range(0, x.shape[1], chunk):
            t = trace(model, x[:, i:i + chunk], instruction)
            for fn in NORM_STATEMENTS:
                out += fn(t)
            if instruction is not None:
                out += lipschitz(t, probe_instruction(instruction, g))
    return _merge(out)

