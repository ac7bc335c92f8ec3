"""SOAP (Vyas et al. 2024, arXiv 2409.11321) for stacked parameters: one step updates every member at once.

A stacked parameter has a leading member dimension E (qlbench/stacked.py); SOAP preconditions each member's weight
matrix with the eigenbases of its own gradient statistics, so member e's Kronecker factors GG (E, d, d) and
eigenbases Q (E, d, d) are held as batched tensors and every op (outer products, projections, `eigh`, `qr`) is
batched over E. No op mixes members: `StackedSoap` on a stack equals `pytorch_optimizer.SOAP` run once per member
(tests/test_soap.py, float64, over refreshes of the eigenbases).

It follows pytorch_optimizer.SOAP's algorithm with the options qlbench uses (its defaults: no dimension merging, no
preconditioning of 1-D parameters, bias correction, decoupled weight decay scaled by lr, eps = 1e-8):

    first step       GG_i = (1 - beta_s) G_(i) G_(i)^T for every dimension i of the member tensor G;
                     Q_i = eigenvectors of GG_i, eigenvalues descending; no parameter update
    every step t>=1  G' = G x_i Q_i^T (projected),  m = lerp(m, G, 1 - beta1),  v = lerp(v, G'^2, 1 - beta2)
                     p -= lr sqrt(1 - beta2^t) / (1 - beta1^t) * ((m x_i Q_i^T) / (sqrt(v) + eps)) x_i Q_i
                     p *= 1 - lr weight_decay;  GG_i = lerp(GG_i, G_(i) G_(i)^T, 1 - beta_s)
                     every `precondition_frequency` steps: Q_i = qr(GG_i Q_i sorted by its estimated eigenvalues)
                     (one power iteration, QR in float32 as pytorch_optimizer does), v permuted to the new order

On CUDA (`capturable`, which `adapters.full` sets there, as torch.optim's AdamW is) the update can be recorded in a
CUDA graph (engine/step.py): the host keeps the step count and decides the refreshes, the device only reads fixed
tensors. A step is then three parts: `before_update` (host: count the step, write its step size into a device
scalar), `update` (device only: what a graph records and replays) and `after_update` (host: refresh the eigenbases
when due, in place; the engine records that refresh in a graph of its own where it is device work alone,
`refresh_recordable`). `step()` runs the three, so an eager CUDA step is the same kernels as a replayed one.
Off CUDA the step size is a Python scalar, so the CPU's numbers keep their bits. The refresh's QRs run as one
batch per matrix size; off the CPU, matrices up to HOUSEHOLDER_MAX_SIZE take `householder_q`, LAPACK's reflections in
batched ops, since CUDA's torch.linalg.qr forms each Q in a call of its own.

Parameters with the same member shape (the deep-narrow MLP's 32 hidden weights, say) are processed as one batch of
P x E matrices, so a step costs a few dozen batched ops whatever the depth. A member whose gradient turns non-finite
stops updating from that step on (it is diverged; the others go on), as with one optimizer per member.
"""

from __future__ import annotations

import math

import torch

MAX_PRECONDITION_DIM = 10000  # pytorch_optimizer.SOAP's default max_precondition_dim: larger dims are not rotated


class StackedSoap:
    """SOAP over stacked parameters (each of shape (E, *member_shape)); the interface the engine uses of an
    optimizer: step(), zero_grad(), state_dict(), load_state_dict()."""

    def __init__(
        self,
        params,
        *,
        lr: float,
        betas: tuple[float, float] = (0.95, 0.95),
        weight_decay: float = 1e-2,
        precondition_frequency: int = 10,
        eps: float = 1e-8,
        capturable: bool = False,
    ):
        params = list(params)
        if not params:
            raise ValueError("StackedSoap needs at least one parameter")
        self.members = params[0].shape[0]
        if any(p.dim() < 2 or p.shape[0] != self.members for p in params):
            raise ValueError(f"every parameter must be stacked as (E={self.members}, ...)")
        self.lr, self.betas, self.weight_decay, self.eps = lr, tuple(betas), weight_decay, eps
        self.frequency = precondition_frequency
        self.shampoo_beta = betas[1]  # pytorch_optimizer.SOAP's default (shampoo_beta None)
        self.max_dim = MAX_PRECONDITION_DIM
        self.steps = 0  # pytorch_optimizer's group["step"]: the first call only initialises
        groups: dict[tuple, list] = {}  # same member shape, dtype and device: one batch of P x E members
        for p in params:
            groups.setdefault((tuple(p.shape), p.dtype, p.device), []).append(p)
        self.groups = [{"params": ps, "state": {}} for ps in groups.values()]
        self.live = torch.ones(self.members, dtype=torch.bool, device=params[0].device)  # (E,)
        # capturable: minus the step size on the device (written by before_update), else None (a Python scalar)
        self.capturable = capturable
        self.neg_step_size = torch.zeros((), dtype=params[0].dtype, device=params[0].device) if capturable else None

    # ----------------------------------------------------------------------------------------------------------
    # Batched pieces. X is (B, s_0, ..., s_{k-1}) with B = P x E; Q[i] is (B, s_i, s_i) or None (identity).

    def _factor_dims(self, member_shape) -> list[bool]:
        """Which member dimensions get a preconditioner (1-D members get none, like precondition_1d=False)."""
        return [len(member_shape) > 1 and s <= self.max_dim for s in member_shape]

    @staticmethod
    def _outer(g: torch.Tensor, i: int) -> torch.Tensor:
        """G_(i) G_(i)^T per member: g contracted with itself over every member dimension but i; (B, s_i, s_i)."""
        gi = g.movedim(i + 1, 1).reshape(g.shape[0], g.shape[i + 1], -1)  # (B, s_i, rest)
        return gi @ gi.transpose(1, 2)

    @staticmethod
    def _project(x: torch.Tensor, Q: list, backward: bool = False) -> torch.Tensor:
        """x x_i Q_i^T (forward: into the eigenbases) or x x_i Q_i (backward), dimension by dimension; like
        pytorch_optimizer's tensordot over the first dimension, which rotates the dimensions back into place."""
        B = x.shape[0]
        for q in Q:
            x = x.movedim(1, -1)  # (B, s_1, ..., s_0): the contracted dimension last
            if q is not None:
                rest = x.shape[1:-1]
                m = q.transpose(1, 2) if backward else q  # contract with Q's rows (forward) or columns (backward)
                x = (x.reshape(B, -1, x.shape[-1]) @ m).reshape(B, *rest, m.shape[-1])
        return x

    @staticmethod
    def _eigenbases(GG: list) -> list:
        """Eigenvectors of each GG_i, eigenvalues descending (pytorch_optimizer: eigh of GG + 1e-30 I, flipped)."""
        out = []
        for m in GG:
            if m is None:
                out.append(None)
                continue
            eye = torch.eye(m.shape[-1], device=m.device, dtype=m.dtype)
            out.append(torch.flip(_eigenvectors(m + 1e-30 * eye), dims=[-1]))
        return out

    @staticmethod
    def _powers(state: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One power iteration per factor of a group, columns sorted by estimated eigenvalue, v permuted alike (in
        place); each factor's (Q, the product to orthonormalise into its new Q)."""
        v = state["exp_avg_sq"]  # (B, *member_shape)
        out = []
        for i, (m, o) in enumerate(zip(state["GG"], state["Q"])):
            if m is None:
                continue
            product = m @ o  # (B, s, s)
            estimate = (o * product).sum(dim=1)  # (B, s): o_j^T GG o_j per column j
            order = torch.argsort(estimate, dim=-1, descending=True)  # (B, s)
            shape = [v.shape[0]] + [1] * (v.dim() - 1)
            shape[i + 1] = v.shape[i + 1]
            v = torch.gather(v, i + 1, order.view(shape).expand_as(v))
            out.append((o, torch.gather(product, 2, order.unsqueeze(1).expand_as(product))))  # columns in that order
        state["exp_avg_sq"].copy_(v)  # in place: a recorded update reads these tensors at every replay
        return out

    def _accumulate(self, state: dict, g: torch.Tensor) -> None:
        """GG_i = lerp(GG_i, G_(i) G_(i)^T, 1 - beta_s): every step, on the device."""
        for i, m in enumerate(state["GG"]):
            if m is not None:
                m.lerp_(self._outer(g, i).to(m.dtype), 1.0 - self.shampoo_beta)

    # ----------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """One SOAP step of every live member. Every trainable parameter must have a gradient."""
        if self.steps == 0:  # pytorch_optimizer's init_group: the state, and the first eigenbases; no update
            batches = self._gradients()
            for group, g in zip(self.groups, batches):
                state = group["state"]
                state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(g), torch.zeros_like(g)
                state["GG"] = [
                    torch.zeros(g.shape[0], s, s, device=g.device, dtype=g.dtype) if use else None
                    for s, use in zip(g.shape[1:], self._factor_dims(g.shape[1:]))
                ]
                self._accumulate(state, g)
                state["Q"] = self._eigenbases(state["GG"])
            self.steps = 1
            return
        self.before_update()
        self.update()
        self.after_update()

    def before_update(self) -> None:
        """The host's part before an update: count the step; on CUDA, write its step size to the device."""
        if self.steps == 0:
            raise RuntimeError("StackedSoap: the first step() initialises the state; it cannot be recorded")
        self.steps += 1
        if self.capturable:
            self.neg_step_size.fill_(-self._step_size())

    def _step_size(self) -> float:
        beta1, beta2 = self.betas
        step = self.steps - 1
        return self.lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)

    @torch.no_grad()
    def update(self) -> None:
        """The update itself, on the device alone when `capturable` (what a CUDA graph records): the moments, the
        preconditioned step, the decay and the Kronecker factors' running averages."""
        beta1, beta2 = self.betas
        step_size = None if self.capturable else self._step_size()
        for group, g in zip(self.groups, self._gradients()):
            state, params = group["state"], group["params"]
            m, v, Q = state["exp_avg"], state["exp_avg_sq"], state["Q"]
            m.lerp_(g, 1.0 - beta1)
            v.lerp_(self._project(g, Q).square(), 1.0 - beta2)
            update = self._project(self._project(m, Q) / (v.sqrt() + self.eps), Q, backward=True)  # (B, ...)
            update = update.unflatten(0, (len(params), self.members))  # (P, E, *member_shape)
            # a diverged member neither moves nor decays: masked on the device whether or not one has diverged, so
            # the step never waits for the device to say (on CUDA that wait stalled every step's launches). While
            # every member is live the bits are those of the unmasked step: keep is 1, and the decay is 1 - lr wd
            # rounded once to the parameters' dtype, as a Python scalar factor is
            keep = _expand(self.live, update, at=1).to(update.dtype)  # (1, E, 1, ...)
            if step_size is None:
                torch._foreach_add_(params, list((update * (keep * self.neg_step_size)).unbind(0)))
            else:
                torch._foreach_add_(params, list((update * keep).unbind(0)), alpha=-step_size)
            if self.weight_decay:
                decay = torch.full_like(keep[0], 1.0 - self.lr * self.weight_decay).masked_fill_(keep[0] == 0, 1.0)
                torch._foreach_mul_(params, [decay] * len(params))
            self._accumulate(state, g)

    def after_update(self) -> None:
        """The host's part after an update: every `precondition_frequency` steps, refresh the eigenbases (eagerly,
        in place: a recorded update reads the same tensors)."""
        if self.refresh_due():
            self.refresh()

    def refresh_due(self) -> bool:
        """Whether the step just updated is one whose eigenbases are refreshed (every `precondition_frequency`)."""
        return (self.steps - 1) % self.frequency == 0

    def refresh_recordable(self) -> bool:
        """Whether `refresh` is device work alone, with nothing read back to the host, so that a CUDA graph can
        record it (engine/step.py `CapturedRefresh`): once the first step has built the factors, off
        LAPACK_QR_DEVICES, with every factor at most HOUSEHOLDER_MAX_SIZE (`householder_q`'s batched ops; CUDA's
        torch.linalg.qr calls cuSOLVER once per matrix). Deep-narrow's factors (32 and less) are; the
        Transformer's 256 and 1,024 are not. tests/test_soap.py runs such a refresh under a dispatch mode that fails
        on any op that reads the device back or calls LAPACK."""
        if self.steps == 0 or self.live.device.type in LAPACK_QR_DEVICES:
            return False
        return all(m.shape[-1] <= HOUSEHOLDER_MAX_SIZE for g in self.groups for m in g["state"]["GG"] if m is not None)

    def refresh(self, lapack_qr: bool = False) -> None:
        """Every group's eigenbases refreshed now (one power iteration and QR per factor; `after_update` calls it
        every `precondition_frequency` steps). Eager, launched from the host: on CUDA the one part of a step that a
        captured step does not record, so a bench that times fewer steps than its period leaves it out. The QRs of
        every group's factors of one size run as one batch (`orthonormal_bases`); `lapack_qr`: torch.linalg.qr at
        every size on every device (`qlbench bench`'s soap row times it against `householder_q`)."""
        pairs = [pair for group in self.groups for pair in self._powers(group["state"])]
        for (old, _), q in zip(pairs, orthonormal_bases([power for _, power in pairs], lapack_qr)):
            old.copy_(q)  # in place: a recorded update reads these tensors at every replay

    def _gradients(self) -> list[torch.Tensor]:
        """Each group's gradients as one batch (B = P x E, *member_shape), a diverged member's zeroed; a member
        whose gradient is not finite is marked diverged first (on the device)."""
        for group in self.groups:
            if any(p.grad is None for p in group["params"]):
                raise ValueError("StackedSoap: a parameter has no gradient (full fine-tuning trains every weight)")
        stacked = [torch.stack([p.grad for p in group["params"]]) for group in self.groups]  # (P, E, *member_shape)
        for g in stacked:
            self.live &= torch.isfinite(g).transpose(0, 1).flatten(1).all(dim=1)  # (E,)
        zero = torch.zeros((), dtype=stacked[0].dtype, device=stacked[0].device)
        return [torch.where(_expand(self.live, g, at=1), g, zero).flatten(0, 1) for g in stacked]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the optimiser's state, `live` and the device step size included (what a recorded update
        reads and writes; a snapshot of these restores the optimiser)."""
        out = [self.live] + ([self.neg_step_size] if self.capturable else [])
        for group in self.groups:
            state = group["state"]
            if state:
                out += [state["exp_avg"], state["exp_avg_sq"]]
                out += [t for t in state["GG"] + state["Q"] if t is not None]
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.groups:
            for p in group["params"]:
                p.grad = None

    def state_dict(self) -> dict:
        """The step count, the live members (E,) and each group's state (references, as torch.optim's)."""
        return {"steps": self.steps, "live": self.live, "state": [g["state"] for g in self.groups]}

    @torch.no_grad()
    def load_state_dict(self, saved: dict) -> None:
        """Restore a `state_dict` (a stage resumed from its snapshot, engine/snapshot.py). State that exists is
        overwritten in place (a recorded update reads those tensors); an empty state (before the first step) is
        built from copies on the parameters' device."""
        if len(saved["state"]) != len(self.groups):
            raise ValueError(f"StackedSoap: a state of {len(saved['state'])} groups for {len(self.groups)}")
        self.steps = int(saved["steps"])
        self.live.copy_(saved["live"])
        device = self.live.device
        for group, state in zip(self.groups, saved["state"]):
            mine = group["state"]
            if not state:
                mine.clear()
            elif mine:
                for key in ("exp_avg", "exp_avg_sq"):
                    mine[key].copy_(state[key])
                for key in ("GG", "Q"):
                    for old, new in zip(mine[key], state[key], strict=True):
                        if old is not None:
                            old.copy_(new)
            else:
                copy = lambda t: None if t is None else t.to(device, copy=True)
                mine["exp_avg"], mine["exp_avg_sq"] = copy(state["exp_avg"]), copy(state["exp_avg_sq"])
                mine["GG"], mine["Q"] = [copy(t) for t in state["GG"]], [copy(t) for t in state["Q"]]


def _expand(mask: torch.Tensor, like: torch.Tensor, at: int = 0) -> torch.Tensor:
    """(E,) -> shape broadcastable against `like` whose dimension `at` is the member dimension."""
    return mask.view(*([1] * at), -1, *([1] * (like.dim() - at - 1)))


def _eigenvectors(m: torch.Tensor) -> torch.Tensor:
    """Eigenvectors (ascending eigenvalues) of each symmetric matrix in the batch m (B, s, s). CUDA's batched
    solver (Jacobi, for small matrices) can stop without converging on an ill-conditioned or degenerate GG
    (LinAlgError "The algorithm failed to converge", which a quick deep-narrow full-soap run on CUDA can raise);
    LAPACK on the CPU converges there. Then each matrix is solved alone, and one that fails alone again in
    float64, as the SOAP authors' code retries (qlbench interpretation: the retry per matrix, so that the other
    members' bases are the ones they get in a stack of their own). The first attempt is the only one on the CPU."""
    try:
        return torch.linalg.eigh(m)[1]
    except torch.linalg.LinAlgError:
        pass
    out = []
    for one in m:
        try:
            out.append(torch.linalg.eigh(one)[1])
        except torch.linalg.LinAlgError:
            out.append(torch.linalg.eigh(one.to(torch.float64))[1].to(m.dtype))
    return torch.stack(out)


# Devices whose `torch.linalg.qr` the refresh uses at every size (LAPACK's geqrf + orgqr). Elsewhere (CUDA) matrices
# up to HOUSEHOLDER_MAX_SIZE take `householder_q`: PyTorch factors a batch of small matrices in one cuBLAS call there,
# but forms each Q in a cuSOLVER call of its own (orgqr, looped over the batch): 3,060 Qs one by one at every refresh
# of a deep-narrow stack of 45 members (docs/speed.md). Larger matrices (the Transformer's 256 and 1,024) keep
# torch.linalg.qr: each of those calls has work to do, and the Householder loop's launches grow with the size.
LAPACK_QR_DEVICES = frozenset({"cpu"})
HOUSEHOLDER_MAX_SIZE = 64


def orthonormal_bases(powers: list[torch.Tensor], lapack_qr: bool = False) -> list[torch.Tensor]:
    """Each (B_k, s_k, s_k) batch's Q (`orthonormal_basis`, in float32 as pytorch_optimizer's QR, returned in the
    batch's dtype), the batches of one size and dtype concatenated into one: on CUDA the Householder QR's launches
    follow the sizes, not the batches (deep-narrow's six factor batches are four of 32 x 32). Each matrix is
    factored alone either way, so its Q does not depend on the batch it is in."""
    sizes: dict[tuple, list[int]] = {}
    for k, p in enumerate(powers):
        sizes.setdefault((p.shape[1:], p.dtype), []).append(k)
    out: list[torch.Tensor | None] = [None] * len(powers)
    for ks in sizes.values():
        together = torch.cat([powers[k] for k in ks]).to(torch.float32)  # (sum of B_k, s, s)
        qs = orthonormal_basis(together, lapack_qr).split([powers[k].shape[0] for k in ks])
        for k, q in zip(ks, qs):
            out[k] = q.to(powers[k].dtype)
    return out


def orthonormal_basis(a: torch.Tensor, lapack_qr: bool = False) -> torch.Tensor:
    """Q of the QR decomposition of each square matrix in the batch a (B, s, s): `torch.linalg.qr` on the devices of
    LAPACK_QR_DEVICES (so the CPU's numbers keep their bits) and above HOUSEHOLDER_MAX_SIZE, `householder_q` elsewhere
    (the same reflections, in batched ops; equal to rounding, tests/test_soap.py); with `lapack_qr`, torch.linalg.qr
    everywhere."""
    if lapack_qr or a.device.type in LAPACK_QR_DEVICES or a.shape[-1] > HOUSEHOLDER_MAX_SIZE:
        return torch.linalg.qr(a)[0]
    return householder_q(a)


def householder_q(a: torch.Tensor) -> torch.Tensor:
    """Q of the QR decomposition of each square matrix in the batch a (B, s, s), as LAPACK computes it (geqrf, then
    orgqr: torch.linalg.qr's Q), in O(s) batched ops whatever B. Column k's reflection H_k = I - tau_k v_k v_k^T
    (LAPACK's larfg): x = the column from the diagonal down, alpha = x_0, beta = -sign(alpha) ||x||, v_k = x / (alpha -
    beta) with v_k[0] = 1, tau_k = (beta - alpha) / beta; where x below its diagonal is zero, tau_k = 0 (no
    reflection). Then Q = H_0 H_1 ... H_(s-1), formed from the last reflection back (orgqr's order)."""
    B, s, s2 = a.shape
    if s != s2:
        raise ValueError(f"householder_q: square matrices only, got {tuple(a.shape)}")
    r = a.clone()
    vs, taus = [], []
    for k in range(s):
        x = r[:, k:, k]  # (B, s - k)
        alpha, below = x[:, 0], torch.linalg.vector_norm(x[:, 1:], dim=1)  # (B,), (B,)
        beta = -torch.copysign(torch.hypot(alpha, below), alpha)
        still = below == 0  # nothing to reflect
        tau = torch.where(still, 0.0, (beta - alpha) / beta)  # (B,)
        v = torch.where(still[:, None], 0.0, x / (alpha - beta).masked_fill(still, 1.0)[:, None])  # (B, s - k)
        v[:, 0] = 1.0
        if k < s - 1:  # the reflection applied to the columns right of k (column k becomes beta e_0: not needed)
            rest = r[:, k:, k + 1 :]  # (B, s - k, s - k - 1)
            rest -= (tau[:, None] * v).unsqueeze(2) @ (v.unsqueeze(1) @ rest)
        vs.append(v)
        taus.append(tau)
    q = torch.eye(s, dtype=a.dtype, device=a.device).expand(B, s, s).clone()  # (B, s, s)
    for k in reversed(range(s)):
        v, block = vs[k], q[:, k:, k:]  # (B, s - k), (B, s - k, s - k)
        block -= (taus[k][:, None] * v).unsqueeze(2) @ (v.unsqueeze(1) @ block)
    return q
