"""Generic checks that every card in the zoo passes (BoTorch test_functions style), plus the task protocol."""

from __future__ import annotations

import math
from importlib.resources import files
from pathlib import Path

import pytest
import torch

from qlbench import zoo

NAMES = zoo.names()
EXPECTED = [
    "ackley", "dropwave", "langermann", "levy", "matyas", "michalewicz", "rastrigin", "sin-cos", "styblinski-tang",
]  # fmt: skip
F64 = torch.float64


def _grid(bounds: torch.Tensor, n: int) -> torch.Tensor:
    """(n, n, 2) grid over the (2, 2) box, corners included."""
    t = torch.linspace(0, 1, n, dtype=F64)
    return bounds[0] + (bounds[1] - bounds[0]) * torch.stack(torch.meshgrid(t, t, indexing="xy"), dim=-1)


# ---------------------------------------------------------------------------------------------------------------
# Cards


def test_cards_ship_as_package_data():
    # The zoo reads the installed package `qlbench.functions`; every card in the repo's functions/ must be there.
    packaged = sorted(p.name for p in files("qlbench.functions").iterdir() if p.name.endswith(".toml"))
    in_repo = sorted(p.name for p in (Path(__file__).parents[1] / "functions").glob("*.toml"))
    assert packaged == in_repo == [f"{n}.toml" for n in EXPECTED]
    assert NAMES == EXPECTED


@pytest.mark.parametrize("name", NAMES)
def test_card_is_well_formed(name):
    c = zoo.card(name)
    assert c.name == name and c.display_name and c.formula and c.source_url.startswith("https://")
    # One sentence: instruction routing embeds it as a single description of the target surface.
    assert c.instruction.endswith(".") and ". " not in c.instruction
    assert len(c.bounds) == 2 and all(lo < hi for lo, hi in c.bounds)
    for x in c.optimum_locations:
        assert all(lo <= xi <= hi for xi, (lo, hi) in zip(x, c.bounds, strict=True))
    assert len(c.references) >= 2
    assert (c.rotation_deg, c.out_scale, c.out_shift) == (15.0, 1.0, 0.0)
    # The target table lists only coefficients that really change.
    assert c.target_coefficients
    assert all(v != c.coefficients[k] for k, v in c.target_coefficients.items())


# ---------------------------------------------------------------------------------------------------------------
# Formulas against the independently computed numbers in the cards


@pytest.mark.parametrize("name", NAMES)
def test_reference_values(name):
    f, c = zoo.function(name), zoo.card(name)
    x = torch.tensor([x for x, _ in c.references], dtype=F64)  # (n_ref, 2)
    expected = torch.tensor([v for _, v in c.references], dtype=F64)
    torch.testing.assert_close(f(x), expected, rtol=0, atol=c.tolerance)


@pytest.mark.parametrize("name", NAMES)
def test_optimum_value_at_every_location(name):
    f = zoo.function(name)
    x = torch.tensor(f.optimum_locations, dtype=F64)  # (n_opt, 2)
    expected = torch.full((len(x),), f.optimum_value, dtype=F64)
    torch.testing.assert_close(f(x), expected, rtol=0, atol=f.card.tolerance)


@pytest.mark.parametrize("name", NAMES)
def test_optimum_not_beaten_on_dense_grid(name):
    # A wrong sign or formula (e.g. negated Langermann, whose maximum is +5.16) puts values below the claimed
    # minimum somewhere in the box.
    f = zoo.function(name)
    y = f(_grid(f.bounds, 401))
    assert y.min().item() >= f.optimum_value - f.card.tolerance


@pytest.mark.parametrize("name", NAMES)
def test_batch_shapes_and_vectorisation(name):
    task = zoo.task(name)
    x = _grid(task.bounds, 4)[:3]  # (3, 4, 2)
    for f in (task.source, task.target):
        assert f(x[0, 0]).shape == ()
        assert f(x[0, :5]).shape == (4,)
        batched = f(x)
        assert batched.shape == (3, 4)
        looped = torch.stack([torch.stack([f(p) for p in row]) for row in x])
        torch.testing.assert_close(batched, looped, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_float32(name):
    task = zoo.task(name)
    x = _grid(task.bounds, 33).float()
    for f in (task.source, task.target):
        y32 = f(x)
        y64 = f(x.double())  # same points, so only the arithmetic precision differs
        assert y32.dtype == torch.float32
        # float32 arguments of cos/sin reach ~600 rad (Langermann), so allow a few 1e-5 of the function's scale.
        torch.testing.assert_close(y32.double(), y64, rtol=0, atol=1e-4 * y64.abs().max().item())


def test_overrides_change_the_function_and_drop_the_optimum():
    x = torch.tensor([1.0, 2.0], dtype=F64)
    f = zoo.function("matyas", b=0.0)
    assert f(x).item() == pytest.approx(0.26 * 5)
    assert f.optimum_value is None and f.optimum_locations is None
    assert zoo.function("matyas", b=0.48).optimum_value == 0.0  # the default value is no override
    langermann = zoo.function("langermann", c=[0.0, 0.0, 0.0, 0.0, 1.0])  # sequences accepted
    assert langermann(torch.tensor([7.0, 9.0], dtype=F64)).item() == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------------------------
# The target shift


@pytest.mark.parametrize("name", NAMES)
def test_target_differs_from_source(name):
    task = zoo.task(name)
    x = _grid(task.bounds, 41)
    ys, yt = task.source(x), task.target(x)
    assert (yt - ys).abs().max() > 0.1 * ys.std()


@pytest.mark.parametrize("name", NAMES)
def test_target_is_the_rotated_shifted_formula(name):
    # Composed by hand: z = c + R(phi) (x - c), R counter-clockwise, then the target coefficients, then out map.
    task, c = zoo.task(name), zoo.card(name)
    (lo1, hi1), (lo2, hi2) = c.bounds
    c1, c2 = (lo1 + hi1) / 2, (lo2 + hi2) / 2
    x1, x2 = lo1 + 0.3 * (hi1 - lo1), lo2 + 0.8 * (hi2 - lo2)
    phi = math.radians(c.rotation_deg)
    z1 = c1 + math.cos(phi) * (x1 - c1) - math.sin(phi) * (x2 - c2)
    z2 = c2 + math.sin(phi) * (x1 - c1) + math.cos(phi) * (x2 - c2)
    f_target = zoo.function(name, **c.target_coefficients)
    expected = c.out_scale * f_target(torch.tensor([z1, z2], dtype=F64)) + c.out_shift
    torch.testing.assert_close(task.target(torch.tensor([x1, x2], dtype=F64)), expected, rtol=0, atol=1e-12)


def test_target_matyas_by_hand():
    # Fully explicit for one card: a 0.26 -> 0.30, b 0.48 -> 0.40, 15 degrees about the origin.
    x1, x2 = 3.0, -1.0
    phi = math.radians(15)
    z1, z2 = math.cos(phi) * x1 - math.sin(phi) * x2, math.sin(phi) * x1 + math.cos(phi) * x2
    expected = 0.30 * (z1**2 + z2**2) - 0.40 * z1 * z2
    assert zoo.task("matyas").target(torch.tensor([x1, x2], dtype=F64)).item() == pytest.approx(expected, abs=1e-12)


def test_rotation_is_counter_clockwise():
    e1, e2 = torch.eye(2, dtype=F64)
    torch.testing.assert_close(zoo.rotation(90) @ e1, e2)


# ---------------------------------------------------------------------------------------------------------------
# Datasets


@pytest.mark.parametrize("name", NAMES)
def test_dataset_sizes_box_and_dtype(name):
    task = zoo.task(name)
    lo, hi = task.bounds.float()
    for split, (n_train, n_test) in [
        (task.source_data(0), (zoo.SOURCE_TRAIN, zoo.SOURCE_SIZE - zoo.SOURCE_TRAIN)),
        (task.target_data(0), (zoo.TARGET_TRAIN, zoo.TARGET_SIZE - zoo.TARGET_TRAIN)),
    ]:
        assert [tuple(t.shape) for t in split] == [(n_train, 2), (n_train,), (n_test, 2), (n_test,)]
        assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in split)
        x = torch.cat([split.x_train, split.x_test])
        assert ((x >= lo) & (x <= hi)).all()
    assert (zoo.SOURCE_SIZE, zoo.SOURCE_TRAIN, zoo.TARGET_SIZE, zoo.TARGET_TRAIN) == (3000, 2400, 1200, 400)


def test_dataset_deterministic_per_seed_and_dtype():
    task = zoo.task("dropwave")
    for draw in (task.source_data, task.target_data):
        a, b = draw(3), draw(3)
        assert all(torch.equal(u, v) for u, v in zip(a, b))
        # Drawn in float64, then cast: the dtype changes only the rounding.
        c = draw(3, dtype=torch.float64)
        assert all(torch.equal(u, v.float()) for u, v in zip(a, c))


def test_streams_are_independent():
    # Four streams (source/target x two seeds) must not share draws: a seed offset or a shared generator would
    # make some of these float64 coordinates coincide.
    task = zoo.task("langermann")
    streams = [s(seed, dtype=F64) for s in (task.source_data, task.target_data) for seed in (0, 1)]
    xs = [torch.cat([s.x_train, s.x_test]).flatten() for s in streams]
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            assert not torch.isin(xs[i], xs[j]).any(), (i, j)
    # Different seeds are uncorrelated draws, not shuffles of each other.
    a, b = xs[0][:4000], xs[1][:4000]
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 4 / math.sqrt(len(a))


def _noise_std(task, split_of, f):
    """The sample std of the added noise y - f(x) over a split's train and test labels, and the sample count."""
    x_train, y_train, x_test, y_test = split_of(0, F64)
    noise = torch.cat([y_train - f(x_train), y_test - f(x_test)])
    return noise.std().item(), noise.mean().item(), len(noise)


@pytest.mark.parametrize("name", NAMES)
def test_absolute_label_noise_is_gaussian_005(name):
    # y - f(x) is the added noise (labels come from f for the source and from the target for the target).
    # Sample std of n N(0, s^2) draws has std ~ s / sqrt(2n); allow 5 of those; the mean ~ s / sqrt(n).
    task = zoo.task(name, "absolute")
    for f, split_of in [(task.source, task.source_data), (task.target, task.target_data)]:
        std, mean, n = _noise_std(task, split_of, f)
        s = 0.05
        assert abs(std - s) < 5 * s / math.sqrt(2 * n)
        assert abs(mean) < 5 * s / math.sqrt(n)


@pytest.mark.parametrize("name", NAMES)
def test_relative_label_noise_is_a_twentieth_of_the_functions_spread(name):
    """The default noise: its std is 0.05 x the clean function's std. Oracle: the std of the clean labels of the
    same seeded draw (uniform on the box, 3,000 or 1,200 points: within about 8% of the box's std), not the grid the
    code measures on."""
    task = zoo.task(name)
    assert task.noise == "relative"
    for f, split_of in [(task.source, task.source_data), (task.target, task.target_data)]:
        x_train, _, x_test, _ = split_of(0, F64)
        spread = f(torch.cat([x_train, x_test])).std().item()
        std, mean, n = _noise_std(task, split_of, f)
        assert std == pytest.approx(0.05 * spread, rel=0.12)
        assert abs(mean) < 5 * std / math.sqrt(n)


def test_unknown_noise_lists_the_constructions():
    with pytest.raises(ValueError, match=r"unknown label noise 'gaussian'; valid: relative, absolute"):
        zoo.task("dropwave", "gaussian")


def test_the_grid_covers_the_box_with_cell_midpoints():
    g = zoo.grid(torch.tensor([[0.0, -2.0], [1.0, 2.0]], dtype=F64), n=4)  # cells of 0.25 x 1
    assert g.shape == (16, 2)
    assert sorted(set(g[:, 0].tolist())) == [0.125, 0.375, 0.625, 0.875]
    assert sorted(set(g[:, 1].tolist())) == [-1.5, -0.5, 0.5, 1.5]


# ---------------------------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("lookup", [zoo.card, zoo.function, zoo.task])
def test_unknown_name_lists_valid_choices(lookup):
    with pytest.raises(ValueError) as err:
        lookup("dropwav")
    message = str(err.value)
    assert "'dropwav'" in message and all(n in message for n in NAMES)
    assert "\n" not in message  # the CLI prints it as one line


def test_unknown_coefficient_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown coefficient.*\bkk\b.*choose from: k, q, o"):
        zoo.function("dropwave", kk=1.0)


@pytest.mark.parametrize("noise", zoo.NOISES)
@pytest.mark.parametrize("name", zoo.names())
def test_signal_to_noise_is_consistent_with_what_the_mean_row_scores(name, noise):
    """E[(y - mean)^2] = Var(f) + sigma^2 for noise independent of x: the `mean` row's MSE, measured on the noisy test
    labels, must match the clean-label variance plus the noise variance (800 test samples: within 15%)."""
    s = zoo.signal_to_noise(name, noise=noise)
    assert s["noise_var"] == zoo.task(name, noise).noise_std("target") ** 2
    assert s["snr"] == s["label_var"] / s["noise_var"]
    assert s["mean_mse"] == pytest.approx(s["label_var"] + s["noise_var"], rel=0.15)
    assert s["shift_mse"] > 0.8 * s["noise_var"]  # the noise is a floor no predictor of the clean f can beat


@pytest.mark.parametrize("name", zoo.names())
def test_every_default_target_is_well_above_noise(name):
    """The default construction keeps every target's signal to noise at or above 100 (about 400 by design)."""
    assert zoo.signal_to_noise(name)["snr"] >= 100


def test_signal_to_noise_of_dropwave_by_hand():
    """Dropwave's target under the legacy absolute noise (the measured finding that made its table rank noise): a
    clean-label variance of about 0.02 against the noise's 0.0025. By hand on seed 0: the variance of the clean
    target over its 1,200 inputs."""
    t = zoo.task("dropwave")
    x_train, _, x_test, _ = t.target_data(0, dtype=torch.float64)
    assert zoo.signal_to_noise("dropwave", seeds=(0,))["label_var"] == pytest.approx(
        t.target(torch.cat([x_train, x_test])).var().item(), rel=1e-12
    )
    s = zoo.signal_to_noise("dropwave", noise="absolute")
    assert 0.015 < s["label_var"] < 0.025 and 6 < s["snr"] < 10
    assert s["noise_var"] == 0.05**2
