"""The risk model: how much harm would each state format do to each block?

The score is a prediction of harm to training progress over a horizon of ``H`` optimizer steps,
measured against fp32 AdamW's own moments: the controller keeps them on a fixed sample of each
tensor from the first step, whatever format holds the state (:mod:`lightning_baoc.risk.shadow`);
without them, the block's decoded state stands in. A caution shapes it: one step's update perturbation is
a poor predictor (dropping momentum perturbs a single update by 20-30x its norm yet moves the loss
by ~1e-2, either way), because zero-mean noise in the update averages out over steps while a bias
does not. So the risk separates what persists from what averages out.

For a block ``b`` with bias-corrected moments ``m, v`` (per element ``i``) and Adam direction
``u_i = m_i / (sqrt(v_i) + eps)``:

- **progress** ``p_b = sum_i m_i * u_i``: the first-order loss decrease per unit learning rate
  that the block contributes (``m`` estimates the expected gradient). Blocks are weighted by
  their share of the total progress ``P = sum_b p_b``: harm to a block that drives little of
  the descent matters little.
- **bias** of format ``f``: the format's state is round-tripped through its real encode/decode
  (the same code the optimizer runs: companded 8-bit codes, bf16 rounding, Adafactor's rank-1
  ``v``), and the expected update ``E[u_f] = m_f / (sqrt(v_f) + eps)`` (``m_f = m`` for formats
  without momentum: the gradient's expectation) is compared with ``u``:
  ``B_f = ||E[u_f] - u||^2 / ||u||^2``. A systematic distortion of the step sizes (a factored
  ``v`` on an unevenly scaled matrix; 8-bit ``v`` entries rounded to zero, whose updates become
  ``m / eps``) persists over every step, so it enters in full.
- **variance** of formats without momentum: the raw gradient replaces ``m``; with ``E[g^2] = v``
  the per-element update noise is ``(v_i - m_i^2)^+ / (sqrt(v_i) + eps)^2``. Momentum had
  already damped that noise to a fraction ``a = (1 - beta1) / (1 + beta1)`` (an EMA's variance
  reduction), so dropping it adds ``(1 - a)`` of it. Summed over ``H`` steps, noise grows like
  ``sqrt(H)`` and progress like ``H``: the relative squared error of the accumulated update is
  ``V_f = (1 - a) * sum_i noise_i / (H * ||u||^2)``.

- **8-bit v, re-quantized** (``int8``, ``nomomentum_int8``): ``v`` is re-encoded at every step and
  its codes follow the group's scale, not their own average, so one round trip at allocation time
  does not see the error later in training; what carries over is its order of magnitude, a property
  of the format on the model. The error of non-zero codes therefore enters at the model-wide level
  (``sum_b err_b / sum_b ||u_b||^2``, times the block's ``||u||^2`` held in 8 bits); elements coded 0
  (below their group's resolution, their update shrinking at every step) stay the block's own.

The risk is ``risk[b][f] = (p_b / P) * (B_f + V_f)``, zero for ``fp32`` and ``offload`` (the
same fp32 math; ``offload`` costs time, which the time budget prices). The gradient statistics of
the sampler enter where the state cannot speak: a block already held without momentum (at a
re-evaluation) has no ``m``; its signal is then taken from the sampled gradients'
signal-to-noise ratio, ``m_i^2 = v_i * (1 - noise_fraction)``, per element, in expectation.

Cost is bounded per tensor: above ``max_elements`` elements, the scores are computed on random
1024-element segments aligned to the 8-bit formats' quantization super-blocks (so the round trip
is exactly the one the format performs), with factored ``v`` built from the full tensor's row and
column means.

Validation (does it predict measured harm?) is ``benchmarks/risk_validation.py``, and the measurements
behind the 8-bit-v term are ``benchmarks/int8_mechanism.py``; their tables and what they found (why
the no-momentum term is priced per block, the rank correlations per format and task) are in the
documentation's risk pages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from lightning_baoc.formats import FORMATS, Canonical, StepHyper, factor_dims, resolve_format
from lightning_baoc.formats.base import factor_view, factored_ratio, row_mean
from lightning_baoc.optim import BlockwiseAdamW
from lightning_baoc.optim.convert import StateSlices
from lightning_baoc.optim.sharding import decided_shape, local, piece, row_shards
from lightning_baoc.risk.shadow import ShadowEntry, ShadowMoments
from lightning_baoc.risk.shadow import sample_segments as _segments

#: Default horizon (optimizer steps) over which zero-mean update noise averages out.
DEFAULT_HORIZON = 200
#: Default bound on the elements of one tensor that the scores are computed on.
DEFAULT_MAX_ELEMENTS = 1 << 16


@dataclass
class BlockRisk:
    """The terms behind one block's risk scores (all floats, JSON-ready)."""

    name: str
    progress: float = 0.0  # p_b, over the sampled elements scaled to the whole block
    update_sq: float = 0.0  # ||u||^2, same scaling
    noise_sq: float = 0.0  # sum_i (v_i - m_i^2)^+ / (sqrt(v_i) + eps)^2, same scaling
    bias: dict[str, float] = field(default_factory=dict)  # format -> B_f
    variance: dict[str, float] = field(default_factory=dict)  # format -> V_f
    risk: dict[str, float] = field(default_factory=dict)  # format -> final score
    share: float = 0.0  # p_b / P

    @property
    def noise_ratio(self) -> float:
        """Per-step update noise over update signal (the 20-30x of the module docstring's caution)."""
        return self.noise_sq / self.update_sq if self.update_sq > 0 else math.nan


def _requantized_v(fmt: str) -> bool:
    """Whether ``fmt`` holds v element-wise in 8-bit codes, re-quantized at every step."""
    spec = FORMATS[fmt]
    return spec.quantized and not spec.factored


def _round_trip(
    fmt: str, m: Tensor | None, v: Tensor, generator: torch.Generator
) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """Encode flat fp32 ``m``, ``v`` in an element-wise format and decode them again; the third
    item marks the elements whose v got code 0 (below half a step of their group) in the 8-bit-v
    formats, None in the others."""
    shape = (v.numel(),)
    layout = FORMATS[fmt].layout(shape)
    views = {spec.key: torch.zeros(spec.numel, dtype=spec.dtype, device=v.device) for spec in layout}
    has_m = FORMATS[fmt].has_momentum
    state = Canonical(shape, exp_avg=m.clone() if (has_m and m is not None) else None, exp_avg_sq=v.clone())
    if has_m and state.exp_avg is None:
        state.exp_avg = torch.zeros_like(v)
    key = int(torch.randint(0, 1 << 32, (1,), generator=generator))  # the rounding of this trip
    hyper = StepHyper(0.0, 0.9, 0.999, 0.0, 0.0, noise_key=key)
    FORMATS[fmt].encode(state, views, hyper)
    out = FORMATS[fmt].decode(views, shape)
    zero = views["exp_avg_sq"] == 0 if _requantized_v(fmt) else None
    return out.exp_avg, out.exp_avg_sq, zero


def _update_terms(m_hat: Tensor, v_hat: Tensor, eps: float, scale: float) -> tuple[Tensor, float, float, float]:
    """AdamW's update ``u`` of the sampled elements, and the block's progress ``sum(m * u)``,
    ``||u||^2`` and update noise ``sum((v - m^2)^+ / denom^2)``, scaled to the whole tensor."""
    denom = v_hat.sqrt() + eps
    u = m_hat / denom
    noise = ((v_hat - m_hat * m_hat).clamp_min(0.0) / (denom * denom)).sum()
    return u, float((m_hat * u).sum()) * scale, float((u * u).sum()) * scale, float(noise) * scale


def _factored_estimate(means: tuple[Tensor, Tensor], cols: int, idx: Tensor | None, shards: Any = None) -> Tensor:
    """The factored formats' rank-1 estimate of ``v`` at the sampled elements, in float64, from the
    row and column means of the ``v`` held (:meth:`StateSlices.factored_means`: means as sums of
    ``v / n``, which cannot overflow; a plain mean of moments near 1e38 sums past fp32's maximum).

    The estimate is ``(row / mean(row)) * col``, whose ratio is at most ``rows``: the product
    ``row * col`` of two moments near 1e38 would be inf. ``shards``: ``means`` are a shard's rows and the
    whole parameter's columns; the row mean is the whole parameter's (a collective).
    """
    row, col = means
    flat = torch.arange(row.numel() * cols) if idx is None else idx
    ratio = factored_ratio(row, row_mean(row, shards))
    return ratio[flat // cols].double() * col[flat % cols].double()


def _raw_state(opt: BlockwiseAdamW, name: str, shards: Any) -> tuple[StateSlices, int, int, Mapping] | None:
    # a shard's factored state reads over the whole parameter's row mean when every rank scores its
    # rows (``shards``); over this rank's rows otherwise (no collective)
    state = opt.state_slices(name, shards)
    if state is None:
        return None
    return state, opt.step_count(name), opt.momentum_step_count(name), opt.param_group_of(name)


Terms = tuple[float, float, float, dict[str, float], dict[str, float], dict[str, tuple[float, float]]]


def _summed_over_shards(terms: Terms | None, formats: Sequence[str], shards: Any, device: torch.device) -> Terms | None:
    """``terms`` of one shard's rows summed over every shard (one all-reduce): each is a sum over
    elements (scaled to the rows sampled), so the sum is the whole parameter's."""
    progress, update_sq, noise_sq, bias, added, rounding = terms or (0.0, 0.0, 0.0, {}, {}, {})
    flat = [progress, update_sq, noise_sq, float(terms is not None)]
    for f in formats:
        err, usq = rounding.get(f, (0.0, 0.0))
        flat += [bias.get(f, 0.0), added.get(f, 0.0), err, usq, float(f in rounding)]
    t = shards.sum_(torch.tensor(flat, dtype=torch.float64, device=device))  # on the device: NCCL's
    if t[3] == 0:
        return None
    out = t.tolist()
    per = {f: out[4 + 5 * i : 9 + 5 * i] for i, f in enumerate(formats)}
    return (out[0], out[1], out[2], {f: v[0] for f, v in per.items()}, {f: v[1] for f, v in per.items()},
            {f: (v[2], v[3]) for f, v in per.items() if v[4] > 0})


def _param_terms(
    opt: BlockwiseAdamW,
    name: str,
    formats: Sequence[str],
    noise_fraction: float | None,
    generator: torch.Generator,
    max_elements: int,
    shadow: ShadowEntry | None = None,
    shards: Any = None,
) -> Terms | None:
    """progress, ||u||^2, noise^2, per-format ||E[u_f] - u||^2 and added noise^2 of one tensor, and
    for the formats that hold this tensor's v in 8-bit codes, (the part of ``||E[u_f] - u||^2``
    from elements with non-zero codes, ``||u||^2``): the rounding that is pooled. ``shards``: a
    shard's rows, scored by every rank (collectives; :func:`_tensor_terms` sums the terms)."""
    raw = _raw_state(opt, name, shards)
    if raw is None:
        return None
    state, step, m_step, group = raw
    p = opt.named_params[name]
    beta1, beta2 = (float(b) for b in group["betas"])
    eps = float(group["eps"])
    # the state is read at the sampled elements and, for the factored formats, as row and column means,
    # slice by slice: never decoded whole (a tensor's fp32 m and v would be a transient of 8 bytes per element)
    numel = state.numel
    if shadow is not None and shadow.steps > 0:
        # fp32 AdamW's own moments on the shadow's sample, whatever format holds the state
        idx, v, m = shadow.index, shadow.exp_avg_sq, shadow.exp_avg
        step = m_step = shadow.steps
    else:
        idx = _segments(numel, max_elements, generator)
        m, v = state.gather(idx)
        m = m if m_step else None
    scale = 1.0 if idx is None else numel / idx.numel()
    bc2 = 1.0 - beta2**step if step else 1.0
    bc1 = 1.0 - beta1**m_step if m is not None else 1.0
    # float64 on the sampled elements (at most max_elements): v / bias_correction2 of a finite v
    # near fp32's maximum is past it, and so are m * u and the squares below
    v_hat = v.double() / bc2
    if m is not None:
        m_hat = m.double() / bc1
    else:
        # no momentum held: expected signal from the sampled gradients' SNR (see module doc)
        frac = 1.0 if noise_fraction is None or math.isnan(noise_fraction) else noise_fraction
        m_hat = (v_hat * (1.0 - frac)).sqrt()
    u, progress, update_sq, noise_sq = _update_terms(m_hat, v_hat, eps, scale)
    damp = (1.0 - beta1) / (1.0 + beta1)

    # a re-created momentum estimates the same signal (in fp32, as a format would hold it)
    m_src = m if m is not None else (m_hat * bc1).float().clamp_(max=torch.finfo(torch.float32).max)
    decided = decided_shape(p)  # a DTensor's global shape, a piece's: the shape its formats were decided on
    dims = factor_view(local(p).shape) if factor_dims(decided) is not None else None  # a shard: its rows
    factored_v: Tensor | None = None
    bias: dict[str, float] = {}
    added_noise: dict[str, float] = {}
    cache: dict[str, tuple[Tensor | None, Tensor, Tensor | None]] = {}
    rounding: dict[str, tuple[float, float]] = {}
    for fmt in formats:
        actual = resolve_format(fmt, decided, opt.min_8bit_numel)
        spec = FORMATS[actual]
        if actual in ("fp32", "offload"):
            bias[fmt], added_noise[fmt] = 0.0, 0.0
            continue
        if spec.factored:
            if factored_v is None:
                assert dims is not None  # factored formats resolve only for 2-D and larger shapes
                factored_v = _factored_estimate(state.factored_means(), dims[1], idx, shards)
            v_f = factored_v
            m_f = _round_trip("int8", m_src, v, generator)[0] if spec.has_momentum else None
            zero = None
        else:
            if actual not in cache:
                cache[actual] = _round_trip(actual, m_src, v, generator)
            m_f, v_f, zero = cache[actual]
        m_exp = (m_f.double() / bc1) if (spec.has_momentum and m_f is not None) else m_hat
        u_f = m_exp / ((v_f.double() / bc2).sqrt() + eps)
        err = (u_f - u) ** 2
        bias[fmt] = float(err.sum()) * scale
        if zero is not None:
            rounding[fmt] = (float(err[~zero].sum()) * scale, update_sq)
        # risk is relative to full fp32 AdamW: every format without momentum adds the noise
        added_noise[fmt] = 0.0 if spec.has_momentum else (1.0 - damp) * noise_sq
    return progress, update_sq, noise_sq, bias, added_noise, rounding


def _tensor_terms(
    opt: BlockwiseAdamW, name: str, formats: Sequence[str], noise_fraction: float | None, generator: torch.Generator,
    max_elements: int, entry: ShadowEntry | None, across_shards: bool, scores_whole: bool,
) -> Terms | None:
    """:func:`_param_terms` of one tensor; of a parameter split by rows (``across_shards``), every
    rank's terms of its rows summed over the shards (a rank holding none takes part in the sums)."""
    p = opt.named_params[name]
    shards = row_shards(p) if across_shards else None
    held = piece(p) if across_shards else None  # a DeepSpeed fragment: its ranks' terms summed, split or not
    if shards is None and held is None:  # not split by rows: rank zero, which holds it whole, scores it
        return _param_terms(opt, name, formats, noise_fraction, generator, max_elements, entry) if scores_whole else None
    if local(p).numel():
        terms = _param_terms(opt, name, formats, noise_fraction, generator, max_elements, entry, shards)
    elif shards is None:  # a piece with no element here, its rows on one rank: nothing of it to score
        terms = None
    else:  # no rows here: the collectives of the others' factored forms, no terms
        terms, state = None, opt.state_slices(name, shards)  # a factored state's row mean: a collective
        if state is not None and any(FORMATS[resolve_format(f, decided_shape(p), opt.min_8bit_numel)].factored for f in formats):
            _factored_estimate(state.factored_means(), factor_view(local(p).shape)[1], None, shards)  # type: ignore[index]
    return _summed_over_shards(terms, formats, shards if shards is not None else held, local(p).device)


def risk_details(
    optimizer: BlockwiseAdamW,
    blocks: Mapping[str, Sequence[str]],
    statistics: Mapping[str, Mapping[str, float]] | None = None,
    formats: Sequence[str] | None = None,
    horizon: int = DEFAULT_HORIZON,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    seed: int = 0,
    shadow: ShadowMoments | None = None,
    across_shards: bool = False,
    scores_whole: bool = True,
) -> dict[str, BlockRisk]:
    """The risk scores with the terms behind them (see the module docstring for the formula).

    Args:
        optimizer: the BlockwiseAdamW whose live state is scored.
        blocks: block name -> parameter names (:func:`lightning_baoc.partition`).
        statistics: per-block sampler statistics (``noise_fraction`` is read for blocks held
            without momentum); optional.
        formats: formats to score (default: all of :data:`~lightning_baoc.FORMATS`).
        horizon: steps over which update noise averages out (default: 200).
        max_elements: elements per tensor the scores are computed on (default: 65536).
        seed: seed of the segment sampling and of stochastic rounding (default: 0).
        shadow: fp32 AdamW moments on a sample of each tensor (:class:`ShadowMoments`); where a
            tensor has them, the scores are measured against them instead of the decoded state,
            so the format holding the state does not look free (default: none).
        across_shards: every rank of a sharded model (FSDP2) calls this at once: each scores its rows
            of a parameter split by rows and the terms are summed over the shards (collectives), so
            they are the whole parameter's (default: ``False``: this rank's rows stand for it).
        scores_whole: with ``across_shards``, whether this rank also scores the parameters not
            split by rows (rank zero does, and decides; the others need not) (default: ``True``).
    """
    if not isinstance(horizon, int) or horizon < 1:
        raise ValueError(f"Invalid horizon: {horizon!r}; expected an int >= 1 (optimizer steps)")
    formats = list(formats) if formats is not None else list(FORMATS)
    for fmt in formats:
        if fmt not in FORMATS:
            raise ValueError(f"Unknown format {fmt!r} in formats; allowed: {list(FORMATS)}")
    generator = torch.Generator().manual_seed(seed)
    out: dict[str, BlockRisk] = {}
    # per block and 8-bit-v format: (||E[u_f] - u||^2 of non-zero codes, ||u||^2 of those tensors)
    rounding: dict[str, dict[str, list[float]]] = {}
    noise_added: dict[str, dict[str, float]] = {}  # per block: format -> absolute added noise
    with torch.no_grad():
        for block, names in blocks.items():
            br = BlockRisk(block, bias={f: 0.0 for f in formats}, variance={f: 0.0 for f in formats})
            noise_fraction = None
            if statistics is not None and block in statistics:
                noise_fraction = statistics[block].get("noise_fraction")
            added_noise = noise_added.setdefault(block, {f: 0.0 for f in formats})
            pooled = rounding.setdefault(block, {})
            for name in names:
                entry = shadow.entries.get(name) if shadow is not None else None
                terms = _tensor_terms(optimizer, name, formats, noise_fraction, generator, max_elements, entry,
                                      across_shards, scores_whole)
                if terms is None:
                    continue
                progress, update_sq, noise_sq, bias, added, rounded = terms
                br.progress += progress
                br.update_sq += update_sq
                br.noise_sq += noise_sq
                for f in formats:
                    br.bias[f] += bias[f]
                    added_noise[f] += added[f]
                for f, (err, usq) in rounded.items():
                    acc = pooled.setdefault(f, [0.0, 0.0])
                    acc[0] += err
                    acc[1] += usq
            out[block] = br
    _pool_rounding(out, rounding)
    for block, br in out.items():
        if br.update_sq > 0:
            for f in formats:
                br.bias[f] /= br.update_sq
                br.variance[f] = noise_added[block][f] / (horizon * br.update_sq)
    total = sum(br.progress for br in out.values())
    for br in out.values():
        br.share = br.progress / total if total > 0 else 0.0
        br.risk = {f: max(0.0, br.share * (br.bias[f] + br.variance[f])) for f in formats}
    return out


def _pool_rounding(out: Mapping[str, BlockRisk], rounding: Mapping[str, Mapping[str, list[float]]]) -> None:
    """Replace each block's 8-bit rounding error by the model-wide level (module docstring).

    The absolute ``||E[u_f] - u||^2`` from non-zero codes becomes the pooled relative level,
    ``sum over the model of that error / sum of ||u||^2`` of the same tensors, times the block's own
    ``||u||^2`` in 8-bit v; the error of zero-coded elements stays the block's own.
    """
    totals: dict[str, list[float]] = {}
    for per_format in rounding.values():
        for f, (err, usq) in per_format.items():
            acc = totals.setdefault(f, [0.0, 0.0])
            acc[0] += err
            acc[1] += usq
    for block, per_format in rounding.items():
        for f, (err, usq) in per_format.items():
            level = totals[f][0] / totals[f][1] if totals[f][1] > 0 else 0.0
            out[block].bias[f] += level * usq - err


def risk_table(
    optimizer: BlockwiseAdamW,
    blocks: Mapping[str, Sequence[str]],
    statistics: Mapping[str, Mapping[str, float]] | None = None,
    formats: Sequence[str] | None = None,
    horizon: int = DEFAULT_HORIZON,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    seed: int = 0,
    shadow: ShadowMoments | None = None,
    across_shards: bool = False,
    scores_whole: bool = True,
) -> dict[str, dict[str, float]]:
    """Block -> format -> risk (non-negative; 0 for ``fp32`` and ``offload``; the arguments are
    :func:`risk_details`').

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
        >>> opt = BlockwiseAdamW(model.named_parameters(), min_8bit_numel=0)
        >>> for _ in range(3):
        ...     opt.zero_grad(); model(torch.randn(16, 64)).pow(2).mean().backward(); opt.step()
        >>> risk = risk_table(opt, {"0": ["0.weight", "0.bias"], "1": ["1.weight", "1.bias"]})
        >>> risk["0"]["fp32"], risk["0"]["int8"] > 0
        (0.0, True)
    """
    details = risk_details(optimizer, blocks, statistics, formats, horizon, max_elements, seed, shadow, across_shards,
                           scores_whole)
    return {block: dict(br.risk) for block, br in details.items()}
