"""The risk of SGD's and Lion's momentum formats: how much harm each format would do to each block.

The same caution as AdamW's risk model (:mod:`lightning_baoc.risk.model`) shapes it: what persists
over the steps (a bias of the expected update) enters in full, what averages out (zero-mean noise)
enters over a horizon of ``H`` steps. The reference is the optimizer's own update with an fp32 buffer,
measured on shadow moments (:class:`~lightning_baoc.risk.shadow.ShadowMoments`: ``m`` and ``v``, EMAs
of the gradient and its square on a fixed sample of each tensor, bias-corrected: ``m`` estimates the
expected gradient, ``v - m^2`` its per-element noise).

**SGD**. torch's buffer ``b = beta b + (1 - dampening) g`` sums the gradients: its expectation is
``m / c`` with ``c = (1 - beta) / (1 - dampening)`` (10 x the gradient at beta 0.9, no dampening), and
the step is ``b`` (Nesterov: ``g + beta b``, the same expectation). In the units of an average,
``u = c b``, so ``E[u] = m`` with the noise damped to ``a = (1 - beta) / (1 + beta)`` of the gradient's:

- progress ``p_b = sum_i m_i^2`` (first-order loss decrease per unit learning rate) and ``||u||^2``
  the same;
- a buffer format ``f`` (``bf16``, ``int8``): ``m`` round-tripped through the format's real encode
  and decode (the codes, scales and rounding the optimizer uses), ``B_f = ||m_f - m||^2 / ||u||^2``;
- ``none``: the step is the raw gradient, ``c`` times the buffer's in expectation: a step-size bias
  ``B = (1 - c)^2`` (0.81 at beta 0.9: dropping the buffer divides the block's step by 10), and the
  noise ``c^2`` of the gradient's where the buffer had ``a``: ``V = (c^2 - a)^+ sum_i (v_i - m_i^2)^+ /
  (H ||u||^2)``. (An earlier version scored ``none`` as unbiased noise only; on digits the risk-min
  allocation then did no better than random ones, ``benchmarks/momentum_risk_validation.py``.)

**Lion** (``u = sign(c)``, ``c = beta1 * buf + (1 - beta1) * g``). With the buffer at its expectation
``m`` and the gradient's noise ``s_i^2 = v_i - m_i^2``, ``c_i`` has mean ``m_i`` and deviation
``(1 - beta1) s_i``, so the expected update is ``E_i = erf(m_i / ((1 - beta1) s_i sqrt(2)))``:

- progress ``p_b = sum_i m_i E_i``, ``||u||^2 = sum_i E_i^2``;
- a buffer format: the mean becomes ``beta1 m_f + (1 - beta1) m`` (``m_f`` the round trip), and
  ``B_f = ||E_f - E||^2 / ||u||^2``;
- ``none`` (``sign(g)``): the expectation falls to ``erf(m_i / (s_i sqrt(2)))``, a bias, and each
  element's update variance ``1 - E^2`` grows: ``B`` from the expectations, ``V`` from the added
  variance over ``H`` steps.

The risk is ``risk[b][f] = (p_b / P) * (B_f + V_f)``, zero for ``fp32``. Formats resolve per tensor as
the optimizer resolves them (``int8`` under ``min_8bit_numel`` is ``fp32``; a group without momentum
holds ``none`` whatever is asked, so every format scores zero there).

The BAOC controller allocates with these scores (:func:`lightning_baoc.risk.optimizer_risk_table`);
``benchmarks/momentum_risk_validation.py`` validates them at the allocation level against measured harm.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch
from torch import Tensor

from lightning_baoc.formats import MOMENTUM_FORMATS, Canonical, StepHyper, resolve_in
from lightning_baoc.optim.sharding import local
from lightning_baoc.risk.model import DEFAULT_HORIZON, BlockRisk
from lightning_baoc.risk.shadow import ShadowMoments

_SQRT2 = math.sqrt(2.0)


def shadow_betas(optimizer: torch.optim.Optimizer) -> dict[str, tuple[float, float]]:
    """Parameter name -> the betas the shadow moments of a BlockwiseSGD / BlockwiseLion follow: the
    buffer's own average (SGD's momentum, 0.9 where there is none; Lion's ``beta2``) and 0.999 for
    the second moment."""
    out: dict[str, tuple[float, float]] = {}
    for group in optimizer.param_groups:
        if "betas" in group:
            beta = float(group["betas"][1])
        else:
            beta = float(group["momentum"]) or 0.9
        for p in group["params"]:
            out[optimizer.param_name(p)] = (beta, 0.999)  # type: ignore[attr-defined]
    return out


def _round_trip(fmt: str, m: Tensor, generator: torch.Generator) -> Tensor:
    """Flat fp32 ``m`` encoded in momentum format ``fmt`` and decoded again."""
    spec = MOMENTUM_FORMATS[fmt]
    shape = (m.numel(),)
    views = {s.key: torch.zeros(s.numel, dtype=s.dtype, device=m.device) for s in spec.layout(shape)}
    key = int(torch.randint(0, 1 << 32, (1,), generator=generator))
    spec.encode(Canonical(shape, exp_avg=m.clone()), views, StepHyper(0.0, 0.9, 0.999, 0.0, 0.0, noise_key=key))
    decoded = spec.decode(views, shape).exp_avg
    assert decoded is not None
    return decoded.reshape(-1)


def _erf_ratio(mean: Tensor, deviation: Tensor) -> Tensor:
    """``erf(mean / (deviation sqrt 2))``: ``sign(mean)`` where the deviation is 0."""
    safe = deviation.clamp_min(torch.finfo(torch.float64).tiny)
    return torch.where(deviation > 0, torch.erf(mean / (safe * _SQRT2)), torch.sign(mean))


def _tensor_terms(
    rule: str, beta1: float, m_hat: Tensor, noise: Tensor, fmts: Mapping[str, str], generator: torch.Generator,
    scale: float, dampening: float = 0.0,
) -> tuple[float, float, dict[str, float], dict[str, float]]:
    """progress, ||u||^2, per-format bias ``||E[u_f] - u||^2`` and added variance, scaled to the tensor."""
    trips: dict[str, Tensor] = {}

    def trip(actual: str) -> Tensor:
        if actual not in trips:
            trips[actual] = _round_trip(actual, m_hat.float(), generator).double()
        return trips[actual]

    bias: dict[str, float] = {}
    added: dict[str, float] = {}
    if rule == "sgd":
        progress = update_sq = float((m_hat * m_hat).sum()) * scale
        damp = (1.0 - beta1) / (1.0 + beta1)
        c = (1.0 - beta1) / (1.0 - dampening) if dampening < 1.0 else 1.0
        for fmt, actual in fmts.items():
            bias[fmt], added[fmt] = 0.0, 0.0
            if actual == "none":
                bias[fmt] = (1.0 - c) ** 2 * update_sq
                added[fmt] = max(0.0, c * c - damp) * float(noise.sum()) * scale
            elif actual != "fp32":
                bias[fmt] = float(((trip(actual) - m_hat) ** 2).sum()) * scale
        return progress, update_sq, bias, added
    deviation = noise.sqrt()
    expected = _erf_ratio(m_hat, (1.0 - beta1) * deviation)
    progress = float((m_hat * expected).sum()) * scale
    update_sq = float((expected * expected).sum()) * scale
    for fmt, actual in fmts.items():
        bias[fmt], added[fmt] = 0.0, 0.0
        if actual == "fp32":
            continue
        if actual == "none":
            plain = _erf_ratio(m_hat, deviation)
            bias[fmt] = float(((plain - expected) ** 2).sum()) * scale
            added[fmt] = float((expected * expected - plain * plain).clamp_min(0.0).sum()) * scale
        else:
            shifted = _erf_ratio(beta1 * trip(actual) + (1.0 - beta1) * m_hat, (1.0 - beta1) * deviation)
            bias[fmt] = float(((shifted - expected) ** 2).sum()) * scale
    return progress, update_sq, bias, added


def momentum_risk_details(
    optimizer: torch.optim.Optimizer,
    blocks: Mapping[str, Sequence[str]],
    shadow: ShadowMoments,
    formats: Sequence[str] | None = None,
    horizon: int = DEFAULT_HORIZON,
    seed: int = 0,
) -> dict[str, BlockRisk]:
    """The risk of every momentum format on every block of a BlockwiseSGD or BlockwiseLion, with the
    terms behind it (see the module docstring).

    Args:
        optimizer: the BlockwiseSGD or BlockwiseLion (its rule, groups, names and small-tensor threshold).
        blocks: block name -> parameter names.
        shadow: the moments measured from the gradients, kept with :func:`shadow_betas`.
        formats: formats to score (default: all of :data:`~lightning_baoc.formats.MOMENTUM_FORMATS`).
        horizon: steps over which update noise averages out (default: 200).
        seed: seed of the stochastic rounding of the round trips (default: 0).

    Raises:
        TypeError: the optimizer is not a BlockwiseSGD or BlockwiseLion.
        ValueError: an unknown format, or a horizon below 1.
    """
    rule = getattr(optimizer, "rule", None)
    if rule not in ("sgd", "lion"):
        raise TypeError(f"momentum_risk_details scores BlockwiseSGD and BlockwiseLion, got {type(optimizer).__name__}")
    if not isinstance(horizon, int) or horizon < 1:
        raise ValueError(f"Invalid horizon: {horizon!r}; expected an int >= 1 (optimizer steps)")
    formats = list(formats) if formats is not None else list(MOMENTUM_FORMATS)
    for fmt in formats:
        if fmt not in MOMENTUM_FORMATS:
            raise ValueError(f"Unknown format {fmt!r} in formats; allowed: {list(MOMENTUM_FORMATS)}")
    generator = torch.Generator().manual_seed(seed)
    named = optimizer.named_params  # type: ignore[attr-defined]
    out: dict[str, BlockRisk] = {}
    with torch.no_grad():
        for block, names in blocks.items():
            br = BlockRisk(block, bias={f: 0.0 for f in formats}, variance={f: 0.0 for f in formats})
            added_total = {f: 0.0 for f in formats}
            for name in names:
                entry = shadow.entries.get(name)
                if entry is None or entry.steps == 0:
                    continue
                p = named[name]
                group = optimizer.param_group_of(name)  # type: ignore[attr-defined]
                if rule == "sgd":
                    beta1 = beta_buffer = float(group["momentum"]) or 0.9
                else:
                    beta1, beta_buffer = (float(b) for b in group["betas"])
                fmts = {f: resolve_in(MOMENTUM_FORMATS, f, p.shape, optimizer.min_8bit_numel) for f in formats}  # type: ignore[attr-defined]
                if rule == "sgd" and float(group["momentum"]) == 0.0:
                    fmts = {f: "fp32" for f in formats}  # no buffer in any format: nothing to lose
                m_hat, v_hat = entry.corrected((beta_buffer, 0.999))
                noise = (v_hat - m_hat * m_hat).clamp_min(0.0)
                scale = local(p).numel() / max(1, m_hat.numel())
                dampening = float(group["dampening"]) if rule == "sgd" else 0.0
                progress, update_sq, bias, added = _tensor_terms(
                    rule, beta1, m_hat, noise, fmts, generator, scale, dampening
                )
                br.progress += progress
                br.update_sq += update_sq
                for f in formats:
                    br.bias[f] += bias[f]
                    added_total[f] += added[f]
            if br.update_sq > 0:
                for f in formats:
                    br.bias[f] /= br.update_sq
                    br.variance[f] = added_total[f] / (horizon * br.update_sq)
            out[block] = br
    total = sum(max(0.0, br.progress) for br in out.values())
    for br in out.values():
        br.share = max(0.0, br.progress) / total if total > 0 else 0.0
        br.risk = {f: max(0.0, br.share * (br.bias[f] + br.variance[f])) for f in formats}
    return out


def momentum_risk_table(
    optimizer: torch.optim.Optimizer,
    blocks: Mapping[str, Sequence[str]],
    shadow: ShadowMoments,
    formats: Sequence[str] | None = None,
    horizon: int = DEFAULT_HORIZON,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Block -> momentum format -> risk (non-negative; 0 for ``fp32``): :func:`momentum_risk_details`'s scores."""
    details = momentum_risk_details(optimizer, blocks, shadow, formats, horizon, seed)
    return {block: dict(br.risk) for block, br in details.items()}


__all__ = ["momentum_risk_details", "momentum_risk_table", "shadow_betas"]
