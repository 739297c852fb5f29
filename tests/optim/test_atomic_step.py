"""The atomic step (``atomic_step=True``): a step that raises part-way changes nothing.

Each case holds two param groups of one format (a 48x40 fp32 weight and its 40-element bias, and a
bf16 32x64 weight with an ``ecc8`` correction), steps them three times, then forces a failure in
the middle of the fourth step: the second call into any backend (the compiled kernels, the device's
plans and kernels, a format's eager update) runs, writes, and then raises. Every parameter, state
tensor, correction and count must then be bit-equal to what it was before the step, and the next
step must equal that of a copy that never failed.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

import pytest
import torch
from support import one_thread  # noqa: F401 - one_thread applies to the module
from support_formats import OPTIMIZERS, _triton_on_cpu, skip_unless, state_of
from torch import nn

import lightning_baoc.optim.stepping as stepping
from lightning_baoc.optim.device_plan import Chosen

CASES = [(name, fmt) for name, (_, registry) in OPTIMIZERS.items() for fmt in registry]
HYPER = {"adamw": {}, "sgd": {"momentum": 0.9}, "lion": {}}


class Injected(RuntimeError):
    """The failure forced in the middle of a step."""


@contextlib.contextmanager
def fail_on_second_call(registry: Any) -> Iterator[list[str]]:
    """The second call into a backend (compiled step, device plan, device kernels, eager update) runs and
    then raises :class:`Injected`; yields the names of the calls made."""
    calls: list[str] = []

    def wrap(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            calls.append(name)
            if len(calls) == 2:
                raise Injected(f"forced failure after {calls}")
            return out
        return call

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stepping, "compiled_step", wrap("compiled", stepping.compiled_step))
        mp.setattr(stepping.StepDispatcher, "_device_step", wrap("device", stepping.StepDispatcher._device_step))
        mp.setattr(Chosen, "step", wrap("plan", Chosen.step))
        for fmt in registry.values():
            mp.setattr(fmt, "update", wrap(f"update:{fmt.name}", fmt.update))
        yield calls


def _build(optimizer: str, fmt: str, kernels: str, atomic: bool = True) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(48, 40), "b": nn.Linear(64, 32, bias=False).bfloat16()})
    cls, _ = OPTIMIZERS[optimizer]
    groups = [
        {"params": list(model["a"].parameters()), "state_format": fmt},
        {"params": list(model["b"].parameters()), "state_format": fmt, "lr": 2e-3, "weight_correction": "ecc8"},
    ]
    names = [(f"{k}.{n}", p) for k, m in model.items() for n, p in m.named_parameters()]
    opt = cls(groups, lr=1e-3, param_names=names, min_8bit_numel=0, kernels=kernels, atomic_step=atomic,
              **HYPER[optimizer])
    return model, opt


def _grads(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _everything(model: nn.Module, opt: Any) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        out += [p.detach().clone(), *state_of(opt, p)]
    return out


#: the Triton route (its interpreter on the CPU, about a second a case) by default for int8 only; every case under -m slow
@pytest.mark.parametrize("optimizer,fmt,backend", [
    pytest.param(o, f, b, marks=pytest.mark.slow if b == "triton" and (o, f) != ("adamw", "int8") else (), id=f"{o}-{f}-{b}")
    for b in ("eager", "compiled", "triton") for o, f in CASES])
def test_a_step_failing_midway_changes_nothing(optimizer: str, fmt: str, backend: str) -> None:
    skip_unless("reference" if backend == "eager" else backend)
    if backend == "triton" and optimizer != "adamw":
        pytest.skip("the Triton kernels serve AdamW")
    kernels = "eager" if backend == "eager" else "auto"
    model, opt = _build(optimizer, fmt, kernels)
    triton = _triton_on_cpu([]) if backend == "triton" else contextlib.nullcontext()
    with triton:
        for step in range(3):
            _grads(model, step)
            opt.step()
        _grads(model, 3)
        before = _everything(model, opt)
        twin = copy.deepcopy((model, opt))
        with fail_on_second_call(opt.format_registry) as calls, pytest.raises(Injected):
            opt.step()
        assert len(calls) == 2, calls
        after = _everything(model, opt)
        assert len(after) == len(before)
        for i, (a, b) in enumerate(zip(after, before)):
            assert torch.equal(a, b), f"tensor {i} changed by the failed step ({calls})"
        # the next step is the step of a copy that never failed
        opt.step()
        twin_model, twin_opt = twin
        _grads(twin_model, 3)
        twin_opt.step()
    for a, b in zip(_everything(model, opt), _everything(twin_model, twin_opt)):
        assert torch.equal(a, b)


def test_without_atomic_step_the_failure_is_half_applied() -> None:
    """The default keeps no copy: the same forced failure leaves the first group stepped (what the option is for)."""
    model, opt = _build("adamw", "fp32", "eager", atomic=False)
    for step in range(2):
        _grads(model, step)
        opt.step()
    before = _everything(model, opt)
    with fail_on_second_call(opt.format_registry), pytest.raises(Injected):
        opt.step()
    changed = [not torch.equal(a, b) for a, b in zip(_everything(model, opt), before)]
    assert any(changed)


def test_atomic_step_is_a_bool_and_is_copied() -> None:
    model, opt = _build("adamw", "int8", "eager")
    assert opt.atomic_step and copy.deepcopy(opt).atomic_step
    with pytest.raises(TypeError, match="atomic_step"):
        OPTIMIZERS["adamw"][0](model.parameters(), atomic_step="yes")
