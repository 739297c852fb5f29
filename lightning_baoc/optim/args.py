"""Arguments of :class:`~lightning_baoc.optim.BlockwiseAdamW`: hyperparameters and torch's options.

BlockwiseAdamW is a drop-in for ``torch.optim.AdamW``: it takes every argument of torch's
constructor (torch 2.13: ``params, lr, betas, eps, weight_decay, amsgrad, *, maximize, foreach,
capturable, differentiable, fused``) and rejects what torch rejects with torch's error type. Of
torch's options:

- ``foreach`` and ``fused`` choose among torch's own kernels. They are performance hints:
  BlockwiseAdamW runs its own per-format kernels (fp32 states torch's fused AdamW kernel where it
  applies, ``torch._foreach_*`` ops in torch's order elsewhere; 8-bit and factored states chunked
  loops), so the hints change nothing.
- ``amsgrad``, ``capturable`` (CUDA-graph capture of the step) and ``differentiable`` (autograd
  through the step) change what the step does; BlockwiseAdamW does not implement them and refuses
  ``True`` with a ``ValueError`` naming the option.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from torch import Tensor

from lightning_baoc.formats import check_format_name
from lightning_baoc.formats.correction import CORRECTIONS

#: Options of torch's AdamW that select torch's kernels; accepted, documented and not used.
PERFORMANCE_HINTS = ("foreach", "fused")
#: Options of torch's AdamW whose semantics BlockwiseAdamW does not implement (only False works).
UNSUPPORTED_OPTIONS = ("amsgrad", "capturable", "differentiable")


def to_float(value: Any) -> float:
    """A float from a Python number or a one-element tensor."""
    return float(value.item()) if isinstance(value, Tensor) else float(value)


def check_torch_options(
    lr: Any, betas: Any, foreach: bool | None, fused: bool | None, capturable: bool, differentiable: bool
) -> None:
    """Raise what ``torch.optim.AdamW(...)`` raises for these options, with torch's error type.

    torch 2.13 (``torch/optim/adam.py``) refuses a Tensor ``lr`` or Tensor ``betas`` with
    ``foreach=True`` and ``capturable=False``, ``betas`` mixing a Tensor and a number
    (``ValueError``), and ``fused=True`` together with ``foreach=True`` or ``differentiable=True``
    (``RuntimeError``). BlockwiseAdamW could run some of these, but a configuration that fails with
    torch must not start to work by swapping the optimizer and fail again when swapped back.
    """
    if isinstance(lr, Tensor) and foreach and not capturable:
        raise ValueError(
            f"Invalid lr: a Tensor lr ({lr!r}) with foreach=True and capturable=False is refused by "
            f"torch.optim.AdamW, and so here; pass a float lr, or leave foreach=None (a hint "
            f"BlockwiseAdamW does not need)"
        )
    if isinstance(betas, (tuple, list)) and len(betas) == 2:
        kinds = [isinstance(b, Tensor) for b in betas]
        if kinds[0] != kinds[1]:
            raise ValueError(
                f"Invalid betas: {betas!r}; betas must be either both floats or both Tensors "
                f"(as for torch.optim.AdamW)"
            )
        if kinds[0] and foreach and not capturable:
            raise ValueError(
                "Invalid betas: Tensor betas with foreach=True and capturable=False are refused "
                "by torch.optim.AdamW, and so here (betas[0] as a Tensor is not supported); pass "
                "floats, or leave foreach=None"
            )
    if fused and foreach:
        raise RuntimeError(
            "Invalid fused=True with foreach=True: `fused` and `foreach` cannot be `True` together "
            "(as for torch.optim.AdamW); both are hints BlockwiseAdamW does not need: drop them"
        )
    if fused and differentiable:
        raise RuntimeError(
            "Invalid fused=True with differentiable=True: `fused` does not support `differentiable` "
            "(as for torch.optim.AdamW)"
        )


def check_lr(group: Mapping[str, Any], where: str) -> None:
    """A group's ``lr``: a float or a one-element tensor, finite and >= 0 (every blockwise optimizer)."""
    lr = group.get("lr")
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(
                f"Invalid {where}lr: Tensor lr must be 1-element, got shape {tuple(lr.shape)}"
            )
        lr_value = float(lr.item())
    elif isinstance(lr, (int, float)) and not isinstance(lr, bool):
        lr_value = float(lr)
    else:
        raise TypeError(f"Invalid {where}lr: {lr!r}; expected a float >= 0")
    if not 0.0 <= lr_value < math.inf:
        raise ValueError(f"Invalid {where}lr: {lr_value!r}; expected a float >= 0 (and finite)")


def check_correction(group: Mapping[str, Any], where: str) -> None:
    """A group's ``weight_correction``: one of :data:`~lightning_baoc.formats.correction.CORRECTIONS`."""
    correction = group.get("weight_correction", "none")
    if correction not in CORRECTIONS:
        raise ValueError(f"Invalid {where}weight_correction: {correction!r}; expected one of {', '.join(CORRECTIONS)}")


def validate_hyper(group: Mapping[str, Any], where: str) -> None:
    """Validate a param group's hyperparameters; errors name ``where + key``, the value and the rule.

    Raises:
        ValueError: a value out of range, or an option set that BlockwiseAdamW does not implement.
        TypeError: a value of the wrong type.
    """
    check_lr(group, where)
    betas = group.get("betas")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid {where}betas: {betas!r}; expected two floats in [0, 1)")
    for i, b in enumerate(betas):
        if isinstance(b, Tensor) and b.numel() != 1:
            raise ValueError(f"Invalid {where}betas[{i}]: Tensor betas[{i}] must be 1-element, got shape {tuple(b.shape)}")
        if not isinstance(b, (Tensor, int, float)) or isinstance(b, bool):
            raise TypeError(f"Invalid {where}betas[{i}]: {b!r}; expected a float in [0, 1)")
        value = to_float(b)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"Invalid {where}betas[{i}]: {value!r}; expected a float in [0, 1)")
    for key in ("eps", "weight_decay"):
        value = group.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < math.inf:
            raise ValueError(f"Invalid {where}{key}: {value!r}; expected a float >= 0 (and finite)")
    check_format_name(group.get("state_format"), f"{where}state_format")
    check_correction(group, where)
    for key in UNSUPPORTED_OPTIONS:
        if group.get(key):
            raise ValueError(
                f"Invalid {where}{key}={group[key]!r}: BlockwiseAdamW does not implement {key}; "
                f"use {key}=False"
            )
