"""AMP's gradient scaler feeding the step on the device: ``torch.amp.GradScaler`` with a blockwise optimizer
whose ``amp_scaling`` is on.

By default ``GradScaler.step(optimizer)`` unscales the gradients, reads whether any was inf or NaN on the host
(``found_inf.item()``: a synchronisation at every step) and calls ``step()`` only where none was. An optimizer
that says it handles the scaling itself (``_step_supports_amp_scaling``) is called at every step instead, with
two tensors set on it for that call: ``grad_scale`` (the scale its gradients still carry, or ``None`` where
they were unscaled already) and ``found_inf`` (1 where the scaler found an inf or a NaN). The step then:

- unscales the gradients with the scaler's own operation (``torch._amp_foreach_non_finite_check_and_unscale_``
  by the scale's reciprocal, as ``GradScaler.unscale_`` does: the same bits), per device and dtype;
- skips the whole step where ``found_inf`` is set, decided on the device where every parameter's skip is
  (the Triton kernels, torch's fused AdamW, the CUDA graph step: ``found_inf`` joins each parameter's skip
  flag, and the counts advanced as if the step happened are taken back when next read), else read on the
  host. A step the scaler skipped is not a parameter's non-finite skip: it is neither counted in
  ``nonfinite_counts`` nor warned of, as when the scaler does not call ``step()``.

``amp_scaling`` is off by default, and :class:`~lightning_baoc.BAOC` leaves it off: Lightning refuses gradient
clipping with an optimizer that unscales inside its step (it clips between unscaling and stepping), and with it
on the gradients ``on_before_optimizer_step`` shows (which BAOC samples) would still carry the scale. It serves a
loop that calls ``GradScaler.step`` itself (or Lightning's ``fp16-mixed`` without clipping and without BAOC).
``tests/optim/test_amp.py``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import Tensor


def unscale_(grads: Iterable[Tensor], grad_scale: Tensor) -> None:
    """Divide ``grads`` by ``grad_scale`` in place, as ``GradScaler.unscale_`` does (the reciprocal in double,
    then fp32; one operation per device and dtype; no host read)."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for g in grads:
        by_kind[(g.device, g.dtype)].append(g)
    inverse: dict[torch.device, Tensor] = {}
    for (device, _), group in by_kind.items():
        if device not in inverse:
            inverse[device] = grad_scale.double().reciprocal().float().to(device)
        found = torch.zeros(1, dtype=torch.float32, device=device)  # the scaler's found_inf was computed already
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, inverse[device])


def scaler_inputs(optimizer: torch.optim.Optimizer) -> tuple[Tensor | None, Tensor | None]:
    """The ``(grad_scale, found_inf)`` a ``GradScaler`` set on ``optimizer`` for this ``step()`` (``None`` each
    where it set none)."""
    return getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None)


__all__ = ["scaler_inputs", "unscale_"]
