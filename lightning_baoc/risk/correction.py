"""The risk of a master-weight correction: the part of each update the 16-bit weight loses.

A bf16 or fp16 parameter holds its fp32 master as the weight and, optionally, an integer correction
(:mod:`lightning_baoc.formats.correction`: ``none``, ``ecc8``, ``ecc16``). Each step stores the
updated master ``x - d`` on the grid of the weight's dtype refined ``2**k`` times (``k`` = 0, 8, 16
bits), so the update applied is ``a = q_k(x - d) - x``, not ``-d``. The rounding is deterministic:
an update smaller than half the grid's spacing is lost at every step, one a little larger overshoots
at every step, so the error does not average out over steps. It enters as a bias, in the units of
the other risks (:mod:`lightning_baoc.risk.model`: the block's share of the progress times the
relative squared deviation of its update):

    risk[b][k] = share_b * sum_i (a_i + d_i)^2 / sum_i d_i^2

measured on the shadow moments' sample of each 16-bit tensor (:class:`~lightning_baoc.risk.shadow.ShadowMoments`:
the expected gradient ``m`` and its noise), with ``d`` the expected step of the optimizer at the
group's current learning rate:

- AdamW: ``lr (m / (sqrt(v) + eps) + weight_decay x)`` (the decay when decoupled; Adam's L2 penalty
  joins the gradient: ``m + wd x``, ``v + 2 wd x m + (wd x)^2``);
- SGD: ``lr m / c``, ``c = (1 - momentum) / (1 - dampening)`` (the buffer sums the gradients; ``lr m``
  without momentum), with its weight decay in the gradient (``m + wd x``);
- Lion: ``lr (erf(m / ((1 - beta1) s sqrt 2)) + weight_decay x)``, ``s`` the gradient's noise.

``x`` is the master as correction ``k`` would hold it: the parameter's master now (its weight and
correction) split and reconstructed with ``k`` (without a correction, the weight), so dropping a
correction's residual once is not counted as a loss at every step. The shares are each block's
first-order progress ``sum_i m_i d_i``, over the blocks. fp32 parameters are their own masters and
score 0 in every correction; so do tensors that never stepped. By the grids' nesting
(``error(none) >= error(ecc8) >= error(ecc16)`` per element) the scores are ordered the same way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from lightning_baoc.formats.correction import CORRECTIONS, WEIGHT_DTYPES, check_correction, reconstruct, split
from lightning_baoc.optim.args import to_float
from lightning_baoc.optim.sharding import local
from lightning_baoc.risk.shadow import ShadowMoments

_SQRT2 = math.sqrt(2.0)


def expected_step(
    rule: str, group: Mapping[str, object], m: Tensor, v: Tensor, x: Tensor
) -> Tensor:
    """The optimizer's expected step ``d`` (fp64, subtracted from the master ``x``) on sampled elements
    with gradient mean ``m`` and mean square ``v`` (see the module docstring)."""
    lr = to_float(group["lr"])
    decay = float(group.get("weight_decay", 0.0))
    if rule == "sgd" or (rule == "adamw" and not group.get("decoupled_weight_decay", True)):
        # an L2 penalty joins the gradient inside the step (the shadow saw the raw gradient):
        # E[g + wd x] = m + wd x, E[(g + wd x)^2] = v + 2 wd x m + (wd x)^2
        v = v + 2.0 * decay * x * m + (decay * x) ** 2
        m = m + decay * x
        decay = 0.0
    if rule == "adamw":
        step = m / (v.clamp_min(0.0).sqrt() + float(group["eps"]))
        return lr * (step + decay * x)
    if rule == "sgd":
        beta, dampening = float(group["momentum"]), float(group["dampening"])
        c = (1.0 - beta) / (1.0 - dampening) if beta > 0.0 and dampening < 1.0 else 1.0
        return lr * m / c
    beta1 = float(group["betas"][0])  # type: ignore[index]
    s = (v - m * m).clamp_min(0.0).sqrt() * (1.0 - beta1)
    mean = torch.where(s > 0, torch.erf(m / (s.clamp_min(1e-300) * _SQRT2)), torch.sign(m))
    return lr * (mean + decay * x)


def correction_risk_table(
    optimizer: torch.optim.Optimizer,
    blocks: Mapping[str, Sequence[str]],
    shadow: ShadowMoments,
    betas: Mapping[str, tuple[float, float]],
    corrections: Sequence[str] = CORRECTIONS,
) -> dict[str, dict[str, float]]:
    """Block -> correction -> risk (non-negative; see the module docstring).

    Args:
        optimizer: a BlockwiseAdamW, BlockwiseSGD or BlockwiseLion (its rule, groups and the
            corrections it holds).
        blocks: block -> parameter names.
        shadow: the moments measured from the gradients.
        betas: parameter name -> the betas the shadow follows (the controller's).
        corrections: the corrections to score (default: all of ``none``, ``ecc8``, ``ecc16``).

    Raises:
        ValueError: an unknown correction.
    """
    for c in corrections:
        check_correction(c)
    rule = getattr(optimizer, "rule", "adamw")
    named = optimizer.named_params  # type: ignore[attr-defined]
    progress: dict[str, float] = {}
    relative: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        for block, names in blocks.items():
            lost = {c: 0.0 for c in corrections}
            total = step_sq = 0.0
            for name in names:
                p, entry = named[name], shadow.entries.get(name)
                if p.dtype not in WEIGHT_DTYPES or entry is None or entry.steps == 0:
                    continue
                scale = local(p).numel() / max(1, entry.exp_avg.numel())
                held = optimizer.held_correction(name)  # type: ignore[attr-defined]
                w = entry.gather(local(p).detach().reshape(-1))
                x = reconstruct(w, None if held is None else entry.gather(held.reshape(-1))).double()
                m, v = entry.corrected(betas[name])
                d = expected_step(rule, optimizer.param_group_of(name), m, v, x)  # type: ignore[attr-defined]
                total += float((m * d).sum()) * scale
                step_sq += float((d * d).sum()) * scale
                for c in corrections:
                    held_c = reconstruct(*split(x.float(), p.dtype, c)).double()  # the master as c holds it
                    weight, corr = split((held_c - d).float(), p.dtype, c)
                    applied = reconstruct(weight, corr).double() - held_c
                    lost[c] += float(((applied + d) ** 2).sum()) * scale
            progress[block] = max(0.0, total)
            relative[block] = {c: (lost[c] / step_sq if step_sq > 0 else 0.0) for c in corrections}
    whole = sum(progress.values())
    return {
        b: {c: (progress[b] / whole) * r if whole > 0 else 0.0 for c, r in row.items()} for b, row in relative.items()
    }


__all__ = ["correction_risk_table", "expected_step"]
