"""An independent oracle for Queryable LoRA: Algorithm 2 and the adapted forward pass, written out from the paper.

What it checks. The whole output of a real adapted model (registry build on the real `deep-narrow` and `transformer`
backbones, float64, instruction channels on: instruction_dim = d_c, lambda_ctx > 0, tau_lang > 0) equals, to 1e-10,
a plain re-computation of the paper's equations from the model's own parameters:
  - the router, appendix eqs. app_prequery .. app_active_router: q0 = w + Q_cur s_entry + lambda_ctx Q_ctx e(c);
    beta_i = softmax_i(<RMSNorm(Q_dep,q q0), RMSNorm(Q_dep,k sbar_i)> / (sqrt(d_k) T_dep)), u = sum_i beta_i sbar_i
    (u = 0 for the first block); q = q0 + Q_dep u; zeta_m = <RMSNorm(q), RMSNorm(k_m)> / (sqrt(d_k) T_attn);
    rho_m likewise from R_ctx e(c) with T_lang; fused zeta + tau_lang log softmax(rho); alpha = softmax over the
    top-k fused logits; S_b = sum_m alpha_m C_m;
  - every adapted layer, eq. app_layer_update: y = W0 x + b0 + s B (I_r + g_l S_b) A x, g_l = sigmoid(eta_l),
    s = alpha / r (written as the matrix I_r + g S_b, not as the code's t = s + g S s);
  - the two backbones (GELU MLP; pre-LN Transformer encoder with 4-head attention, FFN, tokens x_j v_j + p_j, mean
    pool, final LayerNorm, head), with the frozen weights read from the model.

Why it is independent. Nothing here imports or calls qlbench's router (routing.route, rmsnorm, topk_softmax,
depth_summary), the adapter's forward (group_forward, routed_update, low_rank_update), RoutingState or block_of: the
oracle reads parameter tensors only and computes with explicit loops over members, samples, blocks, atoms, tokens and
heads, one vector at a time. The comparison runs the oracle with qlbench's router functions and the adapter's forward
replaced by ones that raise, so a future edit that makes the oracle lean on them fails loudly. Apart from that guard,
`qlbench.adapters.routing` is imported only by the mutant tests at the end, to break the *real* model and show that
the oracle notices.

Where the paper leaves room, the oracle follows the implementation's documented choices (queryable.py docstring,
"qlbench choices"), each marked "qlbench choice" below.

The two mutants the theorem suite (tests/properties) cannot see, killed here: the block prior w dropped from q0, and
the depth term Q_dep u dropped from q (tests/mutation/run_mutants.py runs this file too).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import random
from dataclasses import dataclass
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from qlbench import adapters
from qlbench.backbones import build_backbone
from qlbench.seeding import generator

F64 = torch.float64
RTOL = ATOL = 1e-10
N_LAYERS = {"deep-narrow": 32, "transformer": 8}  # the real backbones' depths (the units blocks are made of)
ATTN_ROLES = ("q", "k", "v", "o", "fc1", "fc2")


# =====================================================================================================================
# The oracle. Vectors are 1-D float64 tensors; one member e and one sample (sequence) n at a time.
# =====================================================================================================================


def rms_norm(v: torch.Tensor, eps: float) -> torch.Tensor:
    """Assumption 3: v / sqrt(mean(v^2) + eps), no learnable scale. v (d,)."""
    mean_square = sum(float(a) ** 2 for a in v) / len(v)
    return v / math.sqrt(mean_square + eps)


def dot(a: torch.Tensor, b: torch.Tensor) -> float:
    return sum(float(x) * float(y) for x, y in zip(a, b))


def softmax(values: list[float]) -> list[float]:
    top = max(values)
    ex = [math.exp(v - top) for v in values]
    z = sum(ex)
    return [x / z for x in ex]


def log_softmax(values: list[float]) -> list[float]:
    top = max(values)
    log_z = top + math.log(sum(math.exp(v - top) for v in values))
    return [v - log_z for v in values]


def top_k_softmax(logits: list[float], k: int) -> list[float]:
    """eq. app_active_router: softmax over the active set I = the k largest logits, 0 outside I."""
    active = sorted(range(len(logits)), key=lambda m: logits[m], reverse=True)[:k]
    weights = softmax([logits[m] for m in active])
    alpha = [0.0] * len(logits)
    for m, a in zip(active, weights):
        alpha[m] = a
    return alpha


def gelu(v: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU, PyTorch's default: v Phi(v)."""
    return 0.5 * v * (1.0 + torch.erf(v / math.sqrt(2.0)))


def layer_norm(v: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """(v - mean) / sqrt(biased var + eps) * weight + bias over one vector v (d,)."""
    d = len(v)
    mean = sum(float(a) for a in v) / d
    var = sum((float(a) - mean) ** 2 for a in v) / d
    return (v - mean) / math.sqrt(var + eps) * weight + bias


def block_entries(n_layers: int, n_blocks: int) -> list[int]:
    """Contiguous blocks of near-equal size: layer l is in block floor(l B / L); the block of each layer.
    (qlbench's partition, docs/methods.md; the paper only says "continuous blocks".)"""
    return [layer * n_blocks // n_layers for layer in range(n_layers)]


class OracleRouter:
    """Algorithm 2, lines 5-27 (appendix eqs. app_prequery .. app_active_router), for one member's parameters."""

    def __init__(self, memory: torch.nn.Module, case: Case, e: int):
        member = lambda name: getattr(memory, name)[e].detach()
        self.atoms = member("atoms")  # (M, r, r) C_m
        self.keys = member("keys")  # (M, d_k) k_m
        # qlbench choice: the layer prior is stored per block; only w_{l_b} of each block's entry layer is ever used
        self.w = member("block_prior")  # (B, d_k)
        self.Q_cur, self.Q_dep = member("Q_cur"), member("Q_dep")  # (d_k, r) each
        self.Q_dep_q, self.Q_dep_k = member("Q_dep_q"), member("Q_dep_k")  # (d_k, d_k), (d_k, r)
        self.Q_ctx, self.R_ctx = member("Q_ctx"), member("R_ctx")  # (d_k, d_c) each
        self.c = case

    def operator(self, b: int, s_entry: torch.Tensor, sbars: list[torch.Tensor], e_c: torch.Tensor) -> torch.Tensor:
        """S_b (r, r) for block b (0-based) from the entry state s_entry (r,), the completed blocks' means sbar_i
        (b of them, each (r,)) and the instruction embedding e(c) (d_c,)."""
        c = self.c
        assert len(sbars) == b, "block b attends over exactly the b completed blocks"
        root_dk = math.sqrt(c.d_k)
        # eq. app_prequery
        q0 = self.w[b] + self.Q_cur @ s_entry + c.lambda_ctx * (self.Q_ctx @ e_c)  # (d_k,)
        # eqs. app_depth_summary, app_depth_logits (u_0 = 0 for the first block)
        u = torch.zeros(len(s_entry), dtype=F64)  # (r,)
        if b > 0:
            q_hat = rms_norm(self.Q_dep_q @ q0, c.rms_eps)  # (d_k,)
            xi = [dot(q_hat, rms_norm(self.Q_dep_k @ sbar, c.rms_eps)) / (root_dk * c.t_dep) for sbar in sbars]
            beta = softmax(xi)  # (b,)
            for beta_i, sbar in zip(beta, sbars):
                u = u + beta_i * sbar
        # eq. app_final_query
        q = q0 + self.Q_dep @ u  # (d_k,)
        # eqs. app_state_language_logits, app_language_prior, app_tilde_logits
        q_hat, r_hat = rms_norm(q, c.rms_eps), rms_norm(self.R_ctx @ e_c, c.rms_eps)
        k_hat = [rms_norm(k, c.rms_eps) for k in self.keys]
        zeta = [dot(q_hat, k) / (root_dk * c.t_attn) for k in k_hat]  # (M,)
        rho = [dot(r_hat, k) / (root_dk * c.t_lang) for k in k_hat]  # (M,)
        fused = [z + c.tau_lang * lp for z, lp in zip(zeta, log_softmax(rho))]
        # eq. app_active_router, eq. app_routed_operator
        alpha = top_k_softmax(fused, c.top_k)
        S = torch.zeros_like(self.atoms[0])  # (r, r)
        for a, C in zip(alpha, self.atoms):
            S = S + a * C
        return S


def read_linear(module: torch.nn.Module, e: int) -> SimpleNamespace:
    """Member e of a frozen StackedLinear or of an adapted layer: W0 (d_out, d_in), b0 (d_out,), and for an adapted
    layer A (r, d_in), B (d_out, r), g = sigmoid(eta) (else None)."""
    adapted = hasattr(module, "queryable_A")
    base = module.base if adapted else module
    lin = SimpleNamespace(W0=base.weight[e].detach(), b0=base.bias[e].detach(), A=None, B=None, g=None)
    if adapted:
        lin.A, lin.B = module.queryable_A[e].detach(), module.queryable_B[e].detach()
        lin.g = 1.0 / (1.0 + math.exp(-float(module.queryable_eta[e])))
    return lin


def linear(lin: SimpleNamespace, x: torch.Tensor, S: torch.Tensor | None, scale: float) -> torch.Tensor:
    """eq. app_layer_update: W0 x + b0 + s B (I_r + g S_b) A x for x (d_in,); a frozen layer is W0 x + b0."""
    y = lin.W0 @ x + lin.b0  # (d_out,)
    if lin.A is None:
        return y
    r = lin.A.shape[0]
    return y + scale * (lin.B @ ((torch.eye(r, dtype=F64) + lin.g * S) @ (lin.A @ x)))


def mean(vectors: list[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros_like(vectors[0])
    for v in vectors:
        total = total + v
    return total / len(vectors)


def oracle_deep_narrow(
    model, case: Case, x: torch.Tensor, instruction: torch.Tensor, zero_operator: bool = False
) -> torch.Tensor:
    """x (E, N, 2), instruction (E, d_c) -> (E, N). One route per block per sample, from the block-entry layer's
    rank state s = A x; block summaries are the means of the rank states of each completed block's layers."""
    E, N, _ = x.shape
    L = len(model.hidden)
    blocks = block_entries(L, case.n_blocks)
    scale = case.alpha / case.r
    out = torch.zeros(E, N, dtype=F64)  # (E, N)
    for e in range(E):
        router = OracleRouter(model.shared["queryable"], case, e)
        inp, head = read_linear(model.inp, e), read_linear(model.head, e)
        hidden = [read_linear(layer, e) for layer in model.hidden]
        for n in range(N):
            h = gelu(linear(inp, x[e, n], None, scale))  # (32,)
            completed, current, S = [], [], None  # sbar_1..sbar_{b-1}; rank states of the open block; S_b
            for layer, lin in enumerate(hidden):
                b = blocks[layer]
                s = lin.A @ h  # (r,) rank state s_l = A_l h_l
                if layer == 0 or blocks[layer - 1] != b:  # entry layer l_b: close the last block, route
                    if current:
                        completed.append(mean(current))
                        current = []
                    S = router.operator(b, s, completed, instruction[e])  # (r, r)
                    if zero_operator:
                        S = torch.zeros_like(S)
                current.append(s)
                h = gelu(linear(lin, h, S, scale))  # (32,)
            out[e, n] = linear(head, h, None, scale)[0]
    return out


def oracle_transformer(
    model, case: Case, x: torch.Tensor, instruction: torch.Tensor, zero_operator: bool = False
) -> torch.Tensor:
    """x (E, N, 2), instruction (E, d_c) -> (E, N). One route per block per sequence (paper appendix A)."""
    E, N, T = x.shape
    L = len(model.layers)
    blocks = block_entries(L, case.n_blocks)
    scale = case.alpha / case.r
    out = torch.zeros(E, N, dtype=F64)  # (E, N)
    for e in range(E):
        router = OracleRouter(model.shared["queryable"], case, e)
        token, position = model.token[e].detach(), model.position[e].detach()  # (2, d) each: v_j, p_j
        layers = []
        for layer in model.layers:
            lins = {p: read_linear(getattr(layer, p), e) for p in ATTN_ROLES}
            lns = [(ln.weight[e].detach(), ln.bias[e].detach(), ln.eps) for ln in (layer.ln1, layer.ln2)]
            layers.append((lins, lns, layer.n_heads))
        ln_f = (model.ln_f.weight[e].detach(), model.ln_f.bias[e].detach(), model.ln_f.eps)
        head = read_linear(model.head, e)
        for n in range(N):
            H = [float(x[e, n, j]) * token[j] + position[j] for j in range(T)]  # T tokens, each (d,)
            completed, current, S = [], [], None
            for layer, (lins, (ln1, ln2), n_heads) in enumerate(layers):
                b = blocks[layer]
                X = [layer_norm(h, *ln1) for h in H]  # pre-LN input of q, k, v
                # the layer's rank state: token average of A^p x_j, averaged over the adapted q/k/v projections
                # (appendix A averages Q, K, V; qlbench choice: when only some of them are adapted, over those)
                qkv = [p for p in ("q", "k", "v") if lins[p].A is not None]
                if qkv:
                    state = mean([mean([lins[p].A @ xj for xj in X]) for p in qkv])  # (r,)
                    if layer == 0 or blocks[layer - 1] != b:
                        if current:
                            completed.append(mean(current))
                            current = []
                        S = router.operator(b, state, completed, instruction[e])  # (r, r), one per sequence
                        if zero_operator:
                            S = torch.zeros_like(S)
                    # qlbench choice: only the q/k/v state feeds the block summaries (O and FFN projections use S_b
                    # but are not recorded: no circular dependence, as appendix A says for the entry state)
                    current.append(state)
                Q, K, V = ([linear(lins[p], xj, S, scale) for xj in X] for p in ("q", "k", "v"))  # T x (d,)
                d = len(Q[0])
                dh = d // n_heads
                attended = [torch.zeros(d, dtype=F64) for _ in range(T)]
                for hd in range(n_heads):
                    cols = slice(hd * dh, (hd + 1) * dh)
                    for i in range(T):
                        weights = softmax([dot(Q[i][cols], K[j][cols]) / math.sqrt(dh) for j in range(T)])
                        for j in range(T):
                            attended[i][cols] += weights[j] * V[j][cols]
                H = [H[i] + linear(lins["o"], attended[i], S, scale) for i in range(T)]
                H = [
                    h + linear(lins["fc2"], gelu(linear(lins["fc1"], layer_norm(h, *ln2), S, scale)), S, scale)
                    for h in H
                ]
            pooled = mean(H)  # (d,) mean over tokens
            out[e, n] = linear(head, layer_norm(pooled, *ln_f), None, scale)[0]
    return out


ORACLES = {"deep-narrow": oracle_deep_narrow, "transformer": oracle_transformer}


# =====================================================================================================================
# Cases: real backbones, random router configurations, random non-zero adapter weights.
# =====================================================================================================================


@dataclass(frozen=True)
class Case:
    arch: str
    seed: int
    members: int
    n_samples: int
    n_blocks: int
    n_atoms: int
    top_k: int
    d_k: int
    r: int
    alpha: float
    t_attn: float
    t_dep: float
    t_lang: float
    tau_lang: float
    lambda_ctx: float
    instruction_dim: int
    rms_eps: float
    targets: tuple[str, ...] | None = None
    hidden_gain: float | None = None  # deep-narrow: redraw the frozen hidden W0 ~ N(0, gain^2 / 32); None: as built

    def config(self):
        return adapters.get("queryable").make_config(
            r=self.r,
            alpha=self.alpha,
            targets=self.targets,
            n_blocks=self.n_blocks,
            n_atoms=self.n_atoms,
            top_k=self.top_k,
            d_k=self.d_k,
            t_attn=self.t_attn,
            t_dep=self.t_dep,
            t_lang=self.t_lang,
            tau_lang=self.tau_lang,
            lambda_ctx=self.lambda_ctx,
            instruction_dim=self.instruction_dim,
            rms_eps=self.rms_eps,
        )


def draw_case(arch: str, seed: int, **fixed) -> Case:
    rng = random.Random(f"oracle/{arch}/{seed}")  # str seeds are hashed with sha512: stable across processes
    log_uniform = lambda lo, hi: math.exp(rng.uniform(math.log(lo), math.log(hi)))
    # M = 1 or k = 1 make alpha piecewise constant (the route moves only when the top atom changes): explicit cases
    M = fixed.get("n_atoms", rng.randint(2, 8))
    values = dict(
        members=rng.choice([1, 2]),
        n_samples=rng.randint(1, 4),
        n_blocks=rng.randint(1, N_LAYERS[arch]),
        n_atoms=M,
        top_k=rng.randint(min(2, M), M),
        d_k=rng.randint(1, 16),
        r=rng.randint(1, 8),
        alpha=rng.choice([1.0, 8.0, 16.0]),
        t_attn=log_uniform(0.2, 5.0),
        t_dep=log_uniform(0.2, 5.0),
        t_lang=log_uniform(0.2, 5.0),
        tau_lang=rng.uniform(0.05, 3.0),
        lambda_ctx=rng.uniform(0.05, 2.0),
        instruction_dim=rng.randint(1, 8),
        rms_eps=rng.choice([1e-6, 1e-3, 1e-1]),
    )
    if arch == "deep-narrow":
        # at PyTorch's default init the 32-layer plain MLP forgets its input (the output is nearly constant over
        # samples) and damps whatever the early blocks do; a gain near GELU's critical one keeps every block visible
        values["hidden_gain"] = rng.choice([None, 1.6, 1.6])
    if arch == "transformer":  # 6M parameters per member: keep the stack and the batch small
        values.update(
            members=1 if seed % 2 else 2,
            n_samples=rng.randint(1, 3),
            targets=rng.choice([None, ("q", "v"), ("v", "o", "fc1", "fc2"), ATTN_ROLES]),
        )
    values.update(fixed)
    return Case(arch=arch, seed=seed, **values)


CASES = [
    draw_case("deep-narrow", 0, n_blocks=1, n_atoms=4, top_k=2),  # one block: no depth summary at all
    draw_case("deep-narrow", 1, n_blocks=32, n_atoms=5, top_k=2),  # every layer a block: attention over up to 31
    draw_case("deep-narrow", 2, n_blocks=4, n_atoms=8, top_k=8),  # the paper's B = 4; dense top-k = M
    draw_case("deep-narrow", 3, n_atoms=1, top_k=1),  # a single atom
    draw_case("deep-narrow", 4, n_blocks=5, n_atoms=4, top_k=1, d_k=1, r=1),  # hard top-1; scalar keys and rank;
    # uneven blocks 7/6/7/6/6
    draw_case("deep-narrow", 5, members=2, n_samples=4),
    *[draw_case("deep-narrow", seed) for seed in range(6, 10)],
    draw_case("transformer", 0, n_blocks=1),
    draw_case("transformer", 1, n_blocks=8, targets=None),  # every layer a block, default q, k, v, o
    draw_case("transformer", 2, n_blocks=3, targets=ATTN_ROLES),  # uneven blocks 3/3/2, FFN adapted too
    draw_case("transformer", 3, targets=("v", "o"), top_k=1),  # one adapted projection gives its own
    # token-averaged state; hard top-1 routing
    draw_case("transformer", 4),
]


@functools.cache
def _backbone(arch: str, members: int) -> torch.nn.Module:
    """A pristine real backbone (building the 6M-parameter Transformer is the slow part: built once, copied)."""
    return build_backbone(arch, [f"oracle-{i}" for i in range(members)], dtype=F64)


def build(case: Case) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The adapted model (registry build) with non-trivial weights, inputs x (E, N, 2) and e(c) (E, d_c)."""
    backbone = copy.deepcopy(_backbone(case.arch, case.members))
    gens = [generator("test", "oracle", case.arch, case.seed, i) for i in range(case.members)]
    model = adapters.get("queryable").build(backbone, case.config(), gens, None)
    g = torch.Generator().manual_seed(case.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            z = torch.randn(p.shape, generator=g, dtype=F64)
            if leaf == "queryable_B":  # zero at init, so the adapter would be a no-op: ~unit-size updates
                p.copy_(z * (case.r / case.alpha) / math.sqrt(case.r))
            elif leaf == "queryable_eta":  # zero at init: gates spread over (0, 1)
                p.copy_(z * 1.5)
            elif leaf == "atoms":  # N(0, 0.02^2) at init: large enough that the route visibly moves the output
                p.copy_(z * 0.5)
            elif leaf in ("keys", "block_prior"):
                p.copy_(z)
            elif name.startswith("shared.queryable."):  # Q_cur, Q_dep, Q_dep_q, Q_dep_k, Q_ctx, R_ctx
                p.copy_(z / math.sqrt(p.shape[-1]))
            elif ".ln" in name or name.startswith("ln_f"):  # frozen LayerNorms, 1 and 0 at init
                p.copy_((1.0 if leaf == "weight" else 0.0) + 0.2 * z)
            elif case.hidden_gain and name.startswith("hidden.") and name.endswith("base.weight"):
                p.copy_(z * case.hidden_gain / math.sqrt(p.shape[-1]))
    gx = torch.Generator().manual_seed(case.seed + 1)
    x = torch.rand(case.members, case.n_samples, 2, generator=gx, dtype=F64) * 4 - 2  # (E, N, 2)
    instruction = torch.randn(case.members, case.instruction_dim, generator=gx, dtype=F64)  # (E, d_c)
    return model, x, instruction


@contextlib.contextmanager
def qlbench_router_disabled():
    """The oracle must not need qlbench's router or the adapter's forward: make every one of them raise."""
    from qlbench.adapters import queryable, routing

    def refuse(*args, **kwargs):
        raise AssertionError("the oracle called qlbench's router or adapter forward")

    names = [(routing, n) for n in ("route", "rmsnorm", "scaled_similarity", "topk_softmax", "depth_summary")]
    names += [(queryable, n) for n in ("route", "block_of", "low_rank_update")]
    names += [(queryable.RoutedLinear, "apply")]
    names += [(queryable.QueryableLinear, n) for n in ("forward", "group_forward", "routed_update")]
    with contextlib.ExitStack() as stack:
        for owner, name in names:
            if hasattr(owner, name):
                stack.enter_context(mock.patch.object(owner, name, refuse))
        yield


def oracle(model, case: Case, x: torch.Tensor, instruction: torch.Tensor, **kw) -> torch.Tensor:
    with torch.no_grad(), qlbench_router_disabled():
        return ORACLES[case.arch](model, case, x, instruction, **kw)


def mismatch(y: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest |y - ref| / (ATOL + RTOL |ref|): <= 1 passes torch's allclose at (RTOL, ATOL)."""
    return float(((y - reference).abs() / (ATOL + RTOL * reference.abs())).max())


# =====================================================================================================================
# Tests
# =====================================================================================================================


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.arch}-{c.seed}-B{c.n_blocks}-M{c.n_atoms}k{c.top_k}")
def test_model_output_matches_the_oracle(case):
    model, x, instruction = build(case)
    with torch.no_grad():
        y = model(x, instruction)  # (E, N)
    expected = oracle(model, case, x, instruction)  # (E, N)
    torch.testing.assert_close(y, expected, rtol=RTOL, atol=ATOL)
    # the comparison tests the router only if the routed part reaches the output: with S_b = 0 (plain LoRA with
    # the same A, B) the output must be far outside the tolerance
    lora_like = oracle(model, case, x, instruction, zero_operator=True)
    assert mismatch(lora_like, y) > 1e4


# The two mutants of tests/mutation/run_mutants.py that the theorem suite does not kill, applied to the real model in
# process: the router is called with w = 0 (block prior dropped from q0) or with Q_dep = 0 (q = q0, the depth term
# Q_dep u dropped; the same function as the source mutant `q = q0`).
MUTANTS = {  # routing.route's Router with one parameter zeroed
    "block_prior_dropped": lambda router: dataclasses.replace(router, w=torch.zeros_like(router.w)),
    "depth_summary_dropped": lambda router: dataclasses.replace(router, Q_dep=torch.zeros_like(router.Q_dep)),
}
_MUTANT_CASE = dict(
    seed=100,
    n_samples=3,
    n_blocks=4,
    n_atoms=6,
    top_k=2,
    d_k=8,
    r=4,
    alpha=8.0,
    t_attn=1.0,
    t_dep=1.0,
    t_lang=1.0,
    tau_lang=0.5,
    lambda_ctx=0.5,
    instruction_dim=5,
    rms_eps=1e-6,
)
MUTANT_CASES = {  # four blocks (the depth summary is used) and d_k = 8 (with d_k = 1, RMSNorm(q) is about sign(q))
    "deep-narrow": Case("deep-narrow", members=2, hidden_gain=1.6, **_MUTANT_CASE),
    "transformer": Case("transformer", members=1, **_MUTANT_CASE),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
@pytest.mark.parametrize("arch", sorted(MUTANT_CASES))
def test_oracle_detects_the_mutant(arch, mutant, monkeypatch):
    from qlbench.adapters import queryable, routing

    case = MUTANT_CASES[arch]
    model, x, instruction = build(case)
    expected = oracle(model, case, x, instruction)
    with torch.no_grad():
        torch.testing.assert_close(model(x, instruction), expected, rtol=RTOL, atol=ATOL)  # unmutated: agrees

    original, calls = routing.route, []

    def mutated(s_entry, summaries, router, *args):
        calls.append(1)
        return original(s_entry, summaries, MUTANTS[mutant](router), *args)

    # queryable.py binds `route` by name at import, so patching routing.route alone would not reach the model:
    # patch the name wherever it is bound to the original
    for module in (routing, queryable):
        if getattr(module, "route", None) is original:
            monkeypatch.setattr(module, "route", mutated)
    with torch.no_grad():
        y = model(x, instruction)
    assert len(calls) == case.n_blocks  # the mutant really ran, once per block
    assert mismatch(y, expected) > 1e4, f"the oracle does not see {mutant}"


def test_every_source_mutant_still_patches_the_code(monkeypatch):
    """tests/mutation/run_mutants.py patches each mutant's exact snippet, which must occur once in its file: a
    snippet the code has moved away from would leave that mutant unrun (three had, after the router took
    per-sample instructions and the gate became `memberwise`)."""
    import importlib.util
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("run_mutants", root / "tests" / "mutation" / "run_mutants.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    assert module.MUTANTS
    stale = {m.name: (root / m.file).read_text().count(m.original) for m in module.MUTANTS}
    assert {k: n for k, n in stale.items() if n != 1} == {}
