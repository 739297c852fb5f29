"""Boundary selection: contiguous segments of blocks that share one format.

:func:`select_boundaries` cuts the ordered blocks into at most ``max_boundaries + 1`` segments of
similar statistics (optimal 1-D segmentation by dynamic programming); with ``max_boundaries``,
:func:`~lightning_baoc.solver.solve` merges each segment into one block
(:func:`_solve_segmented`) so the format changes at most that many times along the model.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from lightning_baoc.solver.pipeline import _solve_problem
from lightning_baoc.solver.problem import Allocation, Table, _build, _parse_budgets, _Problem


def select_boundaries(
    features: Sequence[Sequence[float]] | np.ndarray,
    max_boundaries: int,
    *,
    weights: Sequence[float] | None = None,
    standardize: bool = True,
    allowed: np.ndarray | None = None,
) -> list[tuple[int, int]]:
    """Cut an ordered list of blocks into at most ``max_boundaries + 1`` contiguous segments.

    Optimal 1-D segmentation by dynamic programming: minimizes the total within-segment weighted
    sum of squared distances of the feature vectors to their segment mean.

    Args:
        features: one feature vector (statistics) per block, in block order.
        max_boundaries: the most cuts allowed (>= 0); ``0`` gives one segment.
        weights: per-block weights of the squared distances (default: all 1).
        standardize: scale every feature to unit variance first, so no statistic dominates by its
            units (default: True).
        allowed: optional ``(blocks, formats)`` boolean array; segments must share at least one
            allowed format (default: no constraint).

    Returns:
        Half-open ``(start, stop)`` index ranges covering ``0 .. len(features)`` in order.

    Example:
        >>> select_boundaries([[0.0], [0.1], [5.0], [5.2], [0.0]], max_boundaries=2)
        [(0, 2), (2, 4), (4, 5)]
    """
    if isinstance(max_boundaries, bool) or not isinstance(max_boundaries, numbers.Integral) or max_boundaries < 0:
        raise ValueError(f"max_boundaries must be an int >= 0, got {max_boundaries!r}")
    X, w = _check_features(features, weights, standardize)
    n = X.shape[0]
    segments = min(int(max_boundaries) + 1, n)
    arg, cost = _best_cuts(_segment_cost(X, w, allowed), n, segments)
    # Exactly `segments` pieces: splitting a segment never raises its cost nor removes a shared
    # format, so the best cut into at most that many pieces has exactly that many.
    if not np.isfinite(cost):
        raise ValueError(
            "no segmentation exists in which every segment shares an allowed format; allow more "
            "boundaries or more formats"
        )
    cuts: list[tuple[int, int]] = []
    j = n
    for sgm in range(segments, 0, -1):
        i = int(arg[sgm, j])
        cuts.append((i, j))
        j = i
        if j == 0:
            break
    cuts.reverse()
    return cuts


def _check_features(
    features: Sequence[Sequence[float]] | np.ndarray, weights: Sequence[float] | None, standardize: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The features as a ``(blocks, features)`` array (standardized if asked) and the weights."""
    X = np.asarray(features, dtype=np.float64)
    if X.ndim == 1:
        X = X[:, None]
    if X.ndim != 2 or X.shape[0] == 0:
        raise ValueError(f"features must be a non-empty list of equal-length vectors, got shape {X.shape}")
    if not np.isfinite(X).all():
        bad = int(np.argmax(~np.isfinite(X).all(axis=1)))
        raise ValueError(f"features[{bad}] = {X[bad].tolist()} is not finite; allowed: finite numbers")
    n = X.shape[0]
    w = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (n,) or not np.isfinite(w).all() or (w <= 0).any():
        raise ValueError(f"weights must be {n} finite positive numbers, got {weights!r}")
    if standardize:
        sd = X.std(axis=0)
        X = (X - X.mean(axis=0)) / np.where(sd > 0, sd, 1.0)
    return X, w


_SegmentCost = Callable[[Any, Any], np.ndarray]


def _segment_cost(X: np.ndarray, w: np.ndarray, allowed: np.ndarray | None) -> _SegmentCost:
    """``cost(i, j)``: the weighted sum of squares of segment ``[i, j)`` (broadcasting over index
    arrays; ``inf`` where ``j <= i`` or the segment's blocks share no allowed format)."""
    # prefix sums give the cost of any segment [i, j) in O(1)
    W = np.concatenate([[0.0], np.cumsum(w)])
    S1 = np.vstack([np.zeros(X.shape[1]), np.cumsum(w[:, None] * X, axis=0)])
    S2 = np.concatenate([[0.0], np.cumsum(w * (X * X).sum(axis=1))])
    bad_prefix = None
    if allowed is not None:
        A = np.asarray(allowed, dtype=bool)
        bad_prefix = np.vstack([np.zeros(A.shape[1], dtype=np.int64), np.cumsum(~A, axis=0)])

    def cost_row(i: np.ndarray | int, j: np.ndarray | int) -> np.ndarray:
        ww = W[j] - W[i]
        lin = S1[j] - S1[i]
        with np.errstate(divide="ignore", invalid="ignore"):
            c = (S2[j] - S2[i]) - (lin * lin).sum(axis=-1) / ww
        c = np.maximum(c, 0.0)
        if bad_prefix is not None:
            common = ((bad_prefix[j] - bad_prefix[i]) == 0).any(axis=-1)
            c = np.where(common, c, np.inf)
        return np.where(np.asarray(j) > np.asarray(i), c, np.inf)

    return cost_row


def _best_cuts(cost_row: _SegmentCost, n: int, segments: int) -> tuple[np.ndarray, float]:
    """Dynamic programming over ``n`` blocks: ``arg[s, j]``, the start of the last of ``s``
    segments covering ``[0, j)`` at least cost, and the least cost of ``segments`` segments."""
    ii = np.arange(n + 1)
    if n <= 2048:
        C = cost_row(ii[:, None], ii[None, :])  # C[i, j]: cost of segment [i, j)
    else:
        C = None
    D = np.full(n + 1, np.inf)
    D[0] = 0.0
    arg = np.zeros((segments + 1, n + 1), dtype=np.int64)
    for sgm in range(1, segments + 1):
        if C is not None:
            tot = D[:, None] + C
            arg[sgm] = np.argmin(tot, axis=0)
            newD = tot[arg[sgm], ii]
        else:
            newD = np.full(n + 1, np.inf)
            for j in range(1, n + 1):
                tot = D[:j] + cost_row(ii[:j], j)
                a = int(np.argmin(tot))
                arg[sgm, j], newD[j] = a, tot[a]
        D = newD
    return arg, D[n]


def _default_features(p: _Problem) -> np.ndarray:
    """Risk per byte for the formats every block allows (the risk profile of a block)."""
    common = p.allowed.all(axis=0)
    if not common.any():
        common = np.ones(p.risk.shape[1], dtype=bool)
    size = np.where(p.allowed, p.memory, 0.0).max(axis=1)
    size = np.where(size > 0, size, 1.0)
    risk = np.where(p.allowed, p.risk, 0.0)
    return risk[:, common] / size[:, None]


def _solve_segmented(
    risk: Table,
    memory: Table,
    memory_budget: object,
    time: Table | None,
    time_budget: object,
    mask: Any,
    method: str,
    max_boundaries: int,
    features: Mapping[str, Sequence[float]] | None,
    reference: str = "fp32 AdamW",
) -> Allocation:
    p = _build(risk, memory, time, mask)
    p.reference = reference
    mb, tb = _parse_budgets(p, memory_budget, time_budget)
    if features is None:
        feats = _default_features(p)
    else:
        missing = [b for b in p.blocks if b not in features]
        if missing:
            raise ValueError(f"features has no entry for blocks {missing[:5]}; give one vector per block")
        feats = np.asarray([list(features[b]) for b in p.blocks], dtype=np.float64)
    cuts = select_boundaries(feats, max_boundaries, allowed=p.allowed)
    groups = [p.blocks[a:b] for a, b in cuts]
    names = [f"segment{i}" for i in range(len(cuts))]
    seg_allowed = np.stack([p.allowed[a:b].all(axis=0) for a, b in cuts])

    def merged(arr: np.ndarray | None) -> np.ndarray | None:
        if arr is None:
            return None
        out = np.stack([np.where(p.allowed[a:b], arr[a:b], 0.0).sum(axis=0) for a, b in cuts])
        return np.where(seg_allowed, out, np.inf)

    q = _Problem(
        blocks=names,
        formats=p.formats,
        risk=merged(p.risk),  # type: ignore[arg-type]
        memory=merged(p.memory),  # type: ignore[arg-type]
        time=merged(p.time),
        memory_int=p.memory_int,
        masked=p.masked,
        fp32_memory=p.fp32_memory,
        fp32_time=p.fp32_time,
        reference=reference,
    )
    alloc = _solve_problem(q, mb, tb, method, note=f" (with max_boundaries={max_boundaries})")
    formats = {}
    for name, members in zip(names, groups):
        for b in members:
            formats[b] = alloc.formats[name]
    return Allocation(
        formats=formats,
        memory=alloc.memory,
        time=alloc.time,
        risk=alloc.risk,
        memory_budget=alloc.memory_budget,
        time_budget=alloc.time_budget,
        lower_bound=alloc.lower_bound,
        optimal=alloc.optimal,
        method=alloc.method,
        masked=alloc.masked,
        segments=tuple(tuple(g) for g in groups),
        fp32_memory=alloc.fp32_memory,
        fp32_time=alloc.fp32_time,
    )
