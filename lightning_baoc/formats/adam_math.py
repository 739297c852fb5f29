"""AdamW's update as pure functions over fp32 tensors, shared by every format.

Two forms of the same math (``torch.optim.AdamW``: decoupled weight decay, bias correction):

- :func:`foreach_adamw`: lists of full tensors with ``torch._foreach_*`` ops, written in the same
  order as torch's own foreach implementation, for formats whose state is already fp32 (parity
  with ``torch.optim.AdamW`` to rounding). ``fp32`` and ``offload`` run torch's fused kernel
  instead where it applies (:mod:`.fused_adam`); this is their reference and fallback.
- :func:`chunk_adamw`: one flat fp32 chunk of momentum (or none) and second moment, for formats
  that dequantize a chunk, update it and write it back.

``chunk_ranges`` walks a parameter in chunks whose boundaries fall on 32-element quantization
groups, and :func:`param_flat` gives a writable flat fp32 view of a parameter (or a copy to write
back for non-contiguous or low-precision parameters).
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch
from torch import Tensor

from lightning_baoc.formats.base import StepHyper, StepItem
from lightning_baoc.formats.quant import SUPER, sqrt_rn


def chunk_ranges(numel: int, chunk: int, lead: int | None = None) -> Iterator[tuple[int, int]]:
    """``[start, stop)`` ranges covering ``numel`` elements; starts fall on 8-bit super-blocks.

    ``lead`` (a shard's states laid out in the whole parameter's super-blocks, ``frames.frame_lead``):
    where the first element sits in its super-block; the starts then fall on the whole parameter's
    super-blocks, and a partial first or last super-block is a range of its own (what a shard shares
    with its neighbours stays small).
    """
    chunk = max(SUPER, (chunk // SUPER) * SUPER)
    if lead is None:
        for start in range(0, numel, chunk):
            yield start, min(start + chunk, numel)
        return
    first = min((-lead) % SUPER, numel)  # the first super-block boundary
    last = max(first, numel - (numel + lead) % SUPER)  # the last one
    cuts = [0, *range(first, last, chunk), last, numel]
    for start, stop in zip(cuts, cuts[1:]):
        if stop > start:
            yield start, stop


def element_batches(items: list[StepItem], limit: int) -> Iterator[list[StepItem]]:
    """``items`` in consecutive batches of at most ``limit`` parameter elements (a larger parameter
    is a batch of its own; every batch holds at least one item)."""
    batch: list[StepItem] = []
    size = 0
    for it in items:
        if batch and size + it.param.numel() > limit:
            yield batch
            batch, size = [], 0
        batch.append(it)
        size += it.param.numel()
    if batch:
        yield batch


def param_flat(param: Tensor) -> tuple[Tensor, Callable[[], None]]:
    """A flat fp32 tensor to update in place, and a function that writes it back to ``param``."""
    if param.dtype == torch.float32 and param.is_contiguous():
        return param.view(-1), _noop
    work = param.detach().to(torch.float32).reshape(-1).clone()

    def write_back() -> None:
        param.copy_(work.view_as(param))

    return work, write_back


def _noop() -> None:
    return None


def grad_flat(grad: Tensor) -> Tensor:
    """A flat view of the gradient (a copy only if it is not contiguous)."""
    return grad.reshape(-1)


def effective_grad(g: Tensor, p: Tensor, hyper: StepHyper) -> Tensor:
    """The gradient the moments see: fp32, negated under ``maximize``, plus L2 decay for Adam."""
    g = g.to(torch.float32)
    if hyper.maximize:
        g = -g
    if hyper.weight_decay != 0 and not hyper.decoupled_weight_decay:
        g = g.add(p, alpha=hyper.weight_decay)
    return g


def chunk_adamw(
    p: Tensor,
    g: Tensor,
    m: Tensor | None,
    v: Tensor,
    hyper: StepHyper,
    bias_correction1: float,
    bias_correction2: float,
) -> None:
    """One AdamW step on a flat fp32 chunk, in place on ``p``, ``m`` and ``v``.

    Args:
        p: flat fp32 parameter chunk (written).
        g: flat gradient chunk (read only, any float dtype).
        m: flat fp32 first moment, or ``None`` for formats without momentum (the update then uses
            the gradient itself: RMSprop with Adam's bias-corrected second moment).
        v: flat fp32 second moment.
        hyper: the group's hyperparameters.
        bias_correction1: ``1 - beta1 ** t_m`` (ignored without momentum).
        bias_correction2: ``1 - beta2 ** t``.
    """
    g = effective_grad(g, p, hyper)
    if hyper.weight_decay != 0 and hyper.decoupled_weight_decay:
        p.mul_(1.0 - hyper.lr * hyper.weight_decay)
    v.mul_(hyper.beta2).addcmul_(g, g, value=1.0 - hyper.beta2)
    # times the reciprocal (one division per element fewer than torch's order; ulps apart)
    denom = sqrt_rn(v).mul_(1.0 / math.sqrt(bias_correction2)).add_(hyper.eps)
    if m is not None:
        m.lerp_(g, 1.0 - hyper.beta1)
        p.addcdiv_(m, denom, value=-hyper.lr / bias_correction1)
    else:
        p.addcdiv_(g, denom, value=-hyper.lr)


def foreach_adamw(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor] | None,
    exp_avg_sqs: list[Tensor],
    hyper: StepHyper,
    bias_corrections1: list[float],
    bias_corrections2: list[float],
) -> None:
    """AdamW over lists of fp32 tensors with foreach kernels (torch's own order of operations)."""
    if not params:
        return
    if hyper.maximize:
        grads = torch._foreach_neg(grads)
    if hyper.weight_decay != 0:
        if hyper.decoupled_weight_decay:
            torch._foreach_mul_(params, 1.0 - hyper.lr * hyper.weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=hyper.weight_decay)
    if exp_avgs is not None:
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - hyper.beta1)
    torch._foreach_mul_(exp_avg_sqs, hyper.beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - hyper.beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, [bc**0.5 for bc in bias_corrections2])
    torch._foreach_add_(denom, hyper.eps)
    if exp_avgs is not None:
        step_sizes = [-(hyper.lr / bc) for bc in bias_corrections1]
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)
    else:
        torch._foreach_addcdiv_(params, grads, denom, -hyper.lr)


def foreach_dense_fp32(
    items: list[StepItem], hyper: StepHyper, m_key: str | None, v_key: str
) -> None:
    """Run :func:`foreach_adamw` on items whose state tensors are fp32 on the parameter's device.

    Parameters that are not fp32 go through a working copy that is written back.
    """
    for arguments in foreach_batches(items, hyper, m_key, v_key):
        foreach_adamw(*arguments)


#: Elements one foreach call updates at most. Bounds the call's temporaries (the denominators, a
#: maximized or L2-decayed gradient: 4 bytes per element each) to a few MiB whatever the number and
#: size of the tensors: one call over every fp32 tensor would hold half their state again.
FOREACH_ELEMENTS = 1 << 21


def foreach_batches(
    items: list[StepItem], hyper: StepHyper, m_key: str | None, v_key: str
) -> Iterator[tuple[list[Tensor], list[Tensor], list[Tensor] | None, list[Tensor], StepHyper, list[float], list[float]]]:
    """The arguments of the :func:`foreach_adamw` calls that step ``items`` (fp32 states on the parameters'
    devices), in batches of at most :data:`FOREACH_ELEMENTS` elements (a large tensor is cut into flat
    slices: the math is element-wise). Each parameter that is not fp32 first, alone, through an fp32 working
    copy written back once its calls have run (when the loop asks for the next batch); then the fp32 ones."""
    direct = [it for it in items if it.param.dtype == torch.float32]
    for it in items:
        if it.param.dtype != torch.float32:
            work = it.param.detach().to(torch.float32)
            yield from _batches([work], [it], hyper, m_key, v_key)
            it.param.copy_(work)
    if direct:
        yield from _batches([it.param for it in direct], direct, hyper, m_key, v_key)


def _batches(
    params: list[Tensor], items: list[StepItem], hyper: StepHyper, m_key: str | None, v_key: str
) -> Iterator[tuple[list[Tensor], list[Tensor], list[Tensor] | None, list[Tensor], StepHyper, list[float], list[float]]]:
    """:func:`foreach_batches` of ``items`` stepping ``params`` (theirs, or working copies)."""
    batch: list[tuple[Tensor, Tensor, Tensor | None, Tensor, float, float]] = []
    size = 0
    for it, p in zip(items, params):
        m = it.views[m_key].view_as(p) if m_key is not None else None
        v = it.views[v_key].view_as(p)
        for piece in _pieces(p, it.grad, m, v):
            if batch and size + piece[0].numel() > FOREACH_ELEMENTS:
                yield _arguments(batch, hyper)
                batch, size = [], 0
            batch.append((*piece, it.bias_correction1, it.bias_correction2))
            size += piece[0].numel()
    if batch:
        yield _arguments(batch, hyper)


def _pieces(p: Tensor, g: Tensor, m: Tensor | None, v: Tensor) -> Iterator[tuple[Tensor, Tensor, Tensor | None, Tensor]]:
    """Flat slices of at most :data:`FOREACH_ELEMENTS` of a parameter and its tensors (the whole
    tensors where one is not contiguous)."""
    n = p.numel()
    if n <= FOREACH_ELEMENTS or not all(t.is_contiguous() for t in (p, g, v) + ((m,) if m is not None else ())):
        yield p, (g if g.dtype == torch.float32 else g.float()), m, v
        return
    flat_p, flat_g, flat_v = p.view(-1), g.view(-1), v.view(-1)
    flat_m = m.view(-1) if m is not None else None
    for a in range(0, n, FOREACH_ELEMENTS):
        b = min(n, a + FOREACH_ELEMENTS)
        gs = flat_g[a:b]
        yield flat_p[a:b], (gs if gs.dtype == torch.float32 else gs.float()), (flat_m[a:b] if flat_m is not None else None), flat_v[a:b]


def _arguments(
    batch: list[tuple[Tensor, Tensor, Tensor | None, Tensor, float, float]], hyper: StepHyper
) -> tuple[list[Tensor], list[Tensor], list[Tensor] | None, list[Tensor], StepHyper, list[float], list[float]]:
    has_m = batch[0][2] is not None
    return (
        [b[0] for b in batch],
        [b[1] for b in batch],
        [b[2] for b in batch] if has_m else None,  # type: ignore[misc]
        [b[3] for b in batch],
        hyper,
        [b[4] for b in batch],
        [b[5] for b in batch],
    )
