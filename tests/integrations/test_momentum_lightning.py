"""BlockwiseSGD and BlockwiseLion under Lightning: returned from ``configure_optimizers`` with an LR
scheduler, checkpointed by the Trainer and resumed bit-equal to the uninterrupted run (int8 and bf16
buffers), with gradient release; and in a Fabric loop saved and loaded with ``fabric.save``/``load``."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_baoc import BlockwiseLion, BlockwiseSGD, GradientRelease


class _Model(pl.LightningModule):
    def __init__(self, rule: str, fmt: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rule, self.fmt = rule, fmt
        self.net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 4))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        if self.rule == "sgd":
            opt = BlockwiseSGD(self.net.named_parameters(), lr=0.05, momentum=0.9, nesterov=True, state_format=self.fmt,
                               min_8bit_numel=0)
        else:
            opt = BlockwiseLion(self.net.named_parameters(), lr=1e-3, weight_decay=0.1, state_format=self.fmt,
                                min_8bit_numel=0)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):  # type: ignore[no-untyped-def]
        gen = torch.Generator().manual_seed(2)
        data = torch.utils.data.TensorDataset(torch.randn(256, 64, generator=gen), torch.randint(0, 4, (256,), generator=gen))
        return torch.utils.data.DataLoader(data, batch_size=16)


def _fit(root: Path, rule: str, fmt: str, epochs: int, ckpt: str | None = None, release: bool = False):  # type: ignore[no-untyped-def]
    model = _Model(rule, fmt)
    callbacks: list[pl.Callback] = [pl.callbacks.ModelCheckpoint(dirpath=root / "ckpt", save_last=True)]
    if release:
        callbacks.append(GradientRelease())
    trainer = pl.Trainer(accelerator="cpu", max_epochs=epochs, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root, callbacks=callbacks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, ckpt_path=ckpt)
    return model, trainer


@pytest.mark.parametrize("rule,fmt", [("sgd", "int8"), ("lion", "bf16")])
def test_trainer_resume_is_bit_equal(tmp_path: Path, rule: str, fmt: str) -> None:
    _fit(tmp_path / "a", rule, fmt, 1)
    resumed, trainer = _fit(tmp_path / "a", rule, fmt, 2, ckpt=str(tmp_path / "a" / "ckpt" / "last.ckpt"))
    straight, straight_trainer = _fit(tmp_path / "b", rule, fmt, 2)
    assert trainer.global_step == straight_trainer.global_step == 32
    for p, q in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(p, q)
    opt, ref = trainer.optimizers[0], straight_trainer.optimizers[0]
    assert set(opt.formats().values()) == {fmt}
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"] < (0.05 if rule == "sgd" else 1e-3)
    for name in opt.named_params:
        assert torch.equal(opt.param_state(name).exp_avg, ref.param_state(name).exp_avg)


def test_trainer_with_gradient_release_equals_without(tmp_path: Path) -> None:
    released, _ = _fit(tmp_path / "r", "sgd", "int8", 1, release=True)
    plain, _ = _fit(tmp_path / "p", "sgd", "int8", 1)
    for p, q in zip(released.parameters(), plain.parameters()):
        assert torch.equal(p, q)


def test_fabric_save_and_load(tmp_path: Path) -> None:
    def loop(steps: int, load: bool):  # type: ignore[no-untyped-def]
        fabric = Fabric(accelerator="cpu", devices=1)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4))
        opt = BlockwiseLion(model.named_parameters(), lr=1e-3, state_format="int8", min_8bit_numel=0)
        model, fabric_opt = fabric.setup(model, opt)
        state = {"model": model, "optimizer": fabric_opt, "step": 0}
        if load:
            fabric.load(tmp_path / "ckpt.pt", state)
        gen = torch.Generator().manual_seed(1)
        for step in range(steps):
            x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)
            if step < state["step"]:
                continue  # the batches the loaded run has seen
            fabric_opt.zero_grad()
            fabric.backward(nn.functional.cross_entropy(model(x), y))
            fabric_opt.step()
            state["step"] = step + 1
            if step == 4 and not load:
                fabric.save(tmp_path / "ckpt.pt", state)
        return model, opt

    straight, opt = loop(10, False)
    resumed, opt2 = loop(10, True)
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    assert opt2.step_count("0.weight") == 10
