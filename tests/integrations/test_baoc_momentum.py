"""BAOC with SGD and Lion under the Lightning Trainer and in a Fabric loop.

The user returns ``torch.optim.SGD`` (momentum 0.9) or a :class:`~lightning_baoc.BlockwiseLion` with a
per-step cosine ``LambdaLR``; BAOC allocates their momentum formats within 30% of the user's own
optimizer state. Checked: warm-up, allocation, a re-evaluation; a crash after the allocation and a
resume from the last checkpoint bit-equal to the uninterrupted run (losses, allocation, history,
formats, buffers, weights); the report names the optimizer and its fp32 state; the same lifecycle
and bit-equal resume through ``fabric.save``/``fabric.load``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from support import digits_tensors, mlp
from support_lightning import DigitsModule, fit_crash_resume, one_thread  # noqa: F401
from torch import nn

from lightning_baoc import BAOC, MOMENTUM_FORMATS, BAOCStrategy, BlockwiseLion, BlockwiseSGD
from lightning_baoc.report.allocation import JSON_NAME, validate_record

EPOCHS = 8
LR = {"sgd": 0.05, "lion": 1e-3}


def _fit(root: Path, rule: str, crash_at: int | None = None, ckpt_path: str | None = None) -> tuple[Any, L.Trainer, BAOC]:
    L.seed_everything(0, verbose=False)
    model = DigitsModule(optimizer=rule, lr=LR[rule])
    baoc = BAOC(memory_budget=0.3, warmup_steps=12, sample_every=4, reevaluate_every_n_epochs=3, report="json")
    return model, fit_crash_resume(root, model, baoc, EPOCHS, crash_at, ckpt_path), baoc


def _same_optimizer_state(opt: Any, ref: Any) -> None:
    assert opt.formats() == ref.formats() and opt.state_bytes() == ref.state_bytes()
    for name in opt.named_params:
        a, b = opt.param_state(name).exp_avg, ref.param_state(name).exp_avg
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name


@pytest.mark.parametrize("rule", ["sgd", "lion"])
def test_trainer_lifecycle_and_resume_after_the_allocation(rule: str, tmp_path: Path) -> None:
    ref_model, ref_trainer, ref_baoc = _fit(tmp_path / "straight", rule)
    opt = ref_trainer.optimizers[0]
    assert isinstance(opt, BlockwiseSGD if rule == "sgd" else BlockwiseLion)
    assert type(opt).__name__ == ("SGD" if rule == "sgd" else "BlockwiseLion")
    history = ref_baoc.controller.history
    assert [h["reason"] for h in history][:2] == ["warmup", "epoch"] and history[0]["step"] == 12
    numel = sum(p.numel() for p in ref_model.parameters())
    assert opt.state_bytes() <= 0.3 * 4 * numel
    assert set(opt.formats().values()) <= set(MOMENTUM_FORMATS) and len(set(ref_baoc.allocation.values())) >= 1
    record = json.loads((Path(ref_trainer.log_dir) / JSON_NAME).read_text())
    validate_record(record)
    assert record["optimizer"] == ("SGD" if rule == "sgd" else "Lion")
    assert record["fp32_state_bytes"] == record["baseline_state_bytes"] == 4 * numel
    assert ref_model.lrs[30][0] < ref_model.lrs[0][0]  # the schedule drove the new optimizer

    crash_root = tmp_path / "crashed"
    _fit(crash_root, rule, crash_at=4)
    last = crash_root / "ckpt" / "last.ckpt"
    state = next(v for k, v in torch.load(last, weights_only=True)["callbacks"].items() if k.startswith("BAOC"))
    assert state["phase"] == "allocated" and state["rule"] == rule
    model, trainer, baoc = _fit(crash_root, rule, ckpt_path=str(last))
    resumed = {k: v for k, v in model.losses.items() if k[0] >= 4}
    assert resumed == {k: v for k, v in ref_model.losses.items() if k[0] >= 4} and len(resumed) == 40
    assert baoc.allocation == ref_baoc.allocation
    assert [h["step"] for h in baoc.controller.history] == [h["step"] for h in history]
    _same_optimizer_state(trainer.optimizers[0], opt)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


STEPS = 30


def _fabric_objects(rule: str) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = mlp((64, 128, 128, 10), seed=0)
    if rule == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=LR[rule], momentum=0.9, nesterov=True)
    else:
        opt = BlockwiseLion(model.named_parameters(), lr=LR[rule], weight_decay=0.1)
    cosine = lambda s: 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(s, STEPS) / STEPS))  # noqa: E731
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, cosine)


def _fabric_run(rule: str, stop: int, start: int = 0, load: Path | None = None, save: Path | None = None) -> tuple[Any, ...]:
    strategy = BAOCStrategy(memory_budget=0.3, warmup_steps=12, sample_every=4, sparse_sampling=1,
                            reevaluate_every_n_epochs=1, report=False)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    raw_model, raw_opt, raw_sched = _fabric_objects(rule)
    model, opt, sched = fabric.setup(raw_model, raw_opt, scheduler=raw_sched)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "baoc": strategy.controller}
    if load is not None:
        fabric.load(load, state)
    xtr, ytr, _, _ = digits_tensors()
    losses = {}
    for step in range(start, stop):
        i = (32 * step) % (len(xtr) - 32)
        loss = nn.functional.cross_entropy(model(xtr[i : i + 32]), ytr[i : i + 32])
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses[step] = loss.item()
        if (step + 1) % 10 == 0:  # an "epoch" ends every 10 steps: a re-evaluation is due at step 20
            strategy.on_train_epoch_end((step + 1) // 10 - 1)
    if save is not None:
        fabric.save(save, state)
    return model, opt, strategy, losses


@pytest.mark.parametrize("rule", ["sgd", "lion"])
def test_fabric_lifecycle_and_resume_after_the_allocation(rule: str, tmp_path: Path) -> None:
    ref_model, ref_opt, ref_strategy, ref_losses = _fabric_run(rule, STEPS)
    ctl = ref_strategy.controller
    assert [h["reason"] for h in ctl.history][:2] == ["warmup", "epoch"] and ctl.history[0]["step"] == 12
    assert ref_opt.optimizer.state_bytes() <= 0.3 * ctl.baseline_state_bytes()
    assert ctl.baseline_state_bytes() == 4 * sum(p.numel() for p in ref_model.parameters())
    path = tmp_path / "ckpt.pt"
    _fabric_run(rule, 20, save=path)
    assert torch.load(path, weights_only=True)["baoc"]["rule"] == rule
    model, opt, strategy, losses = _fabric_run(rule, STEPS, start=20, load=path)
    assert losses == {s: v for s, v in ref_losses.items() if s >= 20}
    assert strategy.controller.history == ctl.history
    _same_optimizer_state(opt.optimizer, ref_opt.optimizer)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
