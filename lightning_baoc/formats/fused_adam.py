"""The fp32 AdamW step through torch's fused multi-tensor kernel, with the foreach step as fallback.

``torch._fused_adamw_`` (``torch._fused_adam_`` for Adam's L2 decay) is the kernel
``torch.optim.AdamW(fused=True)`` runs: one pass over memory that reads each parameter, gradient and
moment once, writes them once and allocates nothing. :func:`fused_dense_fp32` launches it once per
device over every item of a (group, device) bucket it can serve, and sends the others through the
foreach step (:func:`~lightning_baoc.formats.adam_math.foreach_dense_fp32`), the reference: the same math in
torch's foreach order, to fp32 rounding (``tests/formats/test_fused_fp32.py`` measures the
distance in ulps).

An item goes to the fused kernel when:

- its parameter, gradient and both moments are fp32, contiguous and on one device. The kernel walks
  raw memory element by element, so a non-contiguous parameter would pair its elements with the
  wrong state elements, and it takes one dtype for all four tensors (a bf16 parameter with fp32
  state keeps the foreach step on an fp32 working copy);
- both bias corrections follow from one step count (:func:`fused_step_count`). The kernel derives
  both from one step tensor; a momentum re-created by a conversion counts its own steps
  (``m_step != step``) and keeps the foreach step;
- the kernel runs on that device type (:func:`fused_available`: probed once, cached).

The step counts the kernel reads are built per call as 0-d fp32 tensors on the device, one per
distinct count; they are inputs, the optimizer's records stay the source of truth.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch
from torch import Tensor

from lightning_baoc.formats.adam_math import foreach_adamw, foreach_batches
from lightning_baoc.formats.base import StepHyper, StepItem

#: Largest step count passed to the kernel: it reads the count as an fp32 number, exact up to 2**24.
MAX_FUSED_STEP = 1 << 24

#: (device type, decoupled weight decay) -> whether the fused kernel runs there; filled on first use.
_AVAILABLE: dict[tuple[str, bool], bool] = {}


def _kernel(decoupled: bool) -> Callable[..., None] | None:
    """torch's fused kernel for AdamW (decoupled decay) or Adam (L2 decay), or ``None``."""
    return getattr(torch, "_fused_adamw_" if decoupled else "_fused_adam_", None)


def fused_available(device: torch.device, decoupled: bool = True) -> bool:
    """Whether torch's fused Adam(W) kernel runs on fp32 tensors of ``device``'s type.

    Probed once per device type and mode with a one-element step (a torch build without the op, or
    without a kernel for the device, answers ``False``) and cached.

    Example:
        >>> fused_available(torch.device("cpu"))  # doctest: +SKIP
        True
    """
    key = (device.type, bool(decoupled))
    known = _AVAILABLE.get(key)
    if known is None:
        known = _probe(device, decoupled)
        _AVAILABLE[key] = known
    return known


def _probe(device: torch.device, decoupled: bool) -> bool:
    kernel = _kernel(decoupled)
    if kernel is None:
        return False
    try:
        p, g = torch.ones(1, device=device), torch.ones(1, device=device)
        m, v = torch.zeros(1, device=device), torch.zeros(1, device=device)
        step = torch.ones((), device=device)
        kernel([p], [g], [m], [v], [], [step], lr=0.5, beta1=0.9, beta2=0.999, weight_decay=0.0,
               eps=1e-8, amsgrad=False, maximize=False)
        # one step from p = 1 with g = 1 moves p by lr (m_hat / sqrt(v_hat) = 1): anything else
        # means the kernel does not do what this module relies on
        return abs(float(p.item()) - 0.5) < 1e-6
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def fused_step_count(item: StepItem, hyper: StepHyper) -> int | None:
    """The one step count both of ``item``'s bias corrections follow from, or ``None``.

    The count is ``item.step_count`` (set by the optimizer when the momentum is as old as the
    second moment), checked against the corrections themselves: the kernel computes
    ``1 - beta ** t`` in double precision from the count, exactly as the optimizer did.
    """
    t = item.step_count
    if t is None or not 0 < t <= MAX_FUSED_STEP:
        return None
    if item.bias_correction1 != 1.0 - hyper.beta1**t or item.bias_correction2 != 1.0 - hyper.beta2**t:
        return None
    return t


def fusable(p: Tensor, g: Tensor, m: Tensor, v: Tensor) -> bool:
    """Whether the kernel can update parameter ``p`` from gradient ``g`` with moments ``m`` and ``v``
    (dtypes, layout, device)."""
    tensors = (p, g, m, v)
    return (
        all(t.dtype == torch.float32 and t.is_contiguous() and t.device == p.device for t in tensors)
        and g.shape == p.shape
        and m.numel() == v.numel() == p.numel()
    )


def split_fused(
    items: list[StepItem], hyper: StepHyper, m_key: str, v_key: str
) -> tuple[list[tuple[StepItem, int]], list[StepItem]]:
    """``items`` split into those the fused kernel serves (with their step count) and the rest."""
    fused: list[tuple[StepItem, int]] = []
    rest: list[StepItem] = []
    for it in items:
        t = fused_step_count(it, hyper)
        if (
            t is not None
            and fusable(it.param, it.grad, it.views[m_key], it.views[v_key])
            and fused_available(it.param.device, hyper.decoupled_weight_decay)
        ):
            fused.append((it, t))
        else:
            rest.append(it)
    return fused, rest


def fused_dense_fp32(
    items: list[StepItem], hyper: StepHyper, m_key: str, v_key: str, found_inf: Tensor | None = None
) -> None:
    """One AdamW step of ``items`` (fp32 moments ``views[m_key]``, ``views[v_key]``), in place.

    One fused launch per device over the items :func:`split_fused` accepts; the others take the foreach
    step (:func:`~lightning_baoc.formats.adam_math.foreach_adamw` over
    :func:`~lightning_baoc.formats.adam_math.foreach_batches`, the reference). ``found_inf`` (a
    one-element fp32 tensor on the items' device): the kernel's own flag, which skips the whole call
    where set. The optimizer passes it for items whose skips the device decides (``skip_flag``) and
    steps again those that were finite when it is set (``kernels/triton_step.py``, ``repair``).
    """
    if found_inf is None:
        if any(it.skip_flag is not None for it in items):
            raise RuntimeError("a step decided on the device reached the fused step without its found_inf flag")
        fused, rest = split_fused(items, hyper, m_key, v_key)
    else:  # the device's decision tested the tensors already (optim/stepping.py): only the counts here
        counted = [(it, fused_step_count(it, hyper)) for it in items]
        fused = [(it, t) for it, t in counted if t is not None]
        rest = [it for it, t in counted if t is None]
    by_device: dict[torch.device, list[tuple[StepItem, int]]] = defaultdict(list)
    for it, t in fused:
        by_device[it.param.device].append((it, t))
    for device, batch in by_device.items():
        kernel, arguments = fused_arguments(
            device, [it.param for it, _ in batch], [it.grad for it, _ in batch],
            [shaped(it.views[m_key], it.param) for it, _ in batch], [shaped(it.views[v_key], it.param) for it, _ in batch],
            [t for _, t in batch], hyper)
        kernel(*arguments, found_inf=found_inf, **_options(hyper))
    if rest:
        if any(it.skip_flag is not None for it in rest):  # the optimizer sends only what the kernel serves
            raise RuntimeError("a step decided on the device reached the foreach step, which cannot skip it")
        for arguments in foreach_batches(rest, hyper, m_key, v_key):
            foreach_adamw(*arguments)


def fused_call(
    device: torch.device, params: list[Tensor], grads: list[Tensor], ms: list[Tensor], vs: list[Tensor],
    counts: list[int], hyper: StepHyper, found_inf: Tensor | None, tensor_lr: bool = False,
) -> None:
    """One call of the fused kernel (served: :func:`fusable`, :func:`fused_available`) over ``params``
    with their gradients, moments in the parameters' shapes and step counts, all on ``device``;
    ``tensor_lr``: the learning rate given as an fp32 tensor on ``device`` (what a CUDA graph reads)."""
    kernel, arguments = fused_arguments(device, params, grads, ms, vs, counts, hyper)
    options = _options(hyper)
    if tensor_lr:
        options["lr"] = torch.full((), hyper.lr, dtype=torch.float32, device=device)
    kernel(*arguments, found_inf=found_inf, **options)


def fused_kernel_options(hyper: StepHyper) -> tuple[Callable[..., None], dict[str, float | bool]]:
    """torch's fused kernel for ``hyper`` and its options but the learning rate (a CUDA graph's step gives it
    as a tensor: :mod:`lightning_baoc.optim.graph_step`)."""
    kernel = _kernel(hyper.decoupled_weight_decay)
    assert kernel is not None  # the plan sent fp32 tensors to it only where it is available
    options = _options(hyper)
    del options["lr"]
    return kernel, options


def fused_arguments(
    device: torch.device, params: list[Tensor], grads: list[Tensor], ms: list[Tensor], vs: list[Tensor],
    counts: list[int], hyper: StepHyper,
) -> tuple[Callable[..., None], tuple]:
    """torch's fused kernel for ``hyper`` and its tensor arguments over ``params``: the step counts as 0-d
    fp32 tensors on ``device``, one per distinct count (a fill, not a host copy)."""
    steps: dict[int, Tensor] = {}
    for t in counts:
        if t not in steps:
            steps[t] = torch.full((), float(t), dtype=torch.float32, device=device)
    kernel = _kernel(hyper.decoupled_weight_decay)
    assert kernel is not None  # split_fused sent nothing here otherwise
    return kernel, (params, grads, ms, vs, [], [steps[t] for t in counts])


def _options(hyper: StepHyper) -> dict[str, float | bool]:
    return dict(lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2, weight_decay=hyper.weight_decay, eps=hyper.eps,
                amsgrad=False, maximize=hyper.maximize)


def shaped(state: Tensor, param: Tensor) -> Tensor:
    """``state`` (a flat view of the pool) in ``param``'s shape, as the kernel pairs them: a view made only
    where the shapes differ (a 1-D parameter takes its state as it is)."""
    return state if state.shape == param.shape else state.view_as(param)
