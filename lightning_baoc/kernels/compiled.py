"""The formats' step through the compiled CPU kernels (:mod:`lightning_baoc.kernels`).

A format that has a kernel names its momentum and second-moment kinds (``kernel_kinds``).
``BlockwiseAdamW.step`` sends each (param group, format) bucket of CPU parameters it serves to
:func:`compiled_step`, and every other parameter to the format's eager ``update`` (the reference).

The kernel makes the step's decisions itself, so the optimizer reads no tensor to launch it: it
tests each gradient for inf and NaN, advances the parameter's step counts (``Record.counts``) or
counts its skip, and derives the bias corrections and the rounding key from the new counts. It
works in batches of :data:`BATCH_ELEMENTS` gradient elements, so that the update reads gradients
the test just brought into the cache (the factored formats' row and column sums, which read them anyway,
are their test).

Contiguous parameters go through one call over all of them; a non-contiguous one is stepped alone
through an fp32 working copy written back at once, so the copies never exceed one parameter.
:func:`compiled_step` calls the operator itself: the step is ``BlockwiseAdamW.step`` ->
``StepDispatcher.step`` -> :func:`compiled_step` -> the kernel. bf16 and fp16 parameters (with bf16,
fp16 or fp32 gradients) go to the kernel as they are, in every format: per super-block it rebuilds
their fp32 masters from the weights and their corrections (:mod:`.correction`), steps them, and
splits them again, in the same pass as the state update; the factored formats' row and column sums
widen the 16-bit gradients a row at a time.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from lightning_baoc import kernels
from lightning_baoc.formats.adam_math import param_flat
from lightning_baoc.formats.base import StateFormat, StepHyper, factor_dims
from lightning_baoc.formats.correction import reconstruct, split_into
from lightning_baoc.formats.factored_math import EPS_SQUARE, FP32_MAX
from lightning_baoc.formats.frames import framed
from lightning_baoc.formats.kinds import M_KEYS, V_FACTORED, V_KEYS
from lightning_baoc.formats.quant import M_SCALE_MAX, V_SCALE_MAX

_NO_CORRECTION = torch.empty(0, dtype=torch.int8)

#: Gradient elements of one batch at most (4 MiB of fp32 gradients): the non-finite test (and the
#: factored formats' row and column sums) read them, the update reads them again, from the cache.
#: Measured on a 21M-parameter model (20 x 1M) on a 32 MiB L3, 1 thread, factored: 1.10x fused
#: AdamW's step in batches of 1M elements, 1.24x in batches of 4M, 1.24x in one call.
BATCH_ELEMENTS = 1 << 20


class KernelItem(NamedTuple):
    """One parameter for :func:`compiled_step`."""

    param: Tensor
    grad: Tensor
    views: dict[str, Tensor]
    counts: Tensor  # int64 [step, m_step, nonfinite], advanced by the kernel
    salt: int  # the hash of the parameter's name in its rounding keys (quant.name_salt)
    correction: Tensor | None = None  # the master-weight correction of a 16-bit parameter
    offset: int = 0  # where this rank's shard starts in the whole parameter (its rounding keys shift by it)


def kernel_serves(fmt: StateFormat, param: Tensor, views: dict[str, Tensor], policy: str) -> bool:
    """Whether the compiled kernel steps ``param`` (held in ``fmt`` as ``views``) under ``policy`` (not a
    shard laid out in the whole parameter's 8-bit groups: :func:`~.frames.framed`, the eager step's)."""
    return (
        (fmt.kernel_kinds is not None or getattr(fmt, "momentum_kind", None) is not None)
        and not framed(views)
        and param.device.type == "cpu"
        and all(t.device.type == "cpu" for t in views.values())
        and kernels.use_compiled(policy, announce=False)
    )


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _direct(item: KernelItem) -> bool:
    """Whether the kernel reads and writes the item's own tensors: contiguous, fp32, bf16 or fp16 (the
    master rebuilt from a correction in the same pass)."""
    p, g = item.param, item.grad
    return p.is_contiguous() and g.is_contiguous() and p.dtype in _KERNEL_DTYPES and g.dtype in _KERNEL_DTYPES


def compiled_step(
    fmt: StateFormat, items: list[KernelItem], hyper: StepHyper, seed: int, check_finite: bool
) -> list[int]:
    """One step of ``items`` (all served: :func:`kernel_serves`); returns the indices of those skipped because
    their gradient held inf or NaN (``check_finite``): the kernel says which, no tensor is read.

    The items the kernel reads and writes in place (:func:`_direct`) go in one call; every other one alone,
    through an fp32 working copy written back at once (the copies never exceed one parameter)."""
    momentum = hyper.rule != "adamw"  # SGD's and Lion's momentum formats
    kernel = kernels.ops().momentum_step if momentum else kernels.ops().adamw_step
    arguments = _momentum_arguments if momentum else _adamw_arguments
    direct: list[int] = []
    others: list[int] = []
    for i, it in enumerate(items):
        (direct if _direct(it) else others).append(i)
    skipped: list[int] = []
    if direct:
        # the kernel reads only sizes and data of these contiguous tensors: no flat view nor a detached alias made
        # (the operator has no autograd kernel, so the parameters themselves pass and nothing is recorded)
        chosen = [items[i] for i in direct] if others else items
        skipped += [direct[k] for k in kernel(*arguments(fmt, chosen, [it.param for it in chosen],
                                                         [it.grad for it in chosen], [it.correction for it in chosen],
                                                         hyper, seed, check_finite))]
    for i in others:
        it = items[i]
        work, write_back = _master_flat(it) if it.correction is not None else param_flat(it.param)
        grad = it.grad.reshape(-1).to(torch.float32).contiguous()
        if kernel(*arguments(fmt, [it], [work], [grad], [None], hyper, seed, check_finite)):
            skipped.append(i)
        write_back()
    return skipped


def _master_flat(item: KernelItem) -> tuple[Tensor, Callable[[], None]]:
    """The fp32 master of a corrected 16-bit parameter, flat, and the split that writes it back."""
    param, correction = item.param.detach(), item.correction
    master = reconstruct(param, correction)
    return master.view(-1), lambda: split_into(master, param, correction)


def _key_shift(offset: int) -> int:
    """A shard's offset as the kernels add it to a 32-bit rounding key (its low 32 bits)."""
    return offset & 0xFFFFFFFF


def _corrections(corrections: list[Tensor | None]) -> list[Tensor]:
    return [_NO_CORRECTION if c is None else c for c in corrections]


def _adamw_arguments(
    fmt: StateFormat, items: list[KernelItem], params: list[Tensor], grads: list[Tensor],
    corrections: list[Tensor | None], hyper: StepHyper, seed: int, check_finite: bool,
) -> tuple:
    """The arguments of ``kernels.ops().adamw_step`` (``cpu_step.cpp``) for ``items`` of ``fmt``, stepping
    ``params`` (the items' own or their working copies) with ``grads``."""
    m_kind, v_kind = fmt.kernel_kinds  # type: ignore[misc] - kernel_serves checked it
    empty: list[Tensor] = []

    def lists(table: dict[int, tuple[str | None, ...]], kind: int) -> list[list[Tensor]]:
        keys = table.get(kind, (None, None, None))
        return [[it.views[k] for it in items] if k is not None else empty for k in keys]

    m, m_scale, m_exp = lists(M_KEYS, m_kind)
    v, v_scale, v_exp = lists(V_KEYS, v_kind)
    rows: list[Tensor] = empty
    cols: list[Tensor] = empty
    if v_kind == V_FACTORED:
        for it in items:
            if factor_dims(it.param.shape) is None:  # the optimizer resolves such shapes to the fallback
                raise ValueError(f"shape {tuple(it.param.shape)} has no factored form")
        rows = [it.views["exp_avg_sq_row"] for it in items]
        cols = [it.views["exp_avg_sq_col"] for it in items]
    return (
        params, grads, m, m_scale, m_exp, v, v_scale, v_exp, rows, cols, [it.counts for it in items],
        _corrections(corrections), [it.salt for it in items], [_key_shift(it.offset) for it in items], seed, m_kind,
        v_kind, hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, hyper.decoupled_weight_decay,
        hyper.maximize, M_SCALE_MAX, V_SCALE_MAX, EPS_SQUARE, FP32_MAX, check_finite, BATCH_ELEMENTS,
    )


_RULES = {"sgd": kernels.RULE_SGD, "lion": kernels.RULE_LION}


def _momentum_arguments(
    fmt: StateFormat, items: list[KernelItem], params: list[Tensor], grads: list[Tensor],
    corrections: list[Tensor | None], hyper: StepHyper, seed: int, check_finite: bool,
) -> tuple:
    """The arguments of ``kernels.ops().momentum_step`` (SGD and Lion, ``cpu_step.cpp``) for ``items``."""
    kind = fmt.momentum_kind  # type: ignore[attr-defined]
    keys = M_KEYS.get(kind, (None, None, None))
    m, m_scale, m_exp = ([it.views[k] for it in items] if k is not None else [] for k in keys)
    return (
        params, grads, m, m_scale, m_exp, [it.counts for it in items], _corrections(corrections),
        [it.salt for it in items], [_key_shift(it.offset) for it in items], seed, _RULES[hyper.rule], kind, hyper.lr,
        hyper.beta1, hyper.beta2, hyper.weight_decay, hyper.dampening, hyper.nesterov, hyper.maximize, M_SCALE_MAX,
        check_finite, BATCH_ELEMENTS,
    )
