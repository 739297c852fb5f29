"""The launch table of a fixed list of tensors, for the Triton step's kernel (:mod:`.triton_step`): what
stays from step to step written once, what changes filled per step with numpy over all rows.

The table's layout (its columns, :data:`triton_step._COLUMNS`, the launch kinds) is the kernel's; the
device's planned step (:mod:`lightning_baoc.optim.device_plan`) keeps one table per format and device.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_baoc.formats.kinds import M_KEYS, V_FACTORED, V_KEYS
from lightning_baoc.kernels import triton_step as ts
from lightning_baoc.kernels.triton_common import _common, on_device


class Table:
    """The launches of a fixed list of tensors of one format, planned once and launched at every step.

    What stays from step to step is written once: each tensor's addresses (parameter, correction,
    states), size and launch kind. Each step fills the columns that change (the gradients' addresses,
    the skip flags', the rounding keys, the step sizes) with numpy over all rows at once, so the host's
    work per tensor is the few Python reads its caller makes. Items whose skip the device decides. A
    factored format's rows point their factors into the step's flat buffers (:mod:`.triton_factored`:
    ``factors`` of :meth:`launch`, or written once by a captured step).
    """

    def __init__(self, kinds: tuple[int, int], params: list[Tensor], grad_dtypes: list[torch.dtype],
                 views: list[dict[str, Tensor]], corrections: list[Tensor | None]) -> None:
        self.kinds = kinds
        keys = M_KEYS.get(kinds[0], (None, None, None)) + V_KEYS[kinds[1]]
        rows, self.kind = [], []
        for p, g_dtype, v, corr in zip(params, grad_dtypes, views, corrections):
            ptr = p.data_ptr()
            cols = v["exp_avg_sq_col"].numel() if kinds[1] == V_FACTORED else 1
            rows.append([ptr, 0, *ts._state_addresses(p, v, corr, keys), ptr, ptr, 0, p.numel(), cols, 0, 0, 0, 0])
            self.kind.append(ts._launch_kind(p, g_dtype, corr, True))
        self.rows = np.array(rows, dtype=np.int64).reshape(len(rows), len(ts._COLUMNS))
        self.blocks = (self.rows[:, ts._NUMEL_COLUMN] + ts._SUPER - 1) // ts._SUPER
        self.by_kind = {kind: np.array([i for i, k in enumerate(self.kind) if k == kind], dtype=np.int64)
                        for kind in dict.fromkeys(self.kind)}  # the rows of each launch, when all tensors step

    def launch(self, hyper: Any, limit_m: float, limit_v: float, device: torch.device, grads: list[int],
               skips: Any, keys: Any, step_bits: Any, decay: Any, select: Any = None,
               repair: Tensor | None = None, factors: list[tuple[int, int]] | None = None) -> None:
        """Step the tensors (or those of ``select``, indices into them): ``grads``, their gradients'
        addresses; ``skips``, their skip flags' addresses; ``keys``, their rounding keys (sign-extended 32 bits);
        ``step_bits``, ``[k, 2]``: the bits of their step sizes and of their ``1 / sqrt(bias_correction2)``
        (:func:`~.triton_step.step_scalars`); ``decay``: the bits of the decoupled weight decay's factor
        (:func:`~.triton_step.decay_bits`): numpy arrays (the gradients' addresses a list), one entry per selected
        tensor (``lightning_baoc.optim.device_plan.step_columns``);
        ``factors``: a factored format's row and column factors' addresses, per selected tensor."""
        rows = self.rows.copy() if select is None else self.rows[select]  # (indexing copies)
        rows[:, 1] = grads
        rows[:, ts._SKIP_COLUMN] = skips
        rows[:, ts._KEY_COLUMN] = keys
        rows[:, ts._KEY_COLUMN + 1 : ts._KEY_COLUMN + 3] = step_bits
        rows[:, ts._KEY_COLUMN + 3] = decay
        if factors is not None:
            rows[:, ts._FACTOR_COLUMN : ts._FACTOR_COLUMN + 2] = factors
        blocks = self.blocks if select is None else self.blocks[select]
        by_kind = self.by_kind
        if select is not None:
            kinds = [self.kind[i] for i in select]
            by_kind = {kind: np.array([i for i, k in enumerate(kinds) if k == kind], dtype=np.int64)
                       for kind in dict.fromkeys(kinds)}
        common = _common(self.kinds, hyper, limit_m, limit_v)
        for kind, of_kind in by_kind.items():
            whole = len(of_kind) == len(rows)
            part, sizes = (rows, blocks) if whole else (rows[of_kind], blocks[of_kind])
            firsts = np.cumsum(sizes)
            flat = np.concatenate([part.reshape(-1), [0], firsts[:-1]])  # the rows, then each first super-block
            table = on_device(torch.from_numpy(flat), device)
            count = len(of_kind)
            ts._adamw_tensors[(int(firsts[-1]),)](table, count, table if repair is None else repair,
                                                  **ts.launch_options(kind, count, repair), **common)


__all__ = ["Table"]
