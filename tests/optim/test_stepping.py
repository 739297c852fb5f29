"""The step part alone (``lightning_baoc/optim/stepping.py``: :class:`StepDispatcher`), over a records table
whose states :class:`~lightning_baoc.optim.pools.StatePools` made, with param groups and ``hyper_of`` given
here as plain dicts and a function.

- The eager step of fp32 states is ``torch.optim.AdamW``'s, each group with its own hyperparameters,
  and the counts advance; the compiled step of int8 states is the eager one's, bit for bit.
- A non-finite gradient skips its parameter (value, state and counts kept, the skip counted) and is
  warned once per name, under the settings' label.
- Rounding keys follow the seed, the name, the step and the salt, and a shard's offset shifts them;
  the finiteness test tells inf and NaN from finite values whose squares overflow.
- Through the optimizer: every format (16-bit weights with a correction too), SGD and Lion reach their
  arithmetic (the compiled operator, the Triton kernel, torch's fused AdamW, the eager formats' math) within
  four calls of ``step()`` on every backend.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import pytest
import torch
from support import one_thread  # noqa: F401 - one intra-op thread for the module
from torch import nn

from lightning_baoc import kernels
from lightning_baoc.formats import FORMATS, StepHyper
from lightning_baoc.optim.pools import Record, StatePools
from lightning_baoc.optim.stepping import StepDispatcher, StepSettings


def _hyper_of(policy: str) -> Any:
    def hyper_of(group: Mapping[str, Any], noise_key: int = 0) -> StepHyper:
        beta1, beta2 = group["betas"]
        return StepHyper(lr=group["lr"], beta1=beta1, beta2=beta2, eps=1e-8, weight_decay=group["weight_decay"],
                         noise_key=noise_key, kernels=policy)
    return hyper_of


def _setup(fmt: str, policy: str = "eager", seed: int = 0) -> tuple[list[nn.Parameter], list[dict], dict, StepDispatcher]:
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(shape, generator=gen)) for shape in [(33, 70), (64,), (40, 32)]]
    groups = [{"params": params[:2], "lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.01},
              {"params": params[2:], "lr": 3e-3, "betas": (0.8, 0.99), "weight_decay": 0.0}]
    records = {p: Record(name=f"w{i}", group=0 if i < 2 else 1) for i, p in enumerate(params)}
    StatePools(records, FORMATS).rebuild({p: fmt for p in params}, lambda p: _hyper_of(policy)(groups[records[p].group]))
    stepper = StepDispatcher(records, FORMATS, StepSettings(seed, True, policy, "TestOptimizer"))
    return params, groups, records, stepper


@torch.no_grad()
def _step(stepper: StepDispatcher, params: list[nn.Parameter], groups: list[dict], policy: str) -> None:
    """One step, under ``no_grad`` as the optimizer's ``step()`` runs it."""
    stepper.step([(i, g, [p for p in params if any(p is q for q in g["params"])]) for i, g in enumerate(groups)],
                 _hyper_of(policy))


def _grads(params: list[nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def test_the_eager_fp32_step_is_adamw_with_each_groups_hyperparameters() -> None:
    params, groups, records, stepper = _setup("fp32")
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    reference = torch.optim.AdamW([{**g, "params": twins[:2] if i == 0 else twins[2:]} for i, g in enumerate(groups)])
    for step in range(5):
        _grads(params, step)
        for p, q in zip(params, twins):
            q.grad = p.grad.clone()
        _step(stepper, params, groups, "eager")
        reference.step()
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert all(rec.step == rec.m_step == 5 for rec in records.values())


@pytest.mark.skipif(not kernels.cpu_kernels().available, reason="no compiled CPU kernels")
def test_the_compiled_step_is_the_eager_step_to_the_bit() -> None:
    runs = []
    for policy in ("eager", "compiled"):
        params, groups, records, stepper = _setup("int8", policy)
        for step in range(4):
            _grads(params, step)
            _step(stepper, params, groups, policy)
        runs.append([p.detach().clone() for p in params] + [t.clone() for r in records.values() for t in r.views.values()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("policy", ["eager", "compiled"])
def test_a_non_finite_gradient_skips_its_parameter_and_is_warned_once(policy: str) -> None:
    if policy == "compiled" and not kernels.cpu_kernels().available:
        pytest.skip("no compiled CPU kernels")
    params, groups, records, stepper = _setup("int8", policy)
    _grads(params, 0)
    _step(stepper, params, groups, policy)
    kept = params[0].detach().clone(), {k: t.clone() for k, t in records[params[0]].views.items()}
    with pytest.warns(RuntimeWarning, match="TestOptimizer: non-finite gradient for 'w0'"):
        _grads(params, 1)
        params[0].grad[3, 4] = float("nan")
        _step(stepper, params, groups, policy)
    assert torch.equal(params[0].detach(), kept[0])
    assert all(torch.equal(t, kept[1][k]) for k, t in records[params[0]].views.items())
    assert (records[params[0]].step, records[params[0]].nonfinite, records[params[1]].step) == (1, 1, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per name
        _grads(params, 2)
        params[0].grad[0, 0] = float("inf")
        _step(stepper, params, groups, policy)
    assert records[params[0]].nonfinite == 2 and stepper.warned == {"w0"}


def test_rounding_keys_follow_seed_name_step_salt_and_shard_offset() -> None:
    _, _, records, stepper = _setup("bf16", seed=3)
    _, _, _, other_seed = _setup("bf16", seed=4)
    a, b = list(records.values())[:2]
    keys = {stepper.noise_key(a, step=1), stepper.noise_key(a, step=2), stepper.noise_key(b, step=1),
            stepper.noise_key(a, salt=7, step=1), other_seed.noise_key(a, step=1)}
    assert len(keys) == 5
    assert stepper.noise_key(a) == stepper.noise_key(a, step=a.step)
    assert stepper.salt(a) == stepper.salts["w0"]  # computed once per name
    shard = Record(name="w0", group=0, shard_offset=1000)
    assert stepper.noise_key(shard, step=1) == (stepper.noise_key(a, step=1) + 1000) & 0xFFFFFFFF


def test_the_finiteness_test_tells_overflowing_squares_from_inf_and_nan() -> None:
    params, _, _, stepper = _setup("fp32")
    grads = [torch.full(p.shape, 1e20) for p in params]  # finite, their squares overflow fp32
    grads[1][0] = float("nan")
    grads[2][1, 1] = float("-inf")
    for p, g in zip(params, grads):
        p.grad = g
    assert stepper.finite_mask(params) == [True, False, False]


# ---------------------------------------------------------------------------- calls from step() to the arithmetic


def _arithmetic_depths(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Wrap every place the step's arithmetic runs (the compiled CPU operators, the Triton kernel, torch's
    fused AdamW, the eager formats' math); each call records (its name, its calls from ``step()``: the frames
    between ``BlockwiseOptimizer.step`` and it, the call itself included, decorators' wrappers left out)."""
    import sys

    from lightning_baoc.formats import adam_math, elementwise, factored, fused_adam, int8_factored, momentum
    from lightning_baoc.kernels import triton_step
    from lightning_baoc.optim.optimizer import BlockwiseOptimizer

    step_code = BlockwiseOptimizer.step.__wrapped__.__code__  # under torch.no_grad's wrapper
    seen: list[tuple[str, int]] = []

    def depth() -> int:
        frame, calls = sys._getframe(2), 1  # the caller of the wrapped call; the call itself
        while frame is not None and frame.f_code is not step_code:
            calls += not frame.f_code.co_filename.endswith("_contextlib.py")
            frame = frame.f_back
        assert frame is not None, "the arithmetic ran outside step()"
        return calls

    def recorded(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen.append((name, depth()))
            return real(*args, **kwargs)
        return call

    class Ops:
        def __getattr__(self, name: str) -> Any:
            return recorded(f"compiled {name}", getattr(real_ops(), name))

    class Launches:
        def __getitem__(self, grid: Any) -> Any:
            return recorded("triton", real_kernel[grid])

    real_ops, real_kernel, real_fused = kernels.ops, triton_step._adamw_tensors, fused_adam._kernel
    monkeypatch.setattr(kernels, "ops", lambda: Ops())
    monkeypatch.setattr(triton_step, "_adamw_tensors", Launches())
    monkeypatch.setattr(fused_adam, "_kernel", lambda decoupled: recorded("fused", real_fused(decoupled)))
    for module, name in [(elementwise, "chunk_adamw"), (adam_math, "foreach_adamw"), (fused_adam, "foreach_adamw"),
                         (factored, "factored_update"),
                         (int8_factored, "factored_update"), (momentum, "chunk_sgd"), (momentum, "chunk_lion")]:
        monkeypatch.setattr(module, name, recorded(name, getattr(module, name)))
    return seen


def _backends() -> list[str]:
    """The eager step; the compiled CPU kernels where they build; the Triton step in Triton's interpreter
    where triton imports (``TRITON_INTERPRET=1``: ``tests/conftest.py`` sets it before triton is imported)."""
    import importlib.util
    import os

    found = ["eager"] + (["compiled"] if kernels.cpu_kernels().available else [])
    if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
        found.append("triton")
    return found


def _depths_of(monkeypatch: pytest.MonkeyPatch, backend: str, make: Any, dtype: torch.dtype = torch.float32) -> list:
    if backend == "triton":  # CPU tensors through the Triton step, in Triton's interpreter
        from lightning_baoc.optim import stepping

        monkeypatch.setattr(kernels, "TRITON_DEVICES", {"cuda", "cpu"})
        monkeypatch.setattr(stepping, "kernel_serves", lambda *args: False)
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(shape, generator=gen).to(dtype)) for shape in [(33, 70), (64,)]]
    opt = make([(f"w{i}", p) for i, p in enumerate(params)], "auto" if backend == "triton" else backend)
    seen: list[tuple[str, int]] = []
    for step in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        if step == 1:
            opt.set_formats({"w0": opt.formats()["w0"]})  # (nothing to convert)
            params[1].grad[0] = float("nan")  # a skip, decided where the backend decides it
        if step == 2:
            seen = _arithmetic_depths(monkeypatch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            opt.step()
    return seen


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_format_reaches_its_arithmetic_within_four_calls_of_step(fmt: str, backend: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``step()`` -> the dispatcher -> the backend's entry -> the arithmetic, for every format and backend
    (``BlockwiseAdamW``; 16-bit weights with a correction too)."""
    from lightning_baoc import BlockwiseAdamW

    for dtype, correction in [(torch.float32, "none"), (torch.bfloat16, "ecc8")]:
        seen = _depths_of(monkeypatch, backend, lambda named, policy: BlockwiseAdamW(
            named, lr=1e-3, state_format=fmt, min_8bit_numel=0, kernels=policy, weight_correction=correction), dtype)
        assert seen and max(depth for _, depth in seen) <= 4, (dtype, seen)
        monkeypatch.undo()


@pytest.mark.parametrize("backend", [b for b in _backends() if b != "triton"])
@pytest.mark.parametrize("rule", ["sgd", "lion"])
def test_sgd_and_lion_reach_their_arithmetic_within_four_calls_of_step(rule: str, backend: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_baoc import MOMENTUM_FORMATS, BlockwiseLion, BlockwiseSGD

    for fmt in MOMENTUM_FORMATS:
        seen = _depths_of(monkeypatch, backend, lambda named, policy: (
            BlockwiseSGD(named, lr=1e-2, momentum=0.9, state_format=fmt, min_8bit_numel=0, kernels=policy)
            if rule == "sgd" else BlockwiseLion(named, state_format=fmt, min_8bit_numel=0, kernels=policy)))
        assert seen and max(depth for _, depth in seen) <= 4, (fmt, seen)
        monkeypatch.undo()
