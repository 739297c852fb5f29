"""The pure reducers of lightning_baoc.sampling.statistics on synthetic streams with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_baoc.sampling import statistics as S


def noisy_stream(snr: float, t: int = 32, k: int = 4096, seed: int = 0) -> torch.Tensor:
    """``t`` samples ``mu + eps`` with per-element signal power ``snr`` and noise variance 1."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(k, generator=g, dtype=torch.float64)
    mu *= math.sqrt(snr * k) / mu.norm()  # ||mu||^2 / k == snr exactly
    return mu + torch.randn(t, k, generator=g, dtype=torch.float64)


# ----------------------------------------------------------------------------- stability


def test_constant_direction_has_stability_one() -> None:
    direction = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    scales = torch.linspace(0.1, 50.0, 16)  # magnitudes change, the direction does not
    samples = scales[:, None] * direction
    assert S.directional_stability(samples) == pytest.approx(1.0, abs=1e-9)
    assert S.directional_stability(-samples) == pytest.approx(1.0, abs=1e-9)


def test_independent_noise_has_stability_zero() -> None:
    samples = torch.randn(32, 4096, generator=torch.Generator().manual_seed(2))
    # Cosines of independent vectors of k elements scatter with std 1/sqrt(k) = 0.016; their mean
    # over 31 pairs with std 0.003.
    assert abs(S.directional_stability(samples)) < 0.015


def test_alternating_sign_has_stability_minus_one() -> None:
    direction = torch.randn(512, generator=torch.Generator().manual_seed(3))
    samples = torch.stack([direction * (-1) ** t for t in range(8)])
    assert S.directional_stability(samples) == pytest.approx(-1.0, abs=1e-9)


def test_stability_of_signal_plus_noise_is_snr_over_one_plus_snr() -> None:
    samples = noisy_stream(snr=1.0)
    assert S.directional_stability(samples) == pytest.approx(0.5, abs=0.03)


def test_cosines_match_a_numpy_reference() -> None:
    x = torch.randn(6, 33, generator=torch.Generator().manual_seed(4))
    a = x.numpy().astype(np.float64)
    ref = [a[i] @ a[i + 1] / np.linalg.norm(a[i]) / np.linalg.norm(a[i + 1]) for i in range(5)]
    np.testing.assert_allclose(S.cosine_similarities(x).numpy(), ref, rtol=1e-12)
    # a sequence of tensors works too
    np.testing.assert_allclose(S.cosine_similarities(list(x)).numpy(), ref, rtol=1e-12)


def test_stability_undefined_cases_are_nan() -> None:
    assert math.isnan(S.directional_stability(torch.ones(1, 10)))
    assert math.isnan(S.directional_stability(torch.zeros(5, 10)))
    # a zero vector only drops the pairs it is in
    x = torch.stack([torch.ones(4), torch.zeros(4), torch.ones(4), torch.ones(4)])
    assert S.directional_stability(x) == pytest.approx(1.0)


# ----------------------------------------------------------------------------- anisotropy


def test_rows_with_known_norms_give_the_known_cv() -> None:
    norms = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0])
    g = torch.randn(5, 64, 3, generator=torch.Generator().manual_seed(5))  # rows = first dim
    g = g / g.flatten(1).norm(dim=1)[:, None, None] * norms[:, None, None]
    expected = float(np.std(norms.numpy()) / np.mean(norms.numpy()))  # population std
    torch.testing.assert_close(S.row_norms(g), norms)
    assert S.coefficient_of_variation(S.row_norms(g)) == pytest.approx(expected, rel=1e-6)
    assert S.coefficient_of_variation(torch.full((7,), 3.0)) == 0.0


def test_anisotropy_averages_the_cv_over_samples_and_is_scale_invariant() -> None:
    a = torch.tensor([1.0, 3.0])  # CV 0.5
    b = torch.tensor([2.0, 2.0, 2.0])  # CV 0, other length
    assert S.scale_anisotropy([a, b]) == pytest.approx(0.25)
    assert S.scale_anisotropy([a * 65536.0, b * 1e-3]) == pytest.approx(0.25)
    assert S.scale_anisotropy(torch.stack([a, a])) == pytest.approx(0.5)
    assert math.isnan(S.scale_anisotropy([torch.zeros(3)]))


def test_row_norms_of_vectors_and_subsets() -> None:
    v = torch.tensor([-3.0, 4.0, 0.5])
    torch.testing.assert_close(S.row_norms(v), v.abs())
    m = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, 2.0]])
    torch.testing.assert_close(S.row_norms(m, rows=torch.tensor([0, 2])), torch.tensor([5.0, 2.0]))
    with pytest.raises(ValueError, match="0-d"):
        S.row_norms(torch.tensor(1.0))


# ----------------------------------------------------------------------------- noise


@pytest.mark.parametrize("snr", [0.1, 0.5, 1.0, 4.0, 10.0])
def test_known_snr_is_recovered_within_ten_percent(snr: float) -> None:
    for seed in range(3):
        assert S.gradient_snr(noisy_stream(snr, seed=seed)) == pytest.approx(snr, rel=0.10)


def test_snr_estimator_is_unbiased_where_the_plain_ratio_is_not() -> None:
    # With T = 8 samples the plain ||mean||^2 / noise ratio is high by 1/T = 0.125 (125% at SNR 0.1).
    estimates = [S.gradient_snr(noisy_stream(0.1, t=8, seed=s)) for s in range(20)]
    assert np.mean(estimates) == pytest.approx(0.1, rel=0.10)


def test_snr_is_scale_invariant() -> None:
    x = noisy_stream(2.0)
    assert S.gradient_snr(x * 65536.0) == pytest.approx(S.gradient_snr(x), rel=1e-9)
    assert S.directional_stability(x * 1e-4) == pytest.approx(S.directional_stability(x), rel=1e-9)


def test_snr_edge_cases_and_noise_fraction() -> None:
    assert math.isnan(S.gradient_snr(torch.ones(1, 4)))
    assert S.gradient_snr(torch.ones(3, 4)) == math.inf
    assert math.isnan(S.gradient_snr(torch.zeros(3, 4)))
    assert S.gradient_snr(torch.randn(32, 4096, generator=torch.Generator().manual_seed(6))) < 0.01
    assert S.noise_fraction(0.0) == 1.0
    assert S.noise_fraction(1.0) == 0.5
    assert math.isnan(S.noise_fraction(math.nan))
    assert S.noise_fraction(math.inf) == 0.0
    with pytest.raises(ValueError, match="same number of elements"):
        S.gradient_snr([torch.ones(3), torch.ones(4)])
    with pytest.raises(ValueError, match=r"\(T, k\)"):
        S.gradient_snr(torch.ones(2, 3, 4))


# ----------------------------------------------------------------------------- second moment


def slimadam_reference(v: np.ndarray, axes: tuple[int, ...]) -> float:
    """Kalra et al.'s estimate_snr for one choice of axes, with this module's inf/nan rule."""
    mean_sq = np.mean(v, axis=axes) ** 2
    var = np.var(v, axis=axes)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.asarray(mean_sq / var)
    ratio = ratio[~np.isnan(ratio)]
    return float(ratio.mean()) if ratio.size else math.nan


@pytest.mark.parametrize("dims", [0, 1, (0, 1), None])
def test_second_moment_snr_matches_the_slimadam_reference(dims: int | tuple[int, int] | None) -> None:
    v = torch.rand(24, 40, generator=torch.Generator().manual_seed(7), dtype=torch.float64) ** 2 + 1e-3
    axes = (0, 1) if dims is None else ((dims,) if isinstance(dims, int) else dims)
    assert S.second_moment_snr(v, dims) == pytest.approx(slimadam_reference(v.numpy(), axes), rel=1e-9)


def test_rank_one_second_moment_has_the_snr_of_its_factor() -> None:
    r = torch.rand(16, generator=torch.Generator().manual_seed(8), dtype=torch.float64) + 0.5
    c = torch.rand(32, generator=torch.Generator().manual_seed(9), dtype=torch.float64) + 0.5
    v = torch.outer(r, c)
    # along dim 1 every row is r_i * c: (mean c)^2 / var c, the same for every row
    expected = float(c.mean() ** 2 / c.var(correction=0))
    assert S.second_moment_snr(v, 1) == pytest.approx(expected, rel=1e-9)
    assert S.second_moment_snr(v * 1e6, 1) == pytest.approx(expected, rel=1e-9)  # scale-invariant


def test_second_moment_structure_views_tensors_as_rows_and_columns() -> None:
    conv = torch.rand(8, 3, 2, 2, generator=torch.Generator().manual_seed(10)) + 0.1
    s = S.second_moment_structure(conv)
    assert s["dim1"] == pytest.approx(S.second_moment_snr(conv.reshape(8, 12), 1))
    assert set(s) == {"dim0", "dim1", "all"}
    vec = S.second_moment_structure(torch.tensor([1.0, 3.0]))
    assert math.isnan(vec["dim0"]) and vec["all"] == pytest.approx(4.0)
    assert S.second_moment_snr(torch.ones(3, 3), 0) == math.inf
    with pytest.raises(ValueError, match="dims must be"):
        S.second_moment_snr(torch.ones(3, 3), 2)
    with pytest.raises(ValueError, match="non-empty"):
        S.second_moment_snr(torch.ones(0, 3), 0)


# ----------------------------------------------------------------------------- update share


def test_update_share_is_the_fraction_of_squared_norm() -> None:
    share = S.update_share({"a": 3.0, "b": torch.tensor(4.0), "c": 0})
    assert share == pytest.approx({"a": 0.36, "b": 0.64, "c": 0.0})
    assert sum(share.values()) == pytest.approx(1.0)
    assert S.update_share({"a": 0.0}) == {"a": 0.0}
    assert S.update_share({"a": 1.0, "b": 2.0}) == pytest.approx(S.update_share({"a": 1e-3, "b": 2e-3}))
    with pytest.raises(ValueError, match=r"update_norms\['b'\]"):
        S.update_share({"a": 1.0, "b": -1.0})
    with pytest.raises(ValueError, match="finite"):
        S.update_share({"a": math.nan})


