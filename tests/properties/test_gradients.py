"""Exact gradient identities against autograd through the real adapted model (prop:app_compressed_gradient_identity,
thm:app_blockwise_gradient_factorization, cor:app_exact_logit_gradients).

A small DeepNarrowMLP or RegressionTransformer is adapted with Queryable LoRA through the registry; one forward is
traced (tracing.trace: every layer's input x_l, rank state s_l = A_l x_l and routed operator S_b; every block's Route),
the rank-space vectors t_l = s_l + g_l S_b s_l are captured where the layer hands them to low_rank_update
(models.capture_rank_updates), and autograd provides dL/dS_b, dL/dalpha, dL/dzeta, dL/drho, dL/dC_m, dL/deta_l and
r_l = dL/dt_l. The tests compare them with the paper's closed forms built from those captured quantities.

Reading t_l needs the plain ops (models.capture_rank_updates switches queryable.ROUTED_NODE off), so the eager
deep-narrow layer's own autograd node, RoutedLinear with its hand-written backward, is checked separately at the end:
its gradients for every input, the gate included, against the layer update written from the paper (eq.
app_layer_update) and, on the real model, against the plain ops.
"""

from __future__ import annotations

from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qlbench.adapters import queryable
from qlbench.theory import tracing

from models import ModelCase, capture_rank_updates, model_cases
from strategies import reals, tensors, tol

EXAMPLES = max(4, settings().max_examples // 6)
ARCH_CASES = st.one_of(model_cases("deep-narrow"), model_cases("transformer", max_layers=2))


def forward_backward(case: ModelCase):
    """Trace one forward, keep the gradients of the routed quantities, backpropagate a non-linear loss."""
    model = case.build()
    x, e = case.inputs()
    ts: list[torch.Tensor] = []
    with capture_rank_updates(ts):
        t = tracing.trace(model, x, e)
    assert len(ts) == len(t.calls)
    for R in t.routes.values():
        for name in ("S", "alpha", "zeta", "logits", "rho"):
            if getattr(R, name) is not None:
                getattr(R, name).retain_grad()
    for c in t.calls:
        c.out.retain_grad()
    w = torch.randn(t.output.shape, generator=torch.Generator().manual_seed(case.seed + 2), dtype=t.output.dtype)
    loss = (w * t.output + 0.5 * t.output**2).sum()
    loss.backward()
    return model, t, ts


def per_sample_outer(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum over tokens of a b^T: (E, N, [T,] r) x (E, N, [T,] r) -> (E, N, r, r)."""
    if a.dim() == 3:
        return a.unsqueeze(-1) * b.unsqueeze(-2)
    return torch.einsum("enti,entj->enij", a, b)


def apply_operator(S: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """S_b s for S (E, N, r, r) and s (E, N, r) or, per token, (E, N, T, r)."""
    if s.dim() == 3:
        return (S @ s.unsqueeze(-1)).squeeze(-1)
    return torch.einsum("enij,entj->enti", S, s)


def gate_of(c) -> torch.Tensor:
    return torch.sigmoid(c.layer.queryable_eta.detach()).view(-1, 1, 1, 1)


def close(actual, expected, *operands, ops: int = 4096):
    torch.testing.assert_close(actual, expected, rtol=0, atol=tol(expected, *operands, ops=ops))


# ---------------------------------------------------------------------------------------------------------------
# thm:app_blockwise_gradient_factorization


@given(case=ARCH_CASES)
@settings(max_examples=EXAMPLES)
def test_blockwise_gradient_factorisation(case):
    """grad_{S_b} L = sum_{l in B_b} g_l r_l s_l^T (per sample; summed over tokens in attention), with
    r_l = dL/dt_l = s B_l^T dL/d(delta h_l); grad_{C_m} L = sum over blocks and samples of alpha_{b,m} grad_{S_b} L;
    dL/dalpha_{b,m} = <grad_{S_b} L, C_m>_F; dL/deta_l = sigma(eta_l)(1 - sigma(eta_l)) <r_l, d_l>, d_l = S_b s_l."""
    model, t, ts = forward_backward(case)
    atoms = t.memory.atoms.detach()
    by_block: dict[int, torch.Tensor] = {}
    for c, tv in zip(t.calls, ts):
        r, s = tv.grad, c.s.detach()
        # eq:app_rank_backprop_vector: r_l = (alpha_L / r) B_l^T dL/d(delta h_l), delta h_l = the layer's update output
        close(r, c.layer.scale * torch.einsum("e...o,eor->e...r", c.out.grad, c.layer.queryable_B.detach()), c.out.grad)
        by_block[c.layer.block] = by_block.get(c.layer.block, 0) + gate_of(c) * per_sample_outer(r, s)
        d = apply_operator(c.S.detach(), s)  # d_l = S_b s_l, per sample or token
        g = torch.sigmoid(c.layer.queryable_eta.detach())
        expected = g * (1 - g) * (r * d).flatten(1).sum(-1)
        close(c.layer.queryable_eta.grad, expected, r, d)
    atom_grad = torch.zeros_like(atoms)
    for b, R in t.routes.items():
        close(R.S.grad, by_block[b], R.S.grad)  # eq:app_grad_S_exact
        close(R.alpha.grad, torch.einsum("enij,emij->enm", R.S.grad, atoms), R.S.grad)  # eq:app_grad_alpha_exact
        atom_grad = atom_grad + torch.einsum("enm,enij->emij", R.alpha.detach(), R.S.grad)
    close(t.memory.atoms.grad, atom_grad, atom_grad)  # eq:app_grad_atom_exact, summed over every use of C_m


# ---------------------------------------------------------------------------------------------------------------
# cor:app_exact_logit_gradients


@given(
    case=st.one_of(
        model_cases("deep-narrow", instruction=True),
        model_cases("deep-narrow", instruction=False),
        model_cases("transformer", instruction=True, max_layers=2),
    )
)
@settings(max_examples=EXAMPLES)
def test_exact_logit_gradients(case):
    """On the active set: dL/dz_m = dL/dzeta_m = alpha_m (psi_m - psibar), psi_m = <grad_S L, C_m>_F,
    psibar = sum_I alpha_j psi_j; and dL/drho_m = tau_lang alpha_m (psi_m - psibar) (rho is shared by the samples of a
    block, so its gradient sums over them). Off the active set all three vanish."""
    model, t, ts = forward_backward(case)
    atoms = t.memory.atoms.detach()
    for R in t.routes.values():
        alpha = R.alpha.detach()
        psi = torch.einsum("enij,emij->enm", R.S.grad, atoms)
        psibar = (alpha * psi).sum(-1, keepdim=True)
        expected = alpha * (psi - psibar)
        close(R.logits.grad, expected, psi)
        close(R.zeta.grad, expected, psi)
        if R.rho is not None:
            close(R.rho.grad, case.tau_lang * expected.sum(1, keepdim=True), psi)


# ---------------------------------------------------------------------------------------------------------------
# prop:app_compressed_gradient_identity


@given(case=ARCH_CASES)
@settings(max_examples=EXAMPLES)
def test_compressed_gradient_identity(case):
    """With G_l = sum_tokens dL/dy x^T the local dense gradient of layer l (per sample) and U = s g B S_b A the routed
    part of Delta W^l (read off the real layer: Delta W(S_b) - Delta W(0)):
    <G_l, U>_F = s g <B^T G_l A^T, S_b>_F, and both equal the first-order loss change g dL/dg = dL/deta / (1 - g)."""
    model, t, ts = forward_backward(case)
    for c in t.calls:
        L = c.layer
        dy, x = c.out.grad, c.x.detach()
        G = per_sample_outer(dy, x) if dy.dim() == 3 else torch.einsum("enti,entj->enij", dy, x)  # (E, N, out, in)
        with torch.no_grad():
            U = tracing.update_matrix(L, c.S.detach()) - tracing.update_matrix(L, torch.zeros_like(c.S))
        lhs = (G * U).flatten(1).sum(-1)  # (E,)
        A, B = L.queryable_A.detach(), L.queryable_B.detach()
        g = torch.sigmoid(L.queryable_eta.detach())
        compressed = B.transpose(1, 2).unsqueeze(1) @ G @ A.transpose(1, 2).unsqueeze(1)  # (E, N, r, r)
        mid = L.scale * g * (compressed * c.S.detach()).flatten(1).sum(-1)
        scale_terms = (G.abs() * U.abs()).flatten(1).sum(-1)
        close(mid, lhs, scale_terms)
        close(lhs * (1 - g), L.queryable_eta.grad, scale_terms)


# ---------------------------------------------------------------------------------------------------------------
# the eager layer's autograd node (queryable.RoutedLinear): its hand-written backward, the gate g = sigmoid(eta)
# included, is the derivative of eq. app_layer_update


def paper_layer_update(x, A, S, g, W0, b0, B, scale):
    """y = (W0 + scale B (I_r + g S) A) x + b0 per member and sample, the matrix form of eq. app_layer_update:
    x (E, N, d_in), A (E, r, d_in), S (E, N, r, r), g (E,), W0 (E, d_out, d_in), b0 (E, d_out), B (E, d_out, r)."""
    E, N, _ = x.shape
    eye = torch.eye(A.shape[1], dtype=x.dtype)
    W = W0.unsqueeze(1) + scale * (B.unsqueeze(1) @ (eye + g.view(E, 1, 1, 1) * S) @ A.unsqueeze(1))
    return (W @ x.unsqueeze(-1)).squeeze(-1) + b0.unsqueeze(1)  # (E, N, d_out)


def loss_of(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (w * y + 0.5 * y**2).sum()


@given(data=st.data())
def test_routed_node_gradients_match_layer_update(data):
    """For y = RoutedLinear(x, s = A x, S_b, g = sigmoid(eta), W0, b0, B, scale), called as QueryableLinear calls it
    (S_b in route()'s samples-last storage), and the same through RoutedLinearDense (S_b stored (E, N, r, r), the
    layout off the CPU), dL/d of x, A, S_b, eta, W0, b0 and B equal autograd's derivatives of the plain matrix
    formula y = W0 x + b0 + scale B (I + g S_b) A x, for a non-linear loss L."""
    E, N = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 4))
    d_in, d_out, r = (data.draw(st.integers(1, 4)) for _ in range(3))
    leaves = dict(
        x=data.draw(tensors(E, N, d_in)),
        A=data.draw(tensors(E, r, d_in)),
        S=data.draw(tensors(E, N, r, r)),
        eta=data.draw(tensors(E, bound=4.0)),
        W0=data.draw(tensors(E, d_out, d_in)),
        b0=data.draw(tensors(E, d_out)),
        B=data.draw(tensors(E, d_out, r)),
    )
    scale, w = data.draw(reals(0.1, 4.0)), data.draw(tensors(E, N, d_out))
    for v in leaves.values():
        v.requires_grad_(True)
    x, A, S, eta, W0, b0, B = leaves.values()
    s = lambda: torch.einsum("end,erd->enr", x, A)  # A x per sample
    nodes = {  # the node of each of route()'s layouts of S: samples-last (the CPU's), (E, N, r, r) (CUDA's)
        "RoutedLinear": lambda g: queryable.RoutedLinear.apply(x, s(), S.permute(0, 2, 3, 1), g, W0, b0, B, scale),
        "RoutedLinearDense": lambda g: queryable.RoutedLinearDense.apply(x, s(), S, g, W0, b0, B, scale),
    }
    y_ref = paper_layer_update(x, A, S, torch.sigmoid(eta), W0, b0, B, scale)
    refs = torch.autograd.grad(loss_of(y_ref, w), list(leaves.values()))
    # rounding allowance: the same sums with every term made non-negative bound the terms each result adds up
    mag_leaves = [
        v.detach().abs().requires_grad_(True) if k != "eta" else v.detach().requires_grad_(True)
        for k, v in leaves.items()
    ]
    mx, mA, mS, meta, mW0, mb0, mB = mag_leaves
    y_mag = paper_layer_update(mx, mA, mS, torch.sigmoid(meta), mW0, mb0, mB, scale)
    mags = torch.autograd.grad(((w.abs() + y_mag.detach()) * y_mag).sum(), mag_leaves)
    for node, apply in nodes.items():
        y = apply(torch.sigmoid(eta))
        grads = torch.autograd.grad(loss_of(y, w), list(leaves.values()), allow_unused=True)
        close(y, y_ref, y_mag, ops=64)
        for name, got, want, mag in zip(leaves, grads, refs, mags):
            got = torch.zeros_like(want) if got is None else got
            torch.testing.assert_close(
                got, want, rtol=0, atol=tol(mag, ops=256), msg=lambda m, n=name, node=node: f"dL/d{n}, {node}: {m}"
            )


def parameter_grads(model, x, e, w) -> dict[str, torch.Tensor | None]:
    model.zero_grad(set_to_none=True)
    loss_of(model(x, e), w).backward()
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters() if p.requires_grad}


@given(case=model_cases("deep-narrow"))
@settings(max_examples=EXAMPLES)
def test_routed_node_real_model_gradients_match_plain_ops(case):
    """On a real DeepNarrowMLP (every hidden layer one RoutedLinear node when queryable.ROUTED_NODE is on), the
    gradient of a non-linear loss with respect to every trainable parameter (the gates eta_l, A_l, B_l, the atoms,
    keys and router matrices) equals the one with ROUTED_NODE off, i.e. through autograd's plain ops."""
    model = case.build()
    x, e = case.inputs()
    w = torch.randn(case.members, case.n_samples, generator=torch.Generator().manual_seed(case.seed + 2), dtype=x.dtype)
    t = tracing.trace(model, x, e)
    nodes = {type(c.out.grad_fn).__name__ for c in t.calls}
    assert nodes == {"RoutedLinearBackward"}, f"the eager deep-narrow layers should run as RoutedLinear: {nodes}"
    node = parameter_grads(model, x, e, w)
    with mock.patch.object(queryable, "ROUTED_NODE", False):
        plain = parameter_grads(model, x, e, w)
    assert node.keys() == plain.keys()
    size = float(t.output.detach().abs().max()) + float(w.abs().max())
    for name in plain:
        if plain[name] is None:  # unused here (e.g. the depth-summary matrices with one block)
            assert node[name] is None or not node[name].any(), f"dL/d{name} should vanish"
            continue
        want = plain[name]
        got = torch.zeros_like(want) if node[name] is None else node[name]
        torch.testing.assert_close(
            got, want, rtol=0, atol=tol(want, size, ops=4096), msg=lambda m, name=name: f"dL/d{name}: {m}"
        )
