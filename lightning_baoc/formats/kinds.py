"""The kinds of a format's moments, as the compiled steps number them, and the state keys of each kind.

A format names the kinds of its momentum and second moment (``StateFormat.kernel_kinds``,
``MomentumFormat.momentum_kind``); the kernels (:mod:`lightning_baoc.kernels`: ``cpu_step.cpp``'s
``MKind`` and ``VKind``, the Triton step) take the same numbers and read each kind's tensors under the
keys of :data:`M_KEYS` and :data:`V_KEYS`. The formats own both tables, as they own the keys; the
kernels import them from here, and the formats import nothing of the kernels.

Example:
    >>> from lightning_baoc.formats.kinds import M_INT8, M_KEYS
    >>> M_KEYS[M_INT8]
    ('exp_avg', 'exp_avg_scale', 'exp_avg_exp')
"""

from __future__ import annotations

# Momentum and second-moment kinds, as the kernels number them (cpu_step.cpp: MKind, VKind).
M_NONE, M_FP32, M_BF16, M_INT8 = 0, 1, 2, 3
V_FP32, V_BF16, V_UINT8, V_FACTORED = 0, 1, 2, 3

#: Each momentum kind's tensors: the values, their group scales and super-block exponents (``None``:
#: the kind holds no such tensor; ``M_NONE`` holds none at all and is not listed).
M_KEYS: dict[int, tuple[str | None, ...]] = {
    M_FP32: ("exp_avg", None, None), M_BF16: ("exp_avg", None, None),
    M_INT8: ("exp_avg", "exp_avg_scale", "exp_avg_exp"),
}
#: Each second-moment kind's tensors, as :data:`M_KEYS` (the factored kind's row and column vectors are
#: read apart: ``exp_avg_sq_row``, ``exp_avg_sq_col``).
V_KEYS: dict[int, tuple[str | None, ...]] = {
    V_FP32: ("exp_avg_sq", None, None), V_BF16: ("exp_avg_sq", None, None),
    V_UINT8: ("exp_avg_sq", "exp_avg_sq_scale", "exp_avg_sq_exp"), V_FACTORED: (None, None, None),
}

__all__ = ["M_BF16", "M_FP32", "M_INT8", "M_KEYS", "M_NONE", "V_BF16", "V_FACTORED", "V_FP32", "V_KEYS", "V_UINT8"]
