"""Fabric with ``precision="bf16-true"``: BlockwiseAdamW's master-weight corrections and gradient
release in a plain Fabric loop (the user calls ``optimizer.release_gradients()``, and ``step()`` once
per iteration), bit-equal to the same loop without release; BAOCStrategy with release observes as
without it."""

from __future__ import annotations

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_baoc import BlockwiseAdamW, training_memory


def _loop(release: bool) -> tuple[nn.Module, BlockwiseAdamW]:
    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-true")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4))
    opt = BlockwiseAdamW(model.named_parameters(), lr=1e-3, state_format="int8", min_8bit_numel=0, weight_correction="ecc8")
    model, fabric_opt = fabric.setup(model, opt)
    if release:
        opt.release_gradients()
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        fabric_opt.zero_grad()
        fabric.backward(nn.functional.cross_entropy(model(x).float(), y))
        fabric_opt.step()
    return model, opt


def test_fabric_bf16_true_with_corrections_and_release() -> None:
    plain, plain_opt = _loop(False)
    released, released_opt = _loop(True)
    assert next(plain.parameters()).dtype == torch.bfloat16
    assert len(plain_opt.weight_corrections) == 4
    for a, b in zip(plain.parameters(), released.parameters()):
        assert torch.equal(a, b)
    masters = plain_opt.master_weights()
    assert all(torch.equal(masters[k], v) for k, v in released_opt.master_weights().items())
    whole = training_memory(released, released_opt)
    assert whole.gradients == 0 and whole.corrections == whole.params


def _baoc_loop(release: bool, steps: int = 13, corrections: list[str] | None = None):  # type: ignore[no-untyped-def]
    from lightning_baoc import BAOCStrategy

    strategy = BAOCStrategy(memory_budget=0.3 if corrections is None else 0.8, warmup_steps=12, sample_every=2,
                            report=False, corrections=corrections)
    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-true", strategy=strategy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 4))
    lr, correction = (1e-3, "ecc8") if corrections is None else (1e-5, "none")
    opt = BlockwiseAdamW(model.named_parameters(), lr=lr, weight_correction=correction)
    model, fabric_opt = fabric.setup(model, opt)
    if release:
        strategy.controller.optimizer.release_gradients()
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        fabric_opt.zero_grad()
        fabric.backward(nn.functional.cross_entropy(model(x).float(), y))
        if release:
            assert all(p.grad is None for p in model.parameters())
        fabric_opt.step()
    return model, strategy.controller


def test_fabric_baoc_with_release_observes_as_without() -> None:
    """BAOCStrategy with gradient release: the observation opens in ``strategy.backward`` and closes in
    ``optimizer_step``; through the first allocation the run equals the one without release."""
    plain, a = _baoc_loop(False)
    released, b = _baoc_loop(True)
    assert a.phase == b.phase == "allocated"
    assert a.last_event.statistics == b.last_event.statistics
    assert a.last_event.risk == b.last_event.risk and a.allocation == b.allocation
    for p, q in zip(plain.parameters(), released.parameters()):
        assert torch.equal(p, q)


def test_fabric_baoc_chooses_corrections_per_block_within_the_budget() -> None:
    """``BAOCStrategy(corrections=...)`` in a bf16-true Fabric loop with gradient release: at lr 1e-5 every
    block keeps a correction, and the states and the corrections together stay within the budget."""
    model, ctl = _baoc_loop(True, corrections=["none", "ecc8", "ecc16"])
    opt = ctl.optimizer
    assert ctl.phase == "allocated" and all("+ecc" in o for o in ctl.allocation.values())
    assert len(opt.weight_corrections) == 6 and ctl.last_event.correction_bytes == opt.weight_correction_bytes()
    assert opt.state_bytes() + opt.weight_correction_bytes() <= 0.8 * ctl.baseline_state_bytes()
    assert ctl.baseline_state_bytes() == 4 * sum(p.numel() for p in model.parameters())

