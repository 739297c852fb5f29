"""AMP's gradient scaler handing a blockwise optimizer its scale and ``found_inf`` (``amp_scaling``:
``lightning_baoc/optim/amp.py``) against the scaler's own way (it unscales, reads ``found_inf`` on the host and
calls ``step()`` only without an inf): the same bits, the same counts, the same scale, on the CPU's compiled
step, the device's planned step and the CUDA graph step (the device's path through Triton's interpreter on the
CPU, the graph through the tape backend, as ``tests/optim/test_graph_step.py``)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

import lightning_baoc.optim.stepping as stepping
from lightning_baoc import BlockwiseAdamW, kernels
from lightning_baoc.optim import graph_step

PATHS = ["compiled", "planned", "graph"]


def _device_path(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it before triton is imported
        pytest.skip("TRITON_INTERPRET=1 is not set")
    pytest.importorskip("triton", reason="triton is not installed (the CUDA step's optional kernels)")
    if torch.cuda.is_available():  # pragma: no cover
        pytest.skip("CUDA present: the device's path is CUDA's (tests/optim/test_graph_step.py)")
    monkeypatch.setattr(kernels, "TRITON_DEVICES", {"cuda", "cpu"})
    monkeypatch.setattr(stepping, "kernel_serves", lambda *args: False)


def _run(path: str, on: bool, steps: int = 12) -> tuple[list[torch.Tensor], dict, dict, float, int]:
    """``steps`` steps through ``torch.amp.GradScaler``: gradients scaled by the scaler's scale, an inf at steps 4
    and 9 (the scaler skips them and halves its scale), a cosine learning rate; ``on``: the optimizer handles the
    scaling (amp_scaling)."""
    gen = torch.Generator().manual_seed(0)
    named = [(name, nn.Parameter(torch.randn(shape, generator=gen) * 0.1))
             for name, shape in {"a": (37, 101), "b": (300,), "c": (64, 64)}.items()]
    opt = BlockwiseAdamW(named, lr=1e-2, weight_decay=0.1, state_format="int8", min_8bit_numel=0)
    opt.set_formats({"b": "fp32", "c": "bf16"})
    opt.amp_scaling = on
    tape = graph_step.TapeBackend()
    opt._stepper.graphs.backend_for = (lambda device: tape) if path == "graph" else (lambda device: None)  # noqa: SLF001
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    for _, p in named:
        p.grad = torch.zeros_like(p)
    for step in range(steps):
        scaler.scale(torch.ones(()))  # (the scaler's scale exists from its first use)
        scale = scaler.get_scale()
        for _, p in named:
            p.grad.copy_(torch.randn(p.shape, generator=gen) * 1e-2 * scale)
        if step in (4, 9):
            named[0][1].grad[1, 2] = float("inf")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no parameter's non-finite warning: the scaler's skips are its own
            scaler.step(opt)
        scaler.update()
        schedule.step()
    state = []
    for _, p in named:
        rec = opt._records[p]  # noqa: SLF001
        state += [p.detach().clone(), *(t.clone() for _, t in sorted(rec.views.items()))]
    counts = {name: (opt.step_count(name), opt.momentum_step_count(name)) for name, _ in named}
    return state, counts, opt.nonfinite_counts, scaler.get_scale(), opt._stepper.graphs.replays  # noqa: SLF001


# the planned and graph paths' AMP is also the route matrix's (tests/optim/test_routes.py, case "amp"): slow here
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow if p in ("planned", "graph") else ()) for p in PATHS])
def test_the_optimizer_handling_the_scaler_steps_as_the_scaler_does(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if path != "compiled":
        _device_path(monkeypatch)
    handled, counts, skipped, scale, replays = _run(path, True)
    own, counts_own, skipped_own, scale_own, _ = _run(path, False)
    assert counts == counts_own == {name: (10, 10) for name in "abc"}  # the two skipped steps taken back
    assert skipped == skipped_own == {}  # the scaler's skips are no parameter's non-finite one
    assert scale == scale_own
    if path == "graph":
        assert replays >= 6  # captured after the steady steps, dropped by nothing the scaler does
    for x, y in zip(handled, own):
        assert x.dtype == y.dtype and torch.equal(x, y)


def test_amp_scaling_is_a_bool() -> None:
    opt = BlockwiseAdamW([nn.Parameter(torch.zeros(3))])
    assert opt.amp_scaling is False and not getattr(opt, "_step_supports_amp_scaling", False)
    opt.amp_scaling = True
    assert opt.amp_scaling and opt._step_supports_amp_scaling  # what GradScaler reads  # noqa: SLF001
    with pytest.raises(TypeError, match="amp_scaling must be True or False"):
        opt.amp_scaling = 1  # type: ignore[assignment]
