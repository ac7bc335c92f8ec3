"""Continual metrics against small cases computed by hand (and scipy's KL where it has the function)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import rel_entr

from qlbench.metrics import continual

# Three tasks trained in order; R[i, j]: task j's MSE after stage i.
R = np.array(
    [
        [0.2, 0.9, 0.8],
        [0.5, 0.1, 0.7],
        [0.4, 0.3, 0.05],
    ]
)
INITIAL = np.array([1.0, 1.0, 1.0])


def test_forgetting_is_final_minus_best_after_training():
    # task 0: best after training min(0.2, 0.5) = 0.2, final 0.4 -> 0.2; task 1: best 0.1, final 0.3 -> 0.2
    np.testing.assert_allclose(continual.forgetting(R), [0.2, 0.2])


def test_bwt_and_fwt_by_hand():
    # BWT = mean(R[0,0] - R[2,0], R[1,1] - R[2,1]) = mean(0.2 - 0.4, 0.1 - 0.3) = -0.2 (forgetting is negative)
    assert continual.bwt(R) == pytest.approx(-0.2)
    # FWT = mean(b1 - R[0,1], b2 - R[1,2]) = mean(1 - 0.9, 1 - 0.7) = 0.2 (earlier tasks helped)
    assert continual.fwt(R, INITIAL) == pytest.approx(0.2)
    assert continual.average(R) == pytest.approx((0.4 + 0.3 + 0.05) / 3)


def test_a_frozen_later_stage_forgets_nothing():
    """Stages that change nothing (the rows after a task's stage repeat) give forgetting and BWT exactly 0."""
    same = np.array([[0.3, 0.6], [0.3, 0.2]])
    assert continual.forgetting(same).tolist() == [0.0]
    assert continual.bwt(same) == 0.0


def test_joint_runs_have_no_continual_metrics():
    joint = np.array([[0.1, 0.2, 0.3]])
    assert np.isnan(continual.forgetting(joint)).all() and len(continual.forgetting(joint)) == 2
    assert math.isnan(continual.bwt(joint)) and math.isnan(continual.fwt(joint, INITIAL))
    with pytest.raises(ValueError, match="stages, tasks"):
        continual.bwt(np.zeros(3))


def test_symmetric_kl_against_scipy_and_by_hand():
    u = np.array([[0.5, 0.5, 0.0], [0.25, 0.25, 0.5], [0.5, 0.5, 0.0]])
    kl = continual.symmetric_kl(u)
    p = continual.smooth(u)
    assert kl[0, 1] == pytest.approx(rel_entr(p[0], p[1]).sum() + rel_entr(p[1], p[0]).sum())
    np.testing.assert_allclose(kl, kl.T)
    assert kl[0, 2] == 0.0 and np.diag(kl).tolist() == [0.0, 0.0, 0.0]  # equal usage: no divergence
    # without smoothing the divergence of disjoint supports would be infinite; with it, finite and large
    disjoint = continual.symmetric_kl(np.array([[1.0, 0.0], [0.0, 1.0]]))[0, 1]
    q = 1 - continual.SMOOTHING / 2
    by_hand = 2 * (q * math.log(q / (1 - q)) + (1 - q) * math.log((1 - q) / q))
    assert disjoint == pytest.approx(by_hand) and math.isfinite(disjoint)


def test_route_drift_is_total_variation_between_stages():
    U = np.array(
        [
            [[1.0, 0.0], [0.5, 0.5]],
            [[0.75, 0.25], [0.5, 0.5]],
        ]
    )  # (S=2, T=2, M=2)
    np.testing.assert_allclose(continual.route_drift(U), [[0.25, 0.0]])
    np.testing.assert_allclose(continual.usage_drift(U)[0, 0], [-0.25, 0.25])


def test_atom_entropy_across_tasks():
    u = np.array([[0.5, 0.5, 0.0, 0.0], [0.5, 0.0, 1.0, 0.0]])  # atom 0 shared alike, 1 and 2 one task's, 3 unused
    h = continual.atom_entropy(u)
    np.testing.assert_allclose(h[:3], [1.0, 0.0, 0.0], atol=1e-12)
    assert math.isnan(h[3])
    # uneven sharing, by hand: atom used 0.3 and 0.1 -> p = (0.75, 0.25)
    h2 = continual.atom_entropy(np.array([[0.3], [0.1]]))[0]
    assert h2 == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / math.log(2))
