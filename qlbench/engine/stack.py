"""What a stack is: E members (seeds, or functions x seeds) trained at once, each with its own data, data order,
initialisation and metrics, their parameters stacked on a leading dimension. The members and the padding of a
narrow stack, the members' stacked data, the curves a stage gives, evaluation, and a stack of source-pretrained
backbones (`Pretrained`, what engine/cache.py keeps and a method is built on).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from qlbench import zoo
from qlbench.backbones import build_backbone

Member = tuple[str, int]  # (function name, seed)

# Stack independence. A member's numbers must not depend on what else is in its stack (a cell run alone, inside a
# sweep, in another Ray group or after a resume). Measured on CPU (float32, both backbones, every stack width from 2
# to 17, one and two threads): every per-member kernel gives the same bits at any width E >= 2, but at E = 1 a
# batched matmul with one output column (the regression head) takes a matrix-vector path whose last bits differ, and
# training amplifies them (a 1e-3 weight difference after one Transformer epoch). So no stack is narrower than
# MIN_STACK: a single member trains beside a copy of itself, whose results are dropped (twice the work, only for a
# one-member stack; docs/speed.md). tests/test_stack_independence.py checks every method.
MIN_STACK = 2


def padded(members: list[Member]) -> list[Member]:
    """`members`, with copies of the first appended up to MIN_STACK (the copies' results are dropped)."""
    return list(members) + [members[0]] * (MIN_STACK - len(members)) if members else list(members)


# qlbench interpretation of the paper's "inf": a member diverged when an evaluated MSE is non-finite or grows past
# this factor times the larger of its own epoch-0 train MSE (where every method starts) and the variance of its
# training labels (what predicting the mean scores). Relative, not the paper's absolute 1e5: the zoo's labels are
# in raw units whose MSE scales differ by orders of magnitude.
DIVERGENCE_FACTOR = 100.0


@dataclass
class StackedData:
    """Per-member datasets stacked on a leading dimension: x (E, N, 2), y (E, N); in a multi-task suite also each
    sample's task index, task (E, N) long (None: one task); a validation set x_val (E, V, 2), y_val (E, V) where a
    learning rate is chosen (None: none)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    task_train: torch.Tensor | None = None
    task_test: torch.Tensor | None = None
    x_val: torch.Tensor | None = None
    y_val: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        members: list[Member],
        which: str,
        *,
        device,
        dtype,
        noise: str = zoo.DEFAULT_NOISE,
        validation: bool = False,
    ) -> StackedData:
        """The members' "source" or "target" datasets, labels noised by the construction `noise` (zoo.NOISES); with
        `validation`, the target's validation set too (zoo.Task.validation_data)."""
        tasks = [(zoo.task(f, noise), seed) for f, seed in members]
        data = cls.stack([getattr(t, f"{which}_data")(seed, dtype=dtype, device=device) for t, seed in tasks])
        if validation:
            val = [t.validation_data(seed, dtype=dtype, device=device) for t, seed in tasks]
            data.x_val, data.y_val = (torch.stack([v[i] for v in val]) for i in (0, 1))
        return data

    @classmethod
    def stack(
        cls, splits: list[zoo.Split], tasks: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    ) -> StackedData:
        """One member per split; `tasks`: per member its (train, test) task indices (N,), or None."""
        data = [torch.stack([getattr(s, k) for s in splits]) for k in ("x_train", "y_train", "x_test", "y_test")]
        if tasks is not None:
            data += [torch.stack([t[i] for t in tasks]).to(data[0].device) for i in (0, 1)]
        return cls(*data)


@dataclass
class Curves:
    """Per-member evaluation history: train and test MSE (E, n_evals) at `epochs`, NaN after divergence."""

    epochs: list[int]
    train_mse: torch.Tensor
    test_mse: torch.Tensor
    diverged_epoch: list[int | None]  # first evaluated epoch at which the member was non-finite
    # gradient diagnostics (gradients.py), from the last step of each evaluated epoch > 0; NaN after divergence
    grad_epochs: list[int] = field(default_factory=list)
    grad_layers: torch.Tensor | None = None  # (E, n_grad_epochs, L) per-layer gradient norms
    grad_shared: torch.Tensor | None = None  # (E, n_grad_epochs) the shared parameters' norm (None: none)
    # a stage resumed from its snapshot (engine/snapshot.py): the epoch it was taken at, and the seconds the earlier
    # processes had trained until then (None, 0.0: trained in one go)
    resumed_epoch: int | None = None
    earlier_s: float = 0.0
    val_mse: torch.Tensor | None = None  # (E, n_evals) validation MSE, NaN after divergence (None: no validation set)

    def first(self, n: int) -> Curves:
        """The curves of the first n members (drops a padded stack's copies)."""
        cut = lambda t: None if t is None else t[:n]
        return Curves(
            self.epochs,
            self.train_mse[:n],
            self.test_mse[:n],
            self.diverged_epoch[:n],
            self.grad_epochs,
            cut(self.grad_layers),
            cut(self.grad_shared),
            self.resumed_epoch,
            self.earlier_s,
            cut(self.val_mse),
        )

    def member_summary(self, e: int) -> dict:
        """Best train MSE, best test MSE (test-selected, as the paper reports) and the test MSE at the
        best-train epoch (selection that does not peek at the test set); with a validation set, the validation MSE
        at the best-train epoch too (what a learning rate is chosen by)."""
        tr, te = self.train_mse[e], self.test_mse[e]
        ok = torch.isfinite(tr) & torch.isfinite(te)
        val = {} if self.val_mse is None else {"val_at_best_train": None}
        if not ok.any():
            return (
                dict(
                    best_train_mse=None,
                    best_train_epoch=None,
                    best_test_mse=None,
                    best_test_epoch=None,
                    test_at_best_train=None,
                )
                | val
            )
        idx = torch.nonzero(ok).squeeze(1)
        i_tr = idx[tr[idx].argmin()].item()
        i_te = idx[te[idx].argmin()].item()
        if val:
            val["val_at_best_train"] = self.val_mse[e, i_tr].item()
        return (
            dict(
                best_train_mse=tr[i_tr].item(),
                best_train_epoch=self.epochs[i_tr],
                best_test_mse=te[i_te].item(),
                best_test_epoch=self.epochs[i_te],
                test_at_best_train=te[i_tr].item(),
            )
            | val
        )


@torch.no_grad()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, instruction=None, chunk: int = 1024, task=None
) -> torch.Tensor:
    """Per-member MSE (E,) of model on x (E, N, 2), y (E, N), in chunks of samples to bound memory; `task` (E, N)
    long: each sample's task in a suite (None: one task)."""
    return squared_errors(model, x, y, instruction, chunk, task).mean(dim=1)


@torch.no_grad()
def squared_errors(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, instruction=None, chunk: int = 1024, task=None
) -> torch.Tensor:
    """Per-sample squared errors (E, N) of model on x (E, N, 2), y (E, N), in chunks of samples."""
    cut = lambda t, i: None if t is None else t[:, i : i + chunk]
    return torch.cat(
        [
            (model(x[:, i : i + chunk], instruction, task=cut(task, i)) - y[:, i : i + chunk]).pow(2)
            for i in range(0, x.shape[1], chunk)
        ],
        dim=1,
    )


@dataclass
class Pretrained:
    """A stack of source-pretrained backbones: the stacked state and each member's source metrics."""

    arch: str
    members: list[Member]
    state: dict[str, torch.Tensor]  # stacked state_dict, CPU
    source_train_mse: list[float]
    source_test_mse: list[float]
    # the code each member's backbone was trained by ({commit, dirty}; None: a cache file written before it was
    # recorded). The cache is keyed by settings, not by code, so a record states which code made its backbones.
    git: list[dict | None] = field(default_factory=list)

    def select(self, members: list[Member]) -> Pretrained:
        """The sub-stack of the given members."""
        idx = [self.members.index(m) for m in members]
        return Pretrained(
            self.arch,
            list(members),
            {k: v[idx] for k, v in self.state.items()},
            [self.source_train_mse[i] for i in idx],
            [self.source_test_mse[i] for i in idx],
            [self.git[i] for i in idx] if self.git else [],
        )

    def commits(self) -> list[str]:
        """The distinct commits that trained these backbones, "unknown" for a cache file without one and a
        "+dirty" suffix for a dirty tree (records' run_info.settings.backbone_commits)."""
        names = {
            "unknown" if not g or not g.get("commit") else g["commit"] + ("+dirty" if g.get("dirty") else "")
            for g in self.git or [None]
        }
        return sorted(names)

    def model(self, *, device, dtype) -> nn.Module:
        """A fresh copy of the pretrained stack (methods modify their backbone in place)."""
        model = build_backbone(self.arch, self.members, device=device, dtype=dtype)
        model.load_state_dict(self.state)
        return model
