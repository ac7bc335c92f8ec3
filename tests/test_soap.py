"""StackedSoap (one batched step for every member) against pytorch_optimizer.SOAP run once per member: float64, the
parameter shapes of both backbones, 60 steps with six eigenbasis refreshes; members never mix; a member whose
gradient turns non-finite stops, the others go on; no step after the first reads the device."""

from __future__ import annotations

import pytest
import torch
from pytorch_optimizer import SOAP

from qlbench.soap import StackedSoap

from helpers import F64, gens

# member shapes of the two backbones' parameters: deep-narrow (input, hidden, head and biases), Transformer (token
# and position vectors, q/k/v/o, FFN, LayerNorm)
DEEP_NARROW = [(32, 2), (32,), (32, 32), (1, 32), (1,)]
TRANSFORMER = [(2, 256), (256, 256), (256,)]  # the default suite's subset (seconds)
TRANSFORMER_FULL = [(2, 256), (256, 256), (1024, 256), (256, 1024), (256,)]  # -m slow (minutes)
LR, WD, FREQ = 3e-3, 1e-2, 10


def gradient(p: torch.Tensor, target: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A quadratic pull towards `target` plus seeded noise with some structure (rank-deficient rows), so the
    Kronecker factors change from step to step."""
    noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
    if p.dim() >= 3:
        noise[:, ::3] *= 0.1
    return (p - target) + 0.3 * noise


def run_both(shapes, members: int, steps: int, nan_at: tuple[int, int] | None = None, capturable: bool = False):
    """(stacked params, per-member reference params) after `steps` steps from the same start and gradients;
    `capturable`: StackedSoap as full-soap builds it on CUDA (its step size on the device)."""
    start = [torch.randn(members, *s, generator=gens("soap-p", s, members=1)[0], dtype=F64) for s in shapes]
    targets = [torch.randn(members, *s, generator=gens("soap-t", s, members=1)[0], dtype=F64) for s in shapes]
    stacked = [torch.nn.Parameter(x.clone()) for x in start]
    opt = StackedSoap(stacked, lr=LR, weight_decay=WD, precondition_frequency=FREQ, capturable=capturable)
    reference = [[torch.nn.Parameter(x[e].clone()) for x in start] for e in range(members)]
    ref_opts = [SOAP(ps, lr=LR, weight_decay=WD, precondition_frequency=FREQ) for ps in reference]
    dead = [False] * members
    for t in range(steps):
        noise = gens("soap-noise", t, members=1)[0]
        grads = [gradient(p.detach(), tgt, noise) for p, tgt in zip(stacked, targets)]
        if nan_at is not None and t >= nan_at[0]:
            grads[0][nan_at[1]] = float("nan")
        for p, grad in zip(stacked, grads):
            p.grad = grad.clone()
        opt.step()
        for e in range(members):
            member_grads = [grad[e] for grad in grads]
            if dead[e] or not all(torch.isfinite(x).all() for x in member_grads):
                dead[e] = True  # one optimizer per member: a diverged member is skipped from then on
                continue
            for p, grad in zip(reference[e], member_grads):
                p.grad = grad.clone()
            ref_opts[e].step()
    return stacked, reference


def max_relative_error(stacked, reference, members) -> float:
    worst = 0.0
    for i, p in enumerate(stacked):
        want = torch.stack([reference[e][i].detach() for e in members])
        got = p.detach()[list(members)]
        worst = max(worst, ((got - want).norm() / want.norm()).item())
    return worst


@pytest.mark.parametrize("capturable", [False, True], ids=["host-step-size", "capturable"])
@pytest.mark.parametrize(
    "shapes",
    [
        DEEP_NARROW,
        TRANSFORMER,
        pytest.param(TRANSFORMER_FULL, marks=pytest.mark.slow),
    ],
    ids=["deep-narrow", "transformer", "transformer-full"],
)
def test_one_batched_step_equals_soap_per_member(shapes, capturable):
    members = 3 if shapes is DEEP_NARROW else 2
    stacked, reference = run_both(shapes, members, steps=6 * FREQ, capturable=capturable)
    assert max_relative_error(stacked, reference, range(members)) < 1e-6
    moved = [(p.detach() - torch.stack([r[i] for r in reference]).detach()).abs().max() for i, p in enumerate(stacked)]
    assert all(m < 1e-6 for m in moved)


def test_members_never_mix_and_a_diverged_member_stops():
    members = 3
    stacked, reference = run_both(DEEP_NARROW, members, steps=3 * FREQ, nan_at=(15, 1))
    assert max_relative_error(stacked, reference, [0, 2]) < 1e-6  # the others equal their own SOAP
    frozen, _ = run_both(DEEP_NARROW, members, steps=15)  # member 1 as it was before its gradient turned NaN
    for p, q in zip(stacked, frozen):
        assert torch.equal(p.detach()[1], q.detach()[1])


def test_the_parameters_change_and_the_first_step_only_initialises():
    p = torch.nn.Parameter(torch.ones(2, 4, 3, dtype=F64))
    opt = StackedSoap([p], lr=LR)
    p.grad = torch.ones_like(p)
    opt.step()
    assert torch.equal(p.detach(), torch.ones_like(p))  # pytorch_optimizer's SOAP skips the update on step 1
    p.grad = torch.ones_like(p)
    opt.step()
    assert (p.detach() < 1).all()


@pytest.mark.parametrize("capturable", [False, True], ids=["host-step-size", "capturable"])
def test_an_ordinary_step_never_waits_for_the_device(capturable):
    """After the first step (whose eigendecompositions may retry, which reads the device), no step reads a value back
    to the host, a refresh of the eigenbases included: on CUDA such a read stalls every step's launches until the
    device has caught up. The meta device stands in: its tensors have no values, so any read raises."""
    ps = [torch.nn.Parameter(torch.empty(3, *s, device="meta")) for s in DEEP_NARROW]
    opt = StackedSoap(ps, lr=LR, precondition_frequency=FREQ, capturable=capturable)
    for _ in range(2 * FREQ + 2):  # two refreshes
        for p in ps:
            p.grad = torch.empty_like(p)
        opt.step()
    assert opt.steps == 2 * FREQ + 2


def test_a_refresh_is_recordable_where_it_is_device_work_alone():
    """`refresh_recordable`, which lets engine/step.py's CapturedRefresh record the eigenbases' refresh in a CUDA
    graph: on the meta device (CUDA's code path, off LAPACK_QR_DEVICES; its tensors have no values, so a read back
    raises) deep-narrow's factors (32 and less) are recordable once the first step has built them, and their refresh
    calls no linear-algebra library (a recording cannot hold cuSOLVER's per-matrix calls); a factor of 65 is not
    recordable, and nothing is on the CPU (LAPACK's QR, the CPU's numbers)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.name())
            return func(*args, **(kwargs or {}))

    def first_step(shapes, device):
        ps = [torch.nn.Parameter(torch.empty(3, *s, device=device).normal_()) for s in shapes]
        opt = StackedSoap(ps, lr=LR, precondition_frequency=FREQ)
        assert not opt.refresh_recordable()  # no factors before the first step
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
        return opt

    opt = first_step(DEEP_NARROW, "meta")
    assert opt.refresh_recordable()
    with Ops() as ops:
        opt.refresh()
    calls = ("linalg_qr", "geqrf", "orgqr", "householder_product", "eigh", "linalg_eig", "svd", "cholesky", "solve")
    library = [n for n in ops.names if any(w in n for w in calls)]
    assert ops.names and not library, library
    assert not first_step([(32, 32), (65, 4)], "meta").refresh_recordable()
    assert first_step([(32, 32), (64, 4)], "meta").refresh_recordable()
    assert not first_step(DEEP_NARROW, "cpu").refresh_recordable()


def test_a_capturable_update_reads_only_the_device_and_keeps_its_tensors_in_place():
    """What a CUDA graph needs of full-soap's update on CUDA (`capturable`): `update()`, the part a graph records
    and replays, reads the step's size from the device, never the host's step count (a recording holds the value it
    read once); and every state tensor keeps its memory over refreshes of the eigenbases (a replay reads the
    recorded addresses). Two optimisers step in lockstep from the same gradients; the second's host step count is
    scrambled while its update runs, which must change nothing."""

    def make():
        ps = [torch.nn.Parameter(torch.randn(3, *s, generator=gens("soap-c", s, members=1)[0], dtype=F64))
              for s in DEEP_NARROW]  # fmt: skip
        return ps, StackedSoap(ps, lr=LR, weight_decay=WD, precondition_frequency=FREQ, capturable=True)

    (pa, a), (pb, b) = make(), make()
    addresses = None
    for t in range(3 * FREQ + 1):  # three refreshes
        noise = gens("soap-noise", t, members=1)[0]
        grads = [torch.randn(p.shape, generator=noise, dtype=F64) for p in pa]
        for p, q, g in zip(pa, pb, grads):
            p.grad, q.grad = g.clone(), g.clone()
        if t == 0:
            a.step(), b.step()
            addresses = [x.data_ptr() for x in b.tensors()]
            continue
        a.step()
        b.before_update()
        counted, b.steps = b.steps, 10**6 + 7  # an update that read the host's count would use this
        b.update()
        b.steps = counted
        b.after_update()
        assert [x.data_ptr() for x in b.tensors()] == addresses, t
    assert all(torch.equal(p.detach(), q.detach()) for p, q in zip(pa, pb))
    assert not all(torch.equal(p.detach(), q) for p, q in zip(pa, make()[0]))  # it trained


def test_rejects_unstacked_parameters():
    with pytest.raises(ValueError, match="stacked"):
        StackedSoap([torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 3))], lr=1e-3)


def cusolver_like(bad: torch.Tensor | None):
    """A stand-in for CUDA's batched eigh (qlbench.soap._eigenvectors): a batch fails to converge when it holds the
    matrix `bad` (every batch, when bad is None); a matrix alone fails only when it is `bad` in float32."""
    real = torch.linalg.eigh

    def eigh(m):
        holds_bad = bad is not None and any(torch.equal(x.to(bad.dtype), bad) for x in m.reshape(-1, *m.shape[-2:]))
        if (m.dim() == 3 and (bad is None or holds_bad)) or (m.dim() == 2 and m.dtype == torch.float32 and holds_bad):
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge (stand-in)")
        return real(m)

    return eigh


def test_an_eigendecomposition_that_does_not_converge_is_solved_per_matrix_then_in_float64(monkeypatch):
    """Each matrix of a failed batch gets an eigenbasis of its own (checked against its definition: orthonormal
    columns that diagonalise it, eigenvalues ascending); the one that fails alone too gets float64's, the others
    float32's alone."""
    from qlbench.soap import _eigenvectors

    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 6, 6, generator=g)
    m = a @ a.transpose(1, 2)  # (4, 6, 6), symmetric
    expected = [torch.linalg.eigh(x)[1] for x in m]
    expected[2] = torch.linalg.eigh(m[2].double())[1].float()
    monkeypatch.setattr(torch.linalg, "eigh", cusolver_like(bad=m[2].clone()))
    q = _eigenvectors(m)
    for i in range(4):
        d = q[i].T @ m[i] @ q[i]
        torch.testing.assert_close(q[i].T @ q[i], torch.eye(6), atol=1e-5, rtol=0)
        torch.testing.assert_close(d - torch.diag(d.diagonal()), torch.zeros(6, 6), atol=1e-3, rtol=0)
        assert (d.diagonal().diff() >= 0).all()
        assert torch.equal(q[i], expected[i]), i


def test_stacked_soap_whose_batched_eigh_fails_still_equals_soap_per_member(monkeypatch):
    """Every batched eigendecomposition failing: the per-matrix retry keeps each member's basis its own (members in
    order, never mixed), so the stack still equals pytorch_optimizer's SOAP per member."""
    monkeypatch.setattr(torch.linalg, "eigh", cusolver_like(bad=None))
    stacked, reference = run_both(DEEP_NARROW, 3, steps=2 * FREQ)
    assert max_relative_error(stacked, reference, range(3)) < 1e-6


def structured_batch(s: int, dtype=F64) -> torch.Tensor:
    """Random square matrices (B, s, s), and the cases LAPACK treats apart: a zero column (no reflection there), the
    zero matrix, the identity (nothing below any diagonal: no reflection at all), an upper-triangular matrix with
    negative diagonal entries (each sign kept)."""
    g = torch.Generator().manual_seed(s)
    a = torch.randn(12, s, s, generator=g, dtype=dtype)
    a[0, :, s // 2] = 0
    a[1] = 0
    a[2] = torch.eye(s, dtype=dtype)
    a[3] = torch.triu(torch.randn(s, s, generator=g, dtype=dtype)) - 2 * torch.eye(s, dtype=dtype)
    return a


@pytest.mark.parametrize("s", [1, 2, 5, 32])
def test_the_batched_householder_q_is_lapacks_q(s):
    """`householder_q` (the refresh's QR on CUDA, up to HOUSEHOLDER_MAX_SIZE) against torch.linalg.qr, LAPACK's
    geqrf + orgqr, the oracle: the same Q to rounding in float64, signs included, on random matrices and on the
    cases where LAPACK reflects nothing; its columns orthonormal and Q^T A upper triangular."""
    from qlbench.soap import householder_q

    a = structured_batch(s)
    q = householder_q(a)
    assert torch.allclose(q, torch.linalg.qr(a)[0], rtol=0, atol=1e-12)
    eye = torch.eye(s, dtype=F64)
    assert torch.allclose(q.mT @ q, eye.expand_as(q), atol=1e-12)
    r = q.mT @ a
    assert torch.allclose(r.tril(-1), torch.zeros_like(r), atol=1e-12)
    in32 = householder_q(a.float())  # the refresh's precision (pytorch_optimizer's QR runs in float32)
    assert torch.allclose(in32.double(), torch.linalg.qr(a)[0], atol=1e-5)
    # rank r < s (a factor of a weight with fewer rows than columns, deep-narrow's first layer): the first r columns
    # are LAPACK's; the others complete them to any orthonormal basis, decided by rounding (LAPACK's own float32 and
    # float64 QRs differ there), so only their orthonormality is asked
    r = max(1, s // 4)
    low = a[4:] @ torch.diag(torch.arange(s, dtype=F64) < r).to(F64)  # (8, s, s): rank r
    q = householder_q(low)
    assert torch.allclose(q[..., :r], torch.linalg.qr(low)[0][..., :r], rtol=0, atol=1e-12)
    assert torch.allclose(q.mT @ q, eye.expand_as(q), atol=1e-12)


def test_the_refreshs_qr_is_one_batch_per_size_and_each_q_its_own():
    """`orthonormal_bases` concatenates the batches of one size into one QR and splits the result back in order:
    each batch's Q equals its own QR bit for bit (each matrix factored alone), in the batch's dtype."""
    from qlbench.soap import orthonormal_bases, orthonormal_basis

    g = torch.Generator().manual_seed(0)
    powers = [torch.randn(b, s, s, generator=g, dtype=F64) for b, s in [(2, 3), (4, 5), (1, 3), (3, 5), (2, 1)]]
    for p, q in zip(powers, orthonormal_bases(powers), strict=True):
        assert q.dtype == F64 and torch.equal(q, orthonormal_basis(p.float()).to(F64))


def test_stacked_soap_with_the_householder_qr_equals_soap_per_member(monkeypatch):
    """The refresh as it runs on CUDA (`householder_q`, forced here on the CPU) keeps StackedSoap equal to
    pytorch_optimizer.SOAP per member, over six refreshes, to the tolerance of the LAPACK path, where every
    Kronecker factor has full rank (a square weight, a 5 x 7 one). A factor of lower rank (deep-narrow's (32, 2) and
    (1, 32) weights: factors of 32 of rank 2 and 1) leaves Q's other columns to rounding, in float32 as
    pytorch_optimizer's QR runs: there the two QRs, like LAPACK's float32 and float64 ones, differ by O(1), and SOAP's
    normalisation by the tiny second moments of those directions carries it into the weights (7e-4 relative after
    one refresh; the QR test above checks those factors' leading columns instead)."""
    import qlbench.soap

    monkeypatch.setattr(qlbench.soap, "LAPACK_QR_DEVICES", frozenset())
    stacked, reference = run_both([(32, 32), (5, 7), (32,)], 3, steps=6 * FREQ, capturable=True)
    assert max_relative_error(stacked, reference, range(3)) < 1e-6
