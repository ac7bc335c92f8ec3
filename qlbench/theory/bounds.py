"""The result of a theorem check: `Bound` (one statement, observed against its right-hand side, per item), its
tolerance REL_TOL, and the report order of the paper's statements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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
