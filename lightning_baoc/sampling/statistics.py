"""Per-block gradient statistics as pure reducers over tensors (no Lightning, no state).

The :class:`~lightning_baoc.sampling.GradientSampler` feeds these with the sampled gradients of one
block; the risk model reads the numbers. Every statistic here is invariant to a positive rescaling
of the gradients that is constant over the samples it reduces (cosines, coefficients of variation
and signal-to-noise ratios are ratios of like powers), so gradients that still carry an fp16 loss
scale give the same numbers as unscaled ones as long as the scale does not change in between.

Undefined values (fewer than two samples, an all-zero gradient) come back as ``nan`` rather than an
exception: a block that got no gradient is a fact to report, not an error.

Notation: ``g_t`` is the block's sampled gradient vector at sample ``t`` (``T`` samples of ``k``
elements each, as the rows of a ``(T, k)`` tensor).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence, Union

import torch
from torch import Tensor

__all__ = [
    "cosine_similarities",
    "directional_stability",
    "row_norms",
    "coefficient_of_variation",
    "scale_anisotropy",
    "gradient_snr",
    "noise_fraction",
    "second_moment_snr",
    "second_moment_structure",
    "update_share",
]

Number = Union[int, float]


def _as_samples(samples: Tensor | Sequence[Tensor], argument: str = "samples") -> Tensor:
    """A ``(T, k)`` float64 tensor from a 2-D tensor or a sequence of equal-size vectors."""
    if isinstance(samples, Tensor):
        x = samples
    else:
        vectors = [torch.as_tensor(s).reshape(-1) for s in samples]
        if not vectors:
            return torch.empty(0, 0, dtype=torch.float64)
        sizes = {v.numel() for v in vectors}
        if len(sizes) != 1:
            raise ValueError(f"{argument} must all have the same number of elements, got sizes {sorted(sizes)}")
        x = torch.stack(vectors)
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if x.dim() != 2:
        raise ValueError(f"{argument} must be a (T, k) tensor of T sampled vectors, got shape {tuple(x.shape)}")
    # float64: sums of squares over thousands of elements and tens of samples lose digits in fp32,
    # and the reductions here are tiny.
    return x.detach().to(device="cpu", dtype=torch.float64)


def cosine_similarities(samples: Tensor | Sequence[Tensor]) -> Tensor:
    """Cosine similarity of each pair of consecutive samples.

    ``cos_t = <g_t, g_{t+1}> / (||g_t|| ||g_{t+1}||)`` for ``t = 1 .. T-1``; a pair with a zero
    vector gives ``nan``.

    Args:
        samples: ``(T, k)`` tensor (or a sequence of ``T`` tensors of ``k`` elements), oldest first.

    Returns:
        ``(T-1,)`` float64 tensor.

    Example:
        >>> cosine_similarities(torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 2.0]]))
        tensor([0.7071, 0.7071], dtype=torch.float64)
    """
    x = _as_samples(samples)
    if x.shape[0] < 2:
        return torch.empty(0, dtype=torch.float64)
    a, b = x[:-1], x[1:]
    denom = a.norm(dim=1) * b.norm(dim=1)
    cos = (a * b).sum(dim=1) / denom
    return torch.where(denom > 0, cos, torch.full_like(cos, math.nan))


def directional_stability(samples: Tensor | Sequence[Tensor]) -> float:
    """Directional stability: mean cosine similarity of consecutive sampled gradients.

    ``stability = mean_t cos(g_t, g_{t+1})`` over the pairs where both vectors are non-zero.
    About 1 for a gradient that keeps its direction, about 0 (within ``1/sqrt(k)``) for independent
    noise, negative for an oscillating one. For ``g_t = mu + noise`` with independent noise it is
    about ``SNR / (1 + SNR)`` (see :func:`gradient_snr`). Momentum matters less where the direction
    is stable. ``nan`` with fewer than two usable samples.

    Example:
        >>> directional_stability(torch.ones(5, 100))
        1.0
    """
    cos = cosine_similarities(samples)
    cos = cos[~torch.isnan(cos)]
    return float(cos.mean()) if cos.numel() else math.nan


def row_norms(tensor: Tensor, rows: Tensor | None = None) -> Tensor:
    """Euclidean norm of each row of ``tensor`` viewed as ``(shape[0], -1)``.

    Rows are the first dimension, as in the factored formats (a conv weight ``(out, in, kh, kw)``
    has ``out`` rows). A 1-D tensor is a column: each element is a row and its norm is ``|x_i|``.

    Args:
        tensor: a gradient (or any tensor) with at least one dimension.
        rows: optional row indices; only those rows are reduced (default: all rows).

    Example:
        >>> row_norms(torch.tensor([[3.0, 4.0], [0.0, 1.0]]))
        tensor([5., 1.])
    """
    if tensor.dim() == 0:
        raise ValueError("row_norms needs a tensor with at least one dimension, got a 0-d tensor")
    if tensor.dim() == 1:
        x = tensor if rows is None else tensor.index_select(0, rows)
        return x.abs()
    x = tensor.reshape(tensor.shape[0], -1)
    if rows is not None:
        x = x.index_select(0, rows)
    return torch.linalg.vector_norm(x, dim=1)


def coefficient_of_variation(values: Tensor) -> float:
    """Coefficient of variation ``std / mean`` of ``values`` (population std, ``ddof=0``).

    The population form describes the rows at hand (all of them, or a uniform subsample): rows with
    norms ``(1, 3)`` have ``mean = 2``, ``std = 1``, ``CV = 0.5``. ``nan`` if the mean is 0.

    Example:
        >>> coefficient_of_variation(torch.tensor([1.0, 3.0]))
        0.5
    """
    x = values.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
    if x.numel() == 0:
        return math.nan
    mean = x.mean()
    if mean == 0:
        return math.nan
    return float(x.std(correction=0) / mean)


def scale_anisotropy(row_norms_per_sample: Tensor | Sequence[Tensor]) -> float:
    """Scale anisotropy: coefficient of variation of per-row gradient norms, averaged over samples.

    ``anisotropy = mean_t CV(||g_t[i, :]|| for rows i)``, with ``CV = std / mean`` (population std).
    0 when every row carries the same gradient norm; large when a few rows (channels, tokens)
    dominate, where shared quantization scales and factored second moments hurt more. Samples whose
    CV is undefined (all rows zero) are skipped; ``nan`` if none is left.

    Args:
        row_norms_per_sample: ``(T, R)`` tensor, or a sequence of ``T`` vectors of row norms (their
            lengths may differ).

    Example:
        >>> scale_anisotropy(torch.tensor([[1.0, 3.0], [2.0, 2.0]]))  # CVs 0.5 and 0
        0.25
    """
    if isinstance(row_norms_per_sample, Tensor) and row_norms_per_sample.dim() == 1:
        row_norms_per_sample = [row_norms_per_sample]
    cvs = [coefficient_of_variation(r) for r in row_norms_per_sample]
    cvs = [c for c in cvs if not math.isnan(c)]
    return sum(cvs) / len(cvs) if cvs else math.nan


def _snr_terms(samples: Tensor | Sequence[Tensor]) -> tuple[float, float]:
    """Unbiased per-element (signal power, noise variance) of ``T >= 2`` samples; nan otherwise."""
    x = _as_samples(samples)
    t, k = x.shape
    if t < 2 or k == 0:
        return math.nan, math.nan
    mean = x.mean(dim=0)
    noise = float((x - mean).square().sum()) / ((t - 1) * k)
    # ||mean||^2 overestimates ||mu||^2 by the noise left in the mean (variance / T per element).
    signal = float(mean.square().sum()) / k - noise / t
    return max(signal, 0.0), noise


def gradient_snr(samples: Tensor | Sequence[Tensor]) -> float:
    """Gradient signal-to-noise ratio over ``T >= 2`` samples of one block.

    With ``mean = (1/T) sum_t g_t`` over ``k`` elements:

    - noise variance per element ``S2 = sum_t ||g_t - mean||^2 / ((T - 1) k)`` (unbiased),
    - signal power per element ``M2 = max(||mean||^2 / k - S2 / T, 0)`` (``||mean||^2`` minus the
      noise that is left in a mean of ``T`` samples, so ``E[M2] = ||mu||^2 / k``),
    - ``SNR = M2 / S2``.

    For ``g_t = mu + eps_t`` with independent zero-mean ``eps_t`` of per-element variance ``s^2`` this
    estimates ``(||mu||^2 / k) / s^2``. High SNR: the samples agree (momentum averages little
    noise away); low SNR: mostly noise. A gradient that drifts over the window counts its drift as
    noise. ``inf`` if all samples are equal and non-zero, ``nan`` with fewer than two samples or
    all-zero samples.

    Example:
        >>> g = torch.tensor([[1.0, 1.0], [3.0, 3.0]])  # mean 2, deviations +-1
        >>> gradient_snr(g)  # M2 = 4 - 2/2 = 3, S2 = 2 * 2 / (1 * 2) = 2
        1.5
    """
    signal, noise = _snr_terms(samples)
    if math.isnan(noise):
        return math.nan
    if noise == 0.0:
        return math.inf if signal > 0 else math.nan
    return signal / noise


def noise_fraction(snr: float) -> float:
    """Share of the gradient's power that is noise, ``1 / (1 + SNR)``, in ``[0, 1]``.

    Example:
        >>> noise_fraction(3.0)
        0.25
    """
    if math.isnan(snr):
        return math.nan
    return 1.0 / (1.0 + snr)


def second_moment_snr(v: Tensor, dims: int | Sequence[int] | None) -> float:
    """SlimAdam's SNR of a second moment ``v`` along ``dims``: can ``v`` be replaced by its mean there?

    ``v`` is viewed as ``(R, C)`` like the factored formats (``(shape[0], prod(shape[1:]))``; a 1-D
    ``v`` is one row). Along the dimensions ``K = dims``, for every index ``j`` of the remaining ones:

        ``SNR_K = mean_j [ (mean_K v)_j^2 / var_K v_j ]``   (population variance)

    as in Kalra et al., "When Can You Get Away with Low Memory Adam?" (arXiv 2503.01843, the
    ``estimate_snr`` of its code): a high SNR along ``K`` means the entries along ``K`` are well
    described by their mean, so ``v`` can be shared along ``K`` (SlimAdam compresses ``K`` when
    SNR > 1). ``dims=1`` (within each row, one value per row) for a ``Linear`` weight ``(out, in)``
    is SlimAdam's fan-in compression, ``dims=0`` (one value per column) its fan-out one, and
    ``dims=None`` the whole tensor (one value). Where SlimAdam drops non-finite ratios, here a slice
    with zero variance and non-zero mean counts as ``inf`` (it *is* perfectly shareable) and only
    all-zero slices (0/0) are dropped; ``nan`` if no slice is left.

    Args:
        v: a second-moment tensor (any shape with at least one element).
        dims: ``0``, ``1``, ``(0, 1)`` or ``None`` (all), in the ``(R, C)`` view.

    Example:
        >>> v = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 3.0, 1.0, 3.0]])
        >>> second_moment_snr(v, 1)  # row 0 is constant (inf): SNR is inf
        inf
        >>> second_moment_snr(v[1:], 1)  # mean 2, variance 1
        4.0
    """
    if v.numel() == 0:
        raise ValueError(f"second_moment_snr needs a non-empty v, got shape {tuple(v.shape)}")
    x = v.detach().to(device="cpu", dtype=torch.float64)
    x = x.reshape(1, -1) if x.dim() <= 1 else x.reshape(x.shape[0], -1)
    if dims is None:
        k: tuple[int, ...] = (0, 1)
    else:
        k = (dims,) if isinstance(dims, int) else tuple(dims)
        if not k or any(d not in (0, 1) for d in k):
            raise ValueError(f"dims must be 0, 1, (0, 1) or None in v's (rows, columns) view, got {dims!r}")
    mean = x.mean(dim=k)
    var = x.var(dim=k, correction=0)
    ratio = mean.square() / var  # 0/0 -> nan, x/0 -> inf
    ratio = ratio[~torch.isnan(ratio)]
    return float(ratio.mean()) if ratio.numel() else math.nan


def second_moment_structure(v: Tensor) -> dict[str, float]:
    """:func:`second_moment_snr` of ``v`` along each choice SlimAdam tests, in the ``(R, C)`` view.

    Returns:
        ``{"dim0": SNR along rows (one value per column), "dim1": SNR along columns (one value per
        row), "all": SNR of the whole tensor}``; a 1-D ``v`` has only ``"all"`` meaningful, and
        ``"dim0"``/``"dim1"`` are ``nan`` for it.

    Example:
        >>> s = second_moment_structure(torch.tensor([[1.0, 2.0], [1.0, 2.0]]))
        >>> s["dim0"], s["dim1"]  # columns are constant: shareable along dim 0
        (inf, 9.0)
    """
    if v.dim() <= 1:
        return {"dim0": math.nan, "dim1": math.nan, "all": second_moment_snr(v, None)}
    return {"dim0": second_moment_snr(v, 0), "dim1": second_moment_snr(v, 1), "all": second_moment_snr(v, None)}


def update_share(update_norms: Mapping[str, Number | Tensor]) -> dict[str, float]:
    """Each block's share of the model's update: ``||u_b||^2 / sum_c ||u_c||^2``.

    Squared norms add up over disjoint blocks (``||u||^2 = sum_b ||u_b||^2``), so the shares are the
    fractions of the whole update's squared norm and sum to 1. Scale-invariant (a learning rate
    common to all blocks cancels). All zero: every share is 0.

    Args:
        update_norms: block name -> norm ``||u_b||`` of the block's update (a number or 0-d tensor).

    Example:
        >>> update_share({"a": 3.0, "b": 4.0})
        {'a': 0.36, 'b': 0.64}
    """
    sq: dict[str, float] = {}
    for block, norm in update_norms.items():
        value = float(norm)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"update_norms[{block!r}] must be a finite norm >= 0, got {value!r}")
        sq[block] = value * value
    total = sum(sq.values())
    if total == 0:
        return {b: 0.0 for b in sq}
    return {b: s / total for b, s in sq.items()}
