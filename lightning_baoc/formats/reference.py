"""A readable reference step for every format: decode -> textbook fp32 AdamW -> encode.

The fast steps (``StateFormat.update``) work in chunks, fuse operations and write straight into the
compact state. This module does the same step the plain way, on whole tensors, so a reader can
check the math by eye, and ``tests/formats/test_backends.py`` holds every format's eager step to it
after one step and after fifty.

The math, per parameter ``p`` with gradient ``g`` (``maximize`` negates ``g``; Adam's L2 decay
adds ``weight_decay * p`` to it; AdamW's decoupled decay scales ``p`` by ``1 - lr * weight_decay``):

- formats with a dense ``v``: ``v = beta2 v + (1 - beta2) g^2``;
- factored formats (Adafactor's second moment, ``(R, C)`` view of ``p``): ``row = beta2 row +
  (1 - beta2) (mean_j g^2 + 1e-30)``, ``col`` likewise over ``i``, and ``v = row[i] col[j] /
  mean(row)``;
- with momentum: ``m = beta1 m + (1 - beta1) g`` and ``p -= lr (m / bc1) / (sqrt(v / bc2) + eps)``,
  where ``bc1 = 1 - beta1^t_m`` counts the steps since the momentum was (re)created and
  ``bc2 = 1 - beta2^t``;
- without momentum: ``p -= lr g / (sqrt(v / bc2) + eps)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_baoc.formats import FORMATS
from lightning_baoc.formats.base import Canonical, StepHyper, factor_dims
from lightning_baoc.formats.factored_math import EPS_SQUARE


def reference_step(
    fmt: str,
    views: dict[str, Tensor],
    param: Tensor,
    grad: Tensor,
    hyper: StepHyper,
    step: int,
    momentum_step: int,
) -> None:
    """One AdamW step of ``param`` whose state ``fmt`` holds in ``views``, the plain way (in place).

    Args:
        fmt: the format's name (a key of :data:`~lightning_baoc.FORMATS`).
        views: the format's compact state tensors (decoded, updated and encoded back).
        param: the parameter (updated in place).
        grad: its gradient.
        hyper: the group's hyperparameters (its ``noise_key`` keys the stochastic rounding at encode).
        step: this step's count ``t`` (1 for the first step).
        momentum_step: steps since the momentum was (re)created, this one included.
    """
    spec = FORMATS[fmt]
    shape = tuple(param.shape)
    state = spec.decode(views, shape)
    p = param.detach().to(torch.float32).reshape(shape).clone()
    g = grad.to(torch.float32).reshape(shape)
    if hyper.maximize:
        g = -g
    if hyper.weight_decay != 0 and not hyper.decoupled_weight_decay:
        g = g + hyper.weight_decay * p
    if hyper.weight_decay != 0 and hyper.decoupled_weight_decay:
        p = p * (1.0 - hyper.lr * hyper.weight_decay)
    v = _second_moment(spec.factored, state, g, hyper.beta2)
    denom = (v / (1.0 - hyper.beta2**step)).sqrt() + hyper.eps
    if spec.has_momentum:
        m = state.exp_avg if state.exp_avg is not None else torch.zeros_like(g)
        state.exp_avg = hyper.beta1 * m + (1.0 - hyper.beta1) * g
        p = p - hyper.lr * (state.exp_avg / (1.0 - hyper.beta1**momentum_step)) / denom
    else:
        p = p - hyper.lr * g / denom
    spec.encode(state, views, hyper)
    param.copy_(p.to(param.dtype))


def _second_moment(factored: bool, state: Canonical, g: Tensor, beta2: float) -> Tensor:
    """Update ``state``'s second moment with ``g`` and return the dense ``v`` the step divides by."""
    if not factored:
        v = state.exp_avg_sq if state.exp_avg_sq is not None else torch.zeros_like(g)
        state.exp_avg_sq = beta2 * v + (1.0 - beta2) * g * g
        return state.exp_avg_sq
    dims = factor_dims(state.shape)
    assert dims is not None, "a factored format resolves only for factorable shapes"
    g2 = (g.reshape(dims) ** 2).double()
    row, col = state.factored_v()
    state.row = (beta2 * row.double() + (1.0 - beta2) * (g2.mean(dim=1) + EPS_SQUARE)).float()
    state.col = (beta2 * col.double() + (1.0 - beta2) * (g2.mean(dim=0) + EPS_SQUARE)).float()
    state.exp_avg_sq = None
    v = state.row.double()[:, None] * state.col.double()[None, :] / state.row.double().mean()
    return v.float().reshape(state.shape)


__all__ = ["reference_step"]
