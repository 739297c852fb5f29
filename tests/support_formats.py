"""The one harness that steps a state format through a backend and holds two backends to each other.

Backends of ``BlockwiseAdamW``'s step, on the CPU:

- ``"reference"``: :func:`lightning_baoc.formats.reference.reference_step`, the readable decode ->
  textbook fp32 AdamW -> encode, from the state the eager step made at the first step;
- ``"eager"``: the formats' own ``update`` (``kernels="eager"``), which every other backend is held to;
- ``"compiled"``: the compiled CPU kernels (``kernels="compiled"``);
- ``"triton"``: the CUDA step's Triton kernels, run on CPU tensors by Triton's interpreter
  (``TRITON_INTERPRET=1``, which ``tests/conftest.py`` sets where torch sees no GPU).

:func:`run` returns what a step leaves (the parameters and every compact state tensor, in a fixed
order); :func:`assert_agree` compares two runs with the bounds of the format's registry entry
(:attr:`StateFormat.parity <lightning_baoc.formats.base.StateFormat.parity>`), so that no test copies a
tolerance. ``tests/formats/test_backends.py`` runs every format through every backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Any, Iterator

import pytest
import torch
from torch import nn

from lightning_baoc import FORMATS, MOMENTUM_FORMATS, BlockwiseAdamW, BlockwiseLion, BlockwiseSGD, kernels
from lightning_baoc.formats.base import Agreement
from lightning_baoc.formats.quant import name_salt, stream_key
from lightning_baoc.formats.reference import reference_step

BACKENDS = ("reference", "compiled", "triton")  # each held to the eager step
#: The optimizers and the registry of the formats each holds.
OPTIMIZERS = {"adamw": (BlockwiseAdamW, FORMATS), "sgd": (BlockwiseSGD, MOMENTUM_FORMATS),
              "lion": (BlockwiseLion, MOMENTUM_FORMATS)}


def unavailable(backend: str) -> str | None:
    """Why ``backend`` cannot run here (``None``: it can)."""
    if backend == "compiled" and not kernels.cpu_kernels().available:
        return f"no compiled kernels: {kernels.cpu_kernels().detail}"
    if backend == "triton":
        if torch.cuda.is_available():
            return "CUDA present: tests/integrations/test_cuda.py runs the Triton kernels on the GPU"
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "TRITON_INTERPRET=1 is not set"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed (the CUDA step's optional kernels)"
    return None


def skip_unless(backend: str) -> None:
    """Skip the calling test where ``backend`` cannot run, saying why."""
    why = unavailable(backend)
    if why is not None:
        pytest.skip(why)


@contextlib.contextmanager
def _triton_on_cpu(launched: list[int]) -> Iterator[None]:
    """CPU parameters take the Triton step (not the compiled C++ one); each launch's tensor count is
    appended to ``launched``."""
    import lightning_baoc.optim.stepping as stepping
    from lightning_baoc.kernels import triton_step

    real = triton_step._adamw_tensors

    class Counted:
        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            def launch(table: Any, count: int, *args: Any, **kwargs: Any) -> Any:
                launched.append(count)
                return real[grid](table, count, *args, **kwargs)
            return launch

    saved = kernels.TRITON_DEVICES, stepping.kernel_serves
    kernels.TRITON_DEVICES, stepping.kernel_serves, triton_step._adamw_tensors = {"cuda", "cpu"}, (lambda *args: False), Counted()
    try:
        yield
    finally:
        (kernels.TRITON_DEVICES, stepping.kernel_serves), triton_step._adamw_tensors = saved, real


def state_of(opt: Any, p: torch.Tensor) -> list[torch.Tensor]:
    """``p``'s compact state tensors (sorted by key), its step counts and its master-weight correction."""
    record = opt._records[p]  # noqa: SLF001 - the compact state itself
    out = [t.clone() for _, t in sorted(record.views.items())] + [record.counts.clone()]
    return out + ([record.master_correction.clone()] if record.master_correction is not None else [])


def run(fmt: str, backend: str, shapes: list[tuple[int, ...]], steps: int, *, optimizer: str = "adamw",
        nonfinite_at: int | None = None, **options: Any) -> list[torch.Tensor]:
    """``steps`` steps of one parameter per shape in ``fmt`` through ``backend`` ("eager" too): each
    parameter, then its :func:`state_of`, after the last step.

    Seeded: every backend sees the same parameters and gradients (scaled up step by step; a square
    gradient is non-contiguous). ``optimizer``: ``"adamw"``, ``"sgd"`` or ``"lion"`` (the reference
    backend: AdamW's formats only). ``nonfinite_at``: at that step the first parameter's gradient holds an
    inf (its update skipped and counted). ``options``: the optimizer's (``maximize``, ``weight_decay``,
    ``weight_correction``...) and ``param_dtype`` (default fp32).
    """
    gen = torch.Generator().manual_seed(0)
    dtype = options.pop("param_dtype", torch.float32)
    options.setdefault("lr", 1e-2)
    params = [nn.Parameter(torch.randn(shape, generator=gen).to(dtype)) for shape in shapes]
    grads = [[torch.randn(shape, generator=gen) * (1.0 + 0.1 * i) for shape in shapes] for i in range(steps)]
    if nonfinite_at is not None and nonfinite_at < steps:
        grads[nonfinite_at][0].view(-1)[0] = float("inf")
    policy = {"reference": "eager", "eager": "eager", "compiled": "compiled", "triton": "auto"}[backend]
    cls = OPTIMIZERS[optimizer][0]
    opt = cls([(f"w{i}", p) for i, p in enumerate(params)], state_format=fmt, min_8bit_numel=0, kernels=policy,
              **options)
    launched: list[int] = []
    with _triton_on_cpu(launched) if backend == "triton" else contextlib.nullcontext(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "non-finite gradient", RuntimeWarning)
        for i in range(1 if backend == "reference" else steps):  # the reference takes over after the first
            for p, g in zip(params, grads[i]):
                transpose = g.dim() == 2 and g.shape[0] == g.shape[1]
                p.grad = (g.t().contiguous().t() if transpose else g).to(dtype)
            opt.step()
    if backend == "triton":  # every parameter, every step took the kernel
        assert sum(launched) == len(shapes) * steps, (fmt, "tensors launched", sum(launched), len(shapes) * steps)
    if nonfinite_at is not None and nonfinite_at < steps and backend != "reference":
        assert opt.nonfinite_counts == {"w0": 1}, opt.nonfinite_counts
    if backend != "reference":
        return [t for p in params for t in [p.detach().clone(), *state_of(opt, p)]]
    out = []
    for index, p in enumerate(params):
        record = opt._records[p]  # noqa: SLF001 - the reference steps the compact state itself
        views = {k: v.clone() for k, v in record.views.items()}
        q = p.detach().clone()
        step, m_step = record.step, record.m_step
        for i in range(1, steps):
            step, m_step = step + 1, m_step + 1
            hyper = dataclasses.replace(opt._hyper_for(p), noise_key=stream_key(opt.seed, step, name_salt(f"w{index}")))  # noqa: SLF001
            reference_step(fmt, views, q, grads[i][index].to(dtype), hyper, step=step, momentum_step=m_step)
        out += [q, *(views[k] for k in sorted(views))]
    return out


def _relative(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / scale.double().norm().clamp_min(1e-30))


def _ulps_of_scale(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest element-wise difference in fp32 ulps of ``b``'s largest finite magnitude; infinite
    where their infinities and NaNs differ."""
    a, b = a.double(), b.double()
    finite = torch.isfinite(b)
    if not torch.equal(finite, torch.isfinite(a)) or not torch.equal(a[~finite].nan_to_num(), b[~finite].nan_to_num()):
        return float("inf")
    if not bool(finite.any()):
        return 0.0
    a, b = a[finite], b[finite]
    return float((a - b).abs().max() / (b.abs().max().clamp_min(1e-30) * 2.0**-23))


def _assert_fast(agreement: Agreement, fast: list[torch.Tensor], eager: list[torch.Tensor], where: str) -> None:
    for i, (x, y) in enumerate(zip(fast, eager)):
        assert x.dtype == y.dtype and x.shape == y.shape, (where, i)
        if x.is_floating_point() and agreement.kind != "bit-equal" and x.numel():
            error = _ulps_of_scale(x, y) if agreement.kind == "ulps" else _relative(x, y, y)
            assert error <= agreement.bound, (where, i, agreement.kind, error)
        elif x.dtype in (torch.int8, torch.uint8) and agreement.kind == "relative" and x.numel():
            d = (x.int() - y.int()).abs()  # 8-bit codes: within one in a small share of their elements
            assert int(d.max()) <= 1 and float((d > 0).double().mean()) <= agreement.code_share, (where, i, x.dtype)
        else:  # bit-equal; and the step counts, always
            assert torch.equal(x, y), (where, i, x.dtype, (x.double() - y.double()).abs().max().item())


def assert_agree(fmt: str, backend: str, runs: list[torch.Tensor], eager: list[torch.Tensor],
                 shapes: list[tuple[int, ...]], start: list[torch.Tensor] | None = None, optimizer: str = "adamw") -> None:
    """``runs`` (of ``backend``) agree with the eager step's ``eager`` within ``fmt``'s parity.

    The reference is held by the relative difference of the parameters' movement from ``start`` (their
    values after the first step) and of the decoded moments; a fast backend by its :class:`Agreement`.
    """
    parity = OPTIMIZERS[optimizer][1][fmt].parity
    if backend != "reference":
        assert len(runs) == len(eager), (fmt, backend)
        _assert_fast(getattr(parity, backend), runs, eager, f"{fmt} on {backend}")
        return
    assert start is not None, "the reference is held to the movement since the first step"
    width = len(runs) // len(shapes)
    assert len(eager) == len(runs) + len(shapes), (fmt, "the eager run holds the counts the reference has not")
    eager = [t for k in range(len(shapes)) for t in eager[k * (width + 1):(k + 1) * (width + 1) - 1]]  # counts left out
    for k, shape in enumerate(shapes):
        mine, theirs = runs[k * width:(k + 1) * width], eager[k * width:(k + 1) * width]
        moved = theirs[0] - start[k]
        error = _relative(mine[0], theirs[0], moved)
        assert error <= parity.reference, (fmt, shape, "param", error)
        keys = sorted(FORMATS[fmt].layout(shape), key=lambda spec: spec.key)
        fast = FORMATS[fmt].decode({spec.key: t for spec, t in zip(keys, theirs[1:])}, shape)
        slow = FORMATS[fmt].decode({spec.key: t for spec, t in zip(keys, mine[1:])}, shape)
        for name, a, b in (("v", fast.dense_v(), slow.dense_v()), ("m", fast.exp_avg, slow.exp_avg)):
            if b is not None:
                assert _relative(a, b, b) <= parity.reference, (fmt, shape, name, _relative(a, b, b))


def after_first_step(fmt: str, shapes: list[tuple[int, ...]], **options: Any) -> list[torch.Tensor]:
    """The parameters after the eager step's first step: where the reference takes over."""
    state = run(fmt, "eager", shapes, 1, **options)
    width = len(state) // len(shapes)
    return [state[k * width] for k in range(len(shapes))]
