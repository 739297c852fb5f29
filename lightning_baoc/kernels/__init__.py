"""Compiled kernels of the optimizer step, and which step runs: the policy.

The eager step of every format (:mod:`lightning_baoc.formats`) is a sequence of ATen operations:
about ten passes over memory per step and a few hundred operator calls per 128K elements. The
kernels in ``cpu_step.cpp`` do each format's whole step in one pass per 1024-element super-block
(decode, AdamW in fp32, encode), over all the tensors of a call at once, threaded with
``at::parallel_for``. They are built the first time an optimizer needs them and loaded from torch's
extension cache afterwards: :mod:`lightning_baoc.kernels.build` builds, caches, locks and announces
them (one cache directory per source version and build command, so environments and processes whose
commands differ never rebuild each other's library). The Triton kernels of the CUDA step are in
:mod:`lightning_baoc.kernels.triton_step`. The kernels build on the formats: a format names
the kinds of its moments (``kernel_kinds``) and the keys of its states, both in
:mod:`lightning_baoc.formats.kinds`, and the kernels read them there.

Which path runs is chosen per optimizer (``BlockwiseAdamW(kernels=...)``, default from the
environment variable ``LIGHTNING_BAOC_KERNELS``, else ``"auto"``):

- ``"auto"``: the compiled kernels where they build, else the eager step, with one warning that
  says why (no C++ compiler, no ``ninja``, a build error, a library that does not load);
- ``"compiled"``: the compiled kernels, or an error that says why they are not available;
- ``"eager"``: the eager step (the reference), never building anything.

Both paths give the same results to fp32 rounding (``tests/kernels/test_cpu_step.py``); the kernels
serve parameters on the CPU (CUDA parameters take the eager step or the Triton step).

Example:
    >>> from lightning_baoc import kernels
    >>> kernels.resolve_policy("eager")
    'eager'
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch

from lightning_baoc.formats.kinds import M_BF16, M_FP32, M_INT8, M_NONE, V_BF16, V_FACTORED, V_FP32, V_UINT8
from lightning_baoc.kernels import build
from lightning_baoc.kernels.build import KernelStatus, compile_flags

log = logging.getLogger(__name__)

#: The environment variable that sets the default kernel policy.
KERNELS_ENV = "LIGHTNING_BAOC_KERNELS"
#: The policies ``BlockwiseAdamW(kernels=...)`` accepts.
POLICIES = ("auto", "compiled", "eager")

#: The update rules of ``momentum_step`` (SGD and Lion over one momentum buffer).
RULE_SGD, RULE_LION = 1, 2


#: This process's status of the CPU kernels (:func:`cpu_kernels`): built or loaded once per process.
_STATUS: KernelStatus | None = None
#: The paths (``"compiled"``, ``"eager"``, the Triton ones) this process has said it runs: each is said once.
_ANNOUNCED: set[str] = set()


def resolve_policy(kernels: str | None) -> str:
    """The kernel policy for ``kernels`` (``None``: the environment variable, else ``"auto"``)."""
    value = kernels if kernels is not None else os.environ.get(KERNELS_ENV, "auto")
    if value not in POLICIES:
        source = "kernels" if kernels is not None else KERNELS_ENV
        raise ValueError(f"Invalid {source}: {value!r}; expected one of {', '.join(POLICIES)}")
    return value


def cpu_kernels() -> KernelStatus:
    """Build (first use of this source and build command) or load the CPU kernels, once per process.

    Example:
        >>> from lightning_baoc import kernels
        >>> kernels.cpu_kernels().available  # doctest: +SKIP
        True
    """
    global _STATUS
    if _STATUS is None:
        _STATUS = build.load_kernels()
    return _STATUS


def use_compiled(policy: str, announce: bool = True) -> bool:
    """Whether the step runs the compiled kernels under ``policy``; says once which path runs.

    Raises:
        RuntimeError: under ``"compiled"`` when the kernels are not available (with the reason).
    """
    if policy == "eager":
        return False
    status = cpu_kernels()
    if status.said:  # the build said which step runs, at warning level (build._build)
        _ANNOUNCED.add("compiled")
    return _choose(policy, status.available, status.detail, "compiled" if status.available else "eager", announce,
                   "compiled CPU step kernels", status.fix,
                   "same results, several times slower on the CPU", "compiled CPU kernels")


def _choose(
    policy: str, available: bool, detail: str, key: str, announce: bool, kernels: str, install: str, eager_is: str,
    refused: str,
) -> bool:
    """Whether ``kernels`` run under ``policy`` (not ``"eager"``): said once in the log where they do,
    refused under ``"compiled"`` (naming ``refused``) and warned once under ``"auto"`` where they do
    not (``detail``: why)."""
    if available:
        if announce and key not in _ANNOUNCED:  # a build said it at warning level; a cache load is quick
            _ANNOUNCED.add(key)
            log.info("lightning_baoc: %s in use (%s)", kernels, detail)
        return True
    if policy == "compiled":
        raise RuntimeError(
            f"BlockwiseAdamW(kernels='compiled'): the {refused} are not available: {detail}. {install}, or "
            f"use kernels='auto' or 'eager'."
        )
    if announce and key not in _ANNOUNCED:
        _ANNOUNCED.add(key)
        warnings.warn(
            f"lightning_baoc: the {kernels} are not available ({detail}); the eager step runs instead "
            f"({eager_is}). {install}, or pass kernels='eager' (or set {KERNELS_ENV}=eager) to silence this "
            f"warning.",
            RuntimeWarning,
            stacklevel=4,
        )
    return False


def step_path(device: torch.device, policy: str | None = None) -> str:
    """``"compiled"`` or ``"eager"``: the step the formats with kernels take on ``device`` under
    ``policy`` (default: the environment's), without announcing it."""
    if device.type != "cpu":
        return "eager"
    resolved = resolve_policy(policy)
    return "compiled" if resolved != "eager" and cpu_kernels().available else "eager"


#: The (momentum, second moment) kinds the Triton step serves (:mod:`.triton_step`): every format with
#: a kernel but the fp32 pair, which torch's fused kernel serves (the Triton step takes it for 16-bit
#: parameters only).
TRITON_SERVED = frozenset({(M_NONE, V_FP32), (M_NONE, V_UINT8), (M_BF16, V_FP32), (M_BF16, V_BF16), (M_INT8, V_UINT8),
                           (M_NONE, V_FACTORED), (M_INT8, V_FACTORED)})
#: The device types whose parameters take the Triton step (:mod:`.triton_step`); the tests add
#: ``"cpu"`` to run it through Triton's interpreter.
TRITON_DEVICES = {"cuda"}


def use_triton(policy: str, device: torch.device) -> bool:
    """Whether the step of the formats with kernels on ``device`` runs the Triton kernels under
    ``policy`` (:mod:`.triton_step`); says once which path runs.

    Raises:
        RuntimeError: under ``"compiled"`` when Triton does not import (with the reason).
    """
    if policy == "eager" or device.type not in TRITON_DEVICES:
        return False
    from lightning_baoc.kernels import triton_common  # lazy: triton (optional) takes 0.3-0.45 s to import (python -X importtime)

    available, detail = triton_common.triton_status()
    return _choose(policy, available, detail, f"triton-{available}", True, "Triton step kernels",
                   "Install triton (it ships with torch's CUDA builds on Linux)",
                   f"on {device.type}: same results, bound by kernel launches", f"Triton kernels of the {device.type} step")


def ops() -> Any:
    """The loaded operators (``adamw_step``, ``momentum_step``); call after :func:`use_compiled`."""
    return torch.ops.lightning_baoc


__all__ = [
    "KERNELS_ENV", "POLICIES", "TRITON_DEVICES", "TRITON_SERVED", "KernelStatus", "compile_flags", "cpu_kernels", "ops", "resolve_policy",
    "step_path", "use_compiled", "use_triton",
]
