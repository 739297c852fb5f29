"""The optimizer swap: the user's AdamW becomes a :class:`~lightning_baoc.BlockwiseAdamW` (an SGD a
:class:`~lightning_baoc.BlockwiseSGD`) over the same param groups, and LR schedulers follow it.

Torch plumbing, no training framework: the Lightning callback and the Fabric strategy call it at
install (through :meth:`~lightning_baoc.control.controller.BAOCController.install`), and so can any loop.

The optimizer installed keeps the name of the torch class it replaces: ``LearningRateMonitor`` names its
metrics ``"lr-" + type(optimizer).__name__`` (``lr-AdamW/pg1``), so the swap installs :class:`AdamW`,
:class:`Adam` or :class:`SGD`, subclasses of the blockwise optimizers written out here, one per torch class
BAOC takes over; a subclass of one of these takes the name of the torch class it derives from.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from lightning_baoc.formats import DEFAULT_MIN_8BIT_NUMEL
from lightning_baoc.optim import BlockwiseAdamW, BlockwiseOptimizer, BlockwiseSGD

#: Optimizers BAOC can take over (named in the error for any other).
SUPPORTED_OPTIMIZERS = (
    "torch.optim.AdamW",
    "torch.optim.Adam (amsgrad=False)",
    "torch.optim.SGD",
    "lightning_baoc.BlockwiseAdamW",
    "lightning_baoc.BlockwiseSGD",
    "lightning_baoc.BlockwiseLion",
)


class AdamW(BlockwiseAdamW):
    """The :class:`~lightning_baoc.BlockwiseAdamW` installed in place of a ``torch.optim.AdamW``, named like it
    (``LearningRateMonitor``'s metrics keep their names); nothing else differs."""


class Adam(BlockwiseAdamW):
    """The :class:`~lightning_baoc.BlockwiseAdamW` installed in place of a ``torch.optim.Adam`` (taken over with its
    L2 penalty, ``decoupled_weight_decay=False``), named like it."""


class SGD(BlockwiseSGD):
    """The :class:`~lightning_baoc.BlockwiseSGD` installed in place of a ``torch.optim.SGD``, named like it."""


#: The class installed in place of each torch optimizer BAOC takes over, named like it (the most derived first:
#: torch's AdamW is an Adam).
_NAMED_LIKE: tuple[tuple[type[torch.optim.Optimizer], type[BlockwiseOptimizer]], ...] = (
    (torch.optim.AdamW, AdamW),
    (torch.optim.Adam, Adam),
    (torch.optim.SGD, SGD),
)


def _named_like(optimizer: torch.optim.Optimizer) -> type[BlockwiseOptimizer]:
    """The class installed in place of ``optimizer``: named like the torch class it is or derives from."""
    return next(named for torch_class, named in _NAMED_LIKE if isinstance(optimizer, torch_class))


def convert_optimizer(
    optimizer: torch.optim.Optimizer, module: nn.Module, min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL, seed: int = 0
) -> BlockwiseOptimizer:
    """The user's optimizer as a fp32 blockwise optimizer (same groups, hyperparameters, state):
    ``torch.optim.AdamW`` / ``Adam`` as a :class:`BlockwiseAdamW`, ``torch.optim.SGD`` as a
    :class:`~lightning_baoc.BlockwiseSGD` (momentum buffers in ``fp32``, ``none`` in groups without
    momentum).

    A blockwise optimizer (BlockwiseAdamW, BlockwiseSGD, BlockwiseLion) is returned as is. The new
    optimizer's class carries the name of the torch class it replaces (``type(new).__name__ == "AdamW"``;
    a user's subclass of ``torch.optim.AdamW`` gets ``"AdamW"`` too: :class:`AdamW`) so that
    LR-monitor metric names do not change.

    Raises:
        TypeError: any optimizer other than those of :data:`SUPPORTED_OPTIMIZERS`.

    Example:
        >>> model = nn.Linear(4, 2)
        >>> opt = convert_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
        >>> isinstance(opt, BlockwiseAdamW), type(opt).__name__, opt.param_groups[0]["lr"]
        (True, 'AdamW', 0.001)
    """
    if isinstance(optimizer, BlockwiseOptimizer):
        return optimizer
    if isinstance(optimizer, torch.optim.SGD):
        if all(float(g["momentum"]) == 0.0 for g in optimizer.param_groups):
            raise ValueError(
                f"BAOC cannot take over {type(optimizer).__name__} without momentum: plain SGD holds no optimizer "
                f"state, so there is nothing to allocate; set momentum (e.g. 0.9), or remove the BAOC callback"
            )
        return _replace(optimizer, module, BlockwiseSGD, "torch's SGD update", min_8bit_numel, seed)
    if not isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        raise TypeError(
            f"BAOC cannot take over {type(optimizer).__name__} ({type(optimizer).__module__}): it converts "
            f"the states of AdamW, Adam, SGD and Lion; supported: {list(SUPPORTED_OPTIMIZERS)}. Return one of "
            f"them from configure_optimizers, or remove the BAOC callback."
        )
    if any(group.get("amsgrad") for group in optimizer.param_groups):
        raise ValueError(
            f"BAOC cannot take over {type(optimizer).__name__}(amsgrad=True): BlockwiseAdamW implements "
            f"amsgrad=False only; supported: {list(SUPPORTED_OPTIMIZERS)}"
        )
    return _replace(optimizer, module, BlockwiseAdamW, "torch's Adam/AdamW update", min_8bit_numel, seed)


def _replace(
    optimizer: torch.optim.Optimizer, module: nn.Module, base: type[BlockwiseOptimizer], update: str,
    min_8bit_numel: int, seed: int,
) -> BlockwiseOptimizer:
    """The checked ``optimizer`` as a ``base`` (BlockwiseAdamW, BlockwiseSGD), its class named like the torch class
    it replaces (:func:`_named_like`), its state inherited (see
    :func:`convert_optimizer`); an overridden ``step`` is said aloud."""
    if _overrides_step(optimizer):
        warnings.warn(
            f"{type(optimizer).__name__} overrides step(); BAOC replaces it by {base.__name__}, which "
            f"implements {update}, so that override no longer runs",
            UserWarning,
            stacklevel=3,
        )
    cls = _named_like(optimizer)  # a subclass of ``base``
    new = cls.from_optimizer(optimizer, module, min_8bit_numel=min_8bit_numel, seed=seed)
    if getattr(optimizer, "_opt_called", False):
        new._opt_called = True  # type: ignore[attr-defined]
    return new


def _overrides_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a subclass of torch's AdamW/Adam/SGD defines its own ``step`` (torch's profiling hook,
    which wraps ``step`` on the class, is seen through)."""
    base = next(c for c in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD) if isinstance(optimizer, c))
    reference = getattr(base.step, "__wrapped__", base.step)
    for klass in type(optimizer).__mro__:
        if klass is base:
            return False
        fn = vars(klass).get("step")
        if fn is not None and getattr(fn, "__wrapped__", fn) is not reference:
            return True
    return False


def _track_step_called(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` the way torch's LR schedulers do when they are built on it.

    A scheduler rebound to another optimizer would otherwise warn on its first ``step()`` that
    "optimizer.step() has been overridden after learning rate scheduler initialization".
    """
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    ref = weakref.ref(optimizer)
    func = type(optimizer).step

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return func(opt, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


def rebind_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Point an LR scheduler (and the schedulers it chains) at ``optimizer``.

    Param groups are one-to-one with the old optimizer's, so ``base_lrs``, ``LambdaLR``'s lambdas
    and ``ReduceLROnPlateau``'s ``min_lrs`` stay valid; the scheduler's own state is untouched.

    Example:
        >>> model = nn.Linear(4, 2)
        >>> old = torch.optim.AdamW(model.parameters(), lr=1.0)
        >>> sched = torch.optim.lr_scheduler.LambdaLR(old, lambda step: 0.5)
        >>> new = convert_optimizer(old, model)
        >>> rebind_scheduler(sched, new)
        >>> sched.optimizer is new, new.param_groups[0]["lr"]
        (True, 0.5)
    """
    for sub in getattr(scheduler, "_schedulers", None) or ():  # SequentialLR, ChainedScheduler
        rebind_scheduler(sub, optimizer)
    if hasattr(scheduler, "optimizer"):
        scheduler.optimizer = optimizer
        _track_step_called(optimizer)


__all__ = ["SUPPORTED_OPTIMIZERS", "convert_optimizer", "rebind_scheduler"]
