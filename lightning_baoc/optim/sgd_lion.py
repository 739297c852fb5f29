"""BlockwiseSGD and BlockwiseLion: SGD (momentum, Nesterov) and Lion with a momentum format per parameter.

Both keep one state per parameter, the momentum buffer, in one of the formats of
:data:`~lightning_baoc.formats.MOMENTUM_FORMATS` (``fp32``, ``bf16``, ``int8``, ``none``). They
share :class:`~lightning_baoc.optim.optimizer.BlockwiseOptimizer`'s machinery with
:class:`~lightning_baoc.optim.BlockwiseAdamW`: per-format pools with exact accounting, live
conversion between formats (:meth:`set_formats`), validated checkpoints keyed by parameter name,
copies and pickles, bf16/fp16 weights with a master-weight correction, gradient release and the
non-finite skip. On the CPU they step through the compiled ``momentum_step`` kernel, bit-equal to the
eager reference of :mod:`lightning_baoc.formats.momentum`, which runs elsewhere.

- :class:`BlockwiseSGD` is ``torch.optim.SGD`` with every parameter in ``fp32`` (the same
  operations in the same order; tested within 1e-6 over 200 steps with momentum, dampening,
  Nesterov, weight decay and maximize).
- :class:`BlockwiseLion` is Lion (Chen et al., 2023, "Symbolic Discovery of Optimization
  Algorithms"), tested against a reference written from the paper's pseudo-code.

A state dict records the update rule: a dict of one does not load into another (the error says
so). ``load_state_dict`` also takes the dicts of ``torch.optim.SGD`` (``momentum_buffer``) and of
Lion implementations that name the buffer ``exp_avg``; ``to_torch_state_dict()`` gives those. The
state dict ends with a param group of no parameters that makes ``torch.optim.SGD`` or a plain Lion
refuse it (:data:`~lightning_baoc.optim.checkpoint.layout.REFUSAL_KEY`), where it would drop the momentum.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import torch
from torch import Tensor, nn

from lightning_baoc.formats import DEFAULT_MIN_8BIT_NUMEL, MOMENTUM_FORMATS, StepHyper, check_format_name
from lightning_baoc.formats.base import DEFAULT_CHUNK
from lightning_baoc.optim.args import check_correction, check_lr, to_float
from lightning_baoc.optim.optimizer import PUBLIC_MODULE, BlockwiseOptimizer
from lightning_baoc.optim.placement import Placements


def _check_number(group: Mapping[str, Any], key: str, where: str, upper: float = math.inf) -> float:
    value = group.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < upper:
        bound = "in [0, 1)" if upper == 1.0 else ">= 0 (and finite)"
        raise ValueError(f"Invalid {where}{key}: {value!r}; expected a float {bound}")
    return float(value)


def _check_common(group: Mapping[str, Any], where: str) -> None:
    check_lr(group, where)
    _check_number(group, "weight_decay", where)
    check_format_name(group.get("state_format"), f"{where}state_format", MOMENTUM_FORMATS)
    check_correction(group, where)
    if not isinstance(group.get("maximize", False), bool):
        raise TypeError(f"Invalid {where}maximize: {group.get('maximize')!r}; expected a bool")


class BlockwiseSGD(BlockwiseOptimizer):
    """``torch.optim.SGD`` (momentum, dampening, Nesterov, L2 weight decay) with a momentum format
    per parameter.

    Args:
        params: parameters, ``(name, parameter)`` pairs or param groups; a group may carry
            ``state_format`` (the default of its parameters).
        lr: learning rate (default: 1e-3, torch's).
        momentum: momentum factor (default: 0).
        dampening: dampening of the momentum (default: 0).
        weight_decay: L2 penalty added to the gradient, as torch's SGD (default: 0).
        nesterov: Nesterov momentum; needs a momentum and zero dampening (default: False).
        maximize: maximize the objective (default: False).
        foreach: accepted for drop-in compatibility with ``torch.optim.SGD``; changes nothing.
        differentiable: autograd through the step; not implemented: only ``False``.
        fused: accepted like ``foreach``.
        state_format: default momentum format of every group: ``"fp32"``, ``"bf16"``, ``"int8"`` or
            ``"none"`` (default: ``"fp32"``). A group with ``momentum=0`` holds no buffer whatever its
            format (``none``), as torch's SGD.

    The keyword arguments ``weight_correction``, ``min_8bit_numel``, ``skip_nonfinite``, ``seed``,
    ``chunk_size``, ``param_names``, ``kernels``, ``atomic_step`` and ``placements`` are
    :class:`~lightning_baoc.optim.BlockwiseAdamW`'s.

    Example:
        >>> model = nn.Linear(64, 64)
        >>> opt = BlockwiseSGD(model.named_parameters(), lr=0.1, momentum=0.9, state_format="int8")
        >>> model(torch.randn(8, 64)).sum().backward(); opt.step()
        >>> opt.formats()  # the 64-element bias stays out of 8 bits
        {'weight': 'int8', 'bias': 'fp32'}
    """

    format_registry = MOMENTUM_FORMATS
    rule = "sgd"
    label = "BlockwiseSGD"
    saved_group_keys = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "state_format")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        state_format: str | None = None,
        weight_correction: str = "none",
        min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL,
        skip_nonfinite: bool = True,
        seed: int = 0,
        chunk_size: int = DEFAULT_CHUNK,
        param_names: nn.Module | Iterable[tuple[str, Tensor]] | None = None,
        kernels: str | None = None,
        atomic_step: bool = False,
        placements: Placements | None = None,
    ) -> None:
        if differentiable:
            raise ValueError("Invalid differentiable=True: BlockwiseSGD does not implement differentiable; use differentiable=False")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
            state_format="fp32" if state_format is None else state_format,
            weight_correction=weight_correction,
            differentiable=False,
        )
        super().__init__(
            params,
            defaults,
            min_8bit_numel=min_8bit_numel,
            skip_nonfinite=skip_nonfinite,
            seed=seed,
            chunk_size=chunk_size,
            param_names=param_names,
            kernels=kernels,
            atomic_step=atomic_step,
            placements=placements,
        )

    def _validate_group(self, group: Mapping[str, Any], where: str) -> None:
        _check_common(group, where)
        momentum = _check_number(group, "momentum", where)
        dampening = _check_number(group, "dampening", where)
        if not isinstance(group.get("nesterov", False), bool):
            raise TypeError(f"Invalid {where}nesterov: {group.get('nesterov')!r}; expected a bool")
        if group.get("nesterov") and (momentum <= 0 or dampening != 0):
            raise ValueError(
                f"Invalid {where}nesterov=True with momentum={momentum} and dampening={dampening}: "
                f"Nesterov momentum requires a momentum and zero dampening (as for torch.optim.SGD)"
            )

    def holds_state(self, param: Tensor) -> bool:
        """Whether ``param``'s group has momentum: without it torch's SGD keeps no buffer, and neither
        does this one, whatever format is asked."""
        return float(self.param_groups[self._records[param].group]["momentum"]) != 0.0

    def target_format(self, param: Tensor) -> str:
        """The format ``param``'s buffer is held in: ``none`` in a group without momentum (torch's SGD
        keeps no buffer there), whatever format is asked; else as :class:`BlockwiseAdamW`'s."""
        if not self.holds_state(param):
            return "none"
        return super().target_format(param)

    def _hyper(self, group: Mapping[str, Any], noise_key: int = 0) -> StepHyper:
        return StepHyper(
            lr=to_float(group["lr"]),
            beta1=float(group["momentum"]),
            beta2=0.0,
            eps=0.0,
            weight_decay=float(group["weight_decay"]),
            decoupled_weight_decay=False,
            maximize=bool(group.get("maximize", False)),
            chunk=self.chunk_size,
            noise_key=noise_key,
            kernels=self.kernels,
            rule="sgd",
            dampening=float(group["dampening"]),
            nesterov=bool(group["nesterov"]),
        )

    @classmethod
    def from_optimizer(
        cls,
        optimizer: torch.optim.Optimizer,
        named_parameters: nn.Module | Iterable[tuple[str, Tensor]] | None = None,
        state_format: str | None = None,
        **kwargs: Any,
    ) -> "BlockwiseSGD":
        """A BlockwiseSGD over a ``torch.optim.SGD``'s param groups and hyperparameters, momentum
        buffers inherited (encoded into ``state_format``, default each group's own or ``"fp32"``)."""
        if isinstance(optimizer, BlockwiseSGD):
            return optimizer
        if not isinstance(optimizer, torch.optim.SGD):
            raise TypeError(f"BlockwiseSGD.from_optimizer takes a torch.optim.SGD, got {type(optimizer).__name__}")
        groups = []
        for group in optimizer.param_groups:
            new = {k: v for k, v in group.items() if k not in ("foreach", "fused", "differentiable")}
            if state_format is not None:
                new["state_format"] = state_format
            elif "state_format" not in new:
                new["state_format"] = "fp32" if group["momentum"] > 0 else "none"
            new["params"] = list(group["params"])
            groups.append(new)
        new_opt = cls(groups, param_names=named_parameters, **kwargs)
        new_opt._inherit_state(optimizer)
        return new_opt


class BlockwiseLion(BlockwiseOptimizer):
    """Lion (Chen et al., 2023) with a momentum format per parameter.

    The update is ``p <- p * (1 - lr * weight_decay) - lr * sign(beta1 * m + (1 - beta1) * g)``, then
    ``m <- beta2 * m + (1 - beta2) * g``. Lion's updates have the size of ``lr`` in every element:
    its learning rate is usually 3-10x smaller than AdamW's and its weight decay 3-10x larger.

    Args:
        params: parameters, ``(name, parameter)`` pairs or param groups.
        lr: learning rate (default: 1e-4).
        betas: the interpolation of the update and the decay of the momentum (default: (0.9, 0.99)).
        weight_decay: decoupled weight decay (default: 0).
        maximize: maximize the objective (default: False).
        state_format: default momentum format: ``"fp32"``, ``"bf16"``, ``"int8"`` or ``"none"``
            (``none``: the sign of the gradient, signSGD) (default: ``"fp32"``).

    The keyword arguments ``weight_correction``, ``min_8bit_numel``, ``skip_nonfinite``, ``seed``,
    ``chunk_size``, ``param_names``, ``kernels``, ``atomic_step`` and ``placements`` are
    :class:`~lightning_baoc.optim.BlockwiseAdamW`'s.

    Example:
        >>> model = nn.Linear(64, 64)
        >>> opt = BlockwiseLion(model.named_parameters(), lr=1e-4, weight_decay=0.1)
        >>> model(torch.randn(8, 64)).sum().backward(); opt.step()
        >>> opt.state_bytes()  # one fp32 buffer: 4 bytes per element
        16640
    """

    format_registry = MOMENTUM_FORMATS
    rule = "lion"
    label = "BlockwiseLion"
    saved_group_keys = ("lr", "betas", "weight_decay", "state_format")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        state_format: str = "fp32",
        weight_correction: str = "none",
        min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL,
        skip_nonfinite: bool = True,
        seed: int = 0,
        chunk_size: int = DEFAULT_CHUNK,
        param_names: nn.Module | Iterable[tuple[str, Tensor]] | None = None,
        kernels: str | None = None,
        atomic_step: bool = False,
        placements: Placements | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            weight_decay=weight_decay,
            maximize=maximize,
            state_format=state_format,
            weight_correction=weight_correction,
        )
        super().__init__(
            params,
            defaults,
            min_8bit_numel=min_8bit_numel,
            skip_nonfinite=skip_nonfinite,
            seed=seed,
            chunk_size=chunk_size,
            param_names=param_names,
            kernels=kernels,
            atomic_step=atomic_step,
            placements=placements,
        )

    def _validate_group(self, group: Mapping[str, Any], where: str) -> None:
        _check_common(group, where)
        betas = group.get("betas")
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"Invalid {where}betas: {betas!r}; expected two floats in [0, 1)")
        for i, b in enumerate(betas):
            if not isinstance(b, (int, float)) or isinstance(b, bool) or not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid {where}betas[{i}]: {b!r}; expected a float in [0, 1)")

    def _hyper(self, group: Mapping[str, Any], noise_key: int = 0) -> StepHyper:
        beta1, beta2 = group["betas"]
        return StepHyper(
            lr=to_float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=0.0,
            weight_decay=float(group["weight_decay"]),
            decoupled_weight_decay=True,
            maximize=bool(group.get("maximize", False)),
            chunk=self.chunk_size,
            noise_key=noise_key,
            kernels=self.kernels,
            rule="lion",
        )


BlockwiseSGD.__module__ = PUBLIC_MODULE
BlockwiseLion.__module__ = PUBLIC_MODULE
