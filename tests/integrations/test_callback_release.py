"""BAOC with gradient release (``GradientRelease``): the sampler and the shadow moments observe each
gradient inside the release hook, just before its parameter steps.

- Through the first allocation, a run with release equals the run without to the bit: the same
  samples in the ring, the same shadow moments, the same risk table and allocation, the same weights
  (fp32 weights, and bf16-true weights with ``ecc8`` corrections).
- Training goes on after the allocation and after a re-evaluation with every gradient released.
- What cannot work is refused at setup: a gradient scaler (``16-mixed``).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from support import one_thread  # noqa: F401 - one_thread applies to the module
from torch import nn

from lightning_baoc import BAOC, BlockwiseAdamW, GradientRelease


class _Model(pl.LightningModule):
    def __init__(self, correction: str = "none") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.correction = correction
        self.net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 4))
        self.released_seen: list[bool] = []

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).float(), y)

    def on_before_optimizer_step(self, optimizer):  # type: ignore[no-untyped-def]
        # after backward: with release every gradient is gone already
        self.released_seen.append(all(p.grad is None for p in self.parameters()))

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return BlockwiseAdamW(self.net.named_parameters(), lr=1e-3, weight_correction=self.correction)

    def train_dataloader(self):  # type: ignore[no-untyped-def]
        gen = torch.Generator().manual_seed(2)
        data = torch.utils.data.TensorDataset(torch.randn(512, 64, generator=gen), torch.randint(0, 4, (512,), generator=gen))
        return torch.utils.data.DataLoader(data, batch_size=16)


def _fit(tmp_path: Path, release: bool, max_steps: int, precision: str = "32-true", release_first: bool = False,
         **baoc_kwargs):  # type: ignore[no-untyped-def]
    baoc = BAOC(memory_budget=0.3, warmup_steps=12, sample_every=2, report=False, **baoc_kwargs)
    model = _Model("ecc8" if precision == "bf16-true" else "none")
    callbacks: list[pl.Callback] = [baoc] + ([GradientRelease()] if release else [])
    if release_first:
        callbacks.reverse()
    trainer = pl.Trainer(accelerator="cpu", max_steps=max_steps, precision=precision, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=tmp_path, callbacks=callbacks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
    return model, trainer, baoc


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_release_observes_as_the_run_without_release(tmp_path: Path, precision: str) -> None:
    steps = 13  # warm-up 12: the allocation runs after step 13, and no step follows it
    plain, plain_trainer, plain_baoc = _fit(tmp_path / "plain", False, steps, precision)
    released, released_trainer, released_baoc = _fit(tmp_path / "released", True, steps, precision)
    assert released.released_seen == [True] * steps and plain.released_seen == [False] * steps
    a, b = plain_baoc.controller, released_baoc.controller
    assert a.phase == b.phase == "allocated"
    # the sampler's statistics the allocation was made from (the ring is cleared after it)
    stats_a, stats_b = a.last_event.statistics, b.last_event.statistics
    assert stats_a == stats_b and len(stats_a) == 3
    assert all(s["samples"] >= 6 for s in stats_a.values()), stats_a
    for name, entry in a.shadow.entries.items():
        other = b.shadow.entries[name]
        assert entry.steps == other.steps == steps
        assert torch.equal(entry.exp_avg, other.exp_avg) and torch.equal(entry.exp_avg_sq, other.exp_avg_sq)
    assert a.last_event.risk == b.last_event.risk
    assert a.allocation == b.allocation and len(set(a.allocation.values())) > 1
    for p, q in zip(plain.parameters(), released.parameters()):
        assert torch.equal(p, q)
    opt = released_trainer.optimizers[0]
    assert opt.releases_gradients is False  # turned off at the end of fit
    assert plain_trainer.optimizers[0].formats() == opt.formats()


@pytest.mark.parametrize("release_first", [False, True], ids=["baoc-first", "release-first"])
def test_training_goes_on_after_allocation_and_reevaluation(tmp_path: Path, release_first: bool) -> None:
    model, trainer, baoc = _fit(tmp_path, True, 80, release_first=release_first, reevaluate_every_n_epochs=1)
    controller = baoc.controller
    assert trainer.global_step == 80 and controller.phase == "allocated"
    assert controller.last_event.reason == "epoch"  # a re-evaluation at an epoch's end, after the allocation
    assert controller.last_event.step > 12
    assert model.released_seen and all(model.released_seen)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert controller.optimizer.state_bytes() <= controller.memory_budget_bytes()


def test_release_refuses_a_gradient_scaler() -> None:
    """fp16 AMP (``16-mixed``, CUDA only: on the CPU Lightning turns it into bf16) scales the loss: the
    release hooks would step on scaled gradients. The check reads the precision plugin's scaler."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cpu"))
    trainer = SimpleNamespace(accumulate_grad_batches=1, gradient_clip_val=None, precision="16-mixed",
                              precision_plugin=plugin, callbacks=[])
    with pytest.raises(ValueError, match="with a gradient scaler: release would step on the scaled"):
        GradientRelease().setup(trainer, _Model(), "fit")  # type: ignore[arg-type]
    trainer.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
    GradientRelease().setup(trainer, _Model(), "fit")  # type: ignore[arg-type]
