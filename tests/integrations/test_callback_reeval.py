"""Online re-allocation through Lightning.

A plateau of the monitored metric (a constant, so it plateaus by construction) triggers a
re-evaluation after ``patience`` validation checks; the risk model is the real one, except that
at the re-evaluation the block holding the most state is told its current format became very
risky. Only the blocks whose format changed may be converted, and their new states must equal
``BlockwiseAdamW.set_formats`` applied to the states they had (state inheritance), while every
other block keeps its bytes. A budget changed mid-training is honoured at the next step boundary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from support_lightning import DigitsModule, loaders, make_trainer, one_thread  # noqa: F401

from lightning_baoc import BAOC
from lightning_baoc.control.controller import convert_optimizer
from lightning_baoc.risk import risk_table


class PlateauModule(DigitsModule):
    """Logs a constant validation metric: it never improves after its first check."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        self.log("val_const", 1.0)


class ShiftedRisk:
    """The real risk model; from the second call on, one block's current format costs 1000x more."""

    def __init__(self, baoc: BAOC) -> None:
        self.baoc = baoc
        self.calls = 0
        self.block: str | None = None

    def __call__(self, optimizer: Any, blocks: Any, statistics: Any, formats: Any = None, horizon: int = 200) -> Any:
        self.calls += 1
        table = risk_table(optimizer, blocks, statistics, formats=formats, horizon=horizon)
        if self.calls > 1:
            ctl = self.baoc.controller
            self.block = max(ctl.allocation, key=lambda b: ctl.tables.numel[b])
            current = ctl.allocation[self.block]
            table[self.block][current] = 1000.0 * table[self.block][current] + 1.0
        return table


class Spy(Callback):
    """From epoch ``start`` on, records the optimizer's state around every ``set_formats`` call."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.calls: list[dict[str, Any]] = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch != self.start:
            return
        opt = trainer.optimizers[0]
        original = opt.set_formats

        def spy(formats: Any, blocks: Any = None) -> Any:
            call = {
                "step": trainer.global_step,
                "formats": dict(formats),
                "blocks": blocks,
                "snapshot": opt.state_dict(),
                # (None after validation: Lightning releases gradients before it)
                "grads": {n: None if p.grad is None else p.grad.clone() for n, p in opt.named_params.items()},
                "before": {n: opt.param_state(n) for n in opt.named_params},
            }
            call["result"] = original(formats, blocks)
            call["after"] = {n: opt.param_state(n) for n in opt.named_params}
            self.calls.append(call)
            return call["result"]

        opt.set_formats = spy


def _same(a: Any, b: Any) -> bool:
    for key in ("exp_avg", "exp_avg_sq", "row", "col"):
        x, y = getattr(a, key), getattr(b, key)
        if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
            return False
    return True


def test_plateau_reevaluation_migrates_only_changed_blocks(tmp_path: Path) -> None:
    L.seed_everything(0, verbose=False)
    model = PlateauModule()
    baoc = BAOC(
        memory_budget=0.3, warmup_steps=12, sample_every=4, sparse_sampling=1, monitor="val_const", patience=2, report=False
    )
    risk = ShiftedRisk(baoc)
    baoc.controller.risk_fn = risk
    spy = Spy(start=3)
    trainer = make_trainer(tmp_path, max_epochs=6, accumulate_grad_batches=2, callbacks=[baoc, spy])
    train, val = loaders(n_train=320)  # 5 optimizer steps per epoch
    trainer.fit(model, train, val)

    history = baoc.controller.history
    assert [h["reason"] for h in history] == ["warmup", "plateau"]
    # allocated at step 12 (epoch 2); checks at steps 15 (best), 20 (wait 1), 25 (wait 2: plateau)
    assert history[1]["step"] == 25 and not history[1]["kept"]
    (call,) = spy.calls
    assert call["step"] == 25
    event = baoc.controller.last_event
    assert event is not None and event.reason == "plateau" and risk.block in event.changed
    # set_formats was asked for the changed blocks only
    assert set(call["formats"]) == set(event.changed)
    assert call["formats"] == {b: new for b, (_, new) in event.changed.items()}
    moved = {n for b in event.changed for n in baoc.controller.block_params[b]}
    assert call["result"] and set(call["result"]) <= moved
    # reference: the same states converted by a fresh BlockwiseAdamW
    twin = PlateauModule()
    ref = convert_optimizer(twin.configure_optimizers(), twin)
    ref.load_state_dict(call["snapshot"])
    for n, p in ref.named_params.items():
        p.grad = call["grads"][n]
    ref.set_formats(call["formats"], blocks=call["blocks"])
    for n in call["after"]:
        assert _same(call["after"][n], ref.param_state(n)), n  # inherited = converted from the old state
        if n not in moved:
            assert _same(call["after"][n], call["before"][n]), n  # untouched
    assert trainer.optimizers[0].state_bytes() <= 0.3 * baoc.controller.fp32_state_bytes()


class ChangeBudget(Callback):
    def __init__(self, baoc: BAOC, epoch: int, budget: float) -> None:
        self.baoc, self.epoch, self.budget = baoc, epoch, budget

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            self.baoc.set_budget(memory_budget=self.budget)


def test_budget_changed_mid_training(tmp_path: Path) -> None:
    L.seed_everything(0, verbose=False)
    baoc = BAOC(memory_budget=0.5, warmup_steps=12, sample_every=4, sparse_sampling=1, report=True)
    trainer = make_trainer(
        tmp_path, max_epochs=6, accumulate_grad_batches=2, callbacks=[baoc, ChangeBudget(baoc, 3, 0.15)]
    )
    train, _ = loaders(n_train=320)
    trainer.fit(DigitsModule(schedule="none"), train)
    history = baoc.controller.history
    assert [h["reason"] for h in history] == ["warmup", "budget"]
    fp32 = baoc.controller.fp32_state_bytes()
    assert history[0]["state_bytes"] <= 0.5 * fp32 and history[0]["memory_budget_bytes"] == int(0.5 * fp32)
    assert history[1]["memory_budget_bytes"] == int(0.15 * fp32)
    assert trainer.optimizers[0].state_bytes() == history[1]["state_bytes"] <= 0.15 * fp32
    assert baoc.last_record is not None and baoc.last_record["reason"] == "budget"
    assert (Path(trainer.log_dir) / "baoc_allocation.json").exists()
    assert [h["step"] for h in baoc.last_record["history"]] == [h["step"] for h in history]


def test_budget_that_cannot_be_met_mid_training_raises_before_converting(tmp_path: Path) -> None:
    L.seed_everything(0, verbose=False)
    baoc = BAOC(memory_budget=0.5, warmup_steps=12, sample_every=4, sparse_sampling=1, formats=["fp32", "bf16"], report=False)
    trainer = make_trainer(tmp_path, max_epochs=6, accumulate_grad_batches=2, callbacks=[baoc, ChangeBudget(baoc, 3, 0.2)])
    train, _ = loaders(n_train=320)
    with pytest.raises(Exception, match="smallest feasible") as info:
        trainer.fit(DigitsModule(schedule="none"), train)
    assert type(info.value).__name__ == "BudgetInfeasibleError"
    # raised at the first step boundary with two fresh samples after the change (epoch 3 starts at
    # step 15; samples since the allocation at steps 12 and 16), before any other conversion
    assert [h["reason"] for h in baoc.controller.history] == ["warmup"] and trainer.global_step == 17
    formats_after_warmup = set(trainer.optimizers[0].formats().values())
    assert formats_after_warmup <= {"fp32", "bf16"} and trainer.optimizers[0].state_bytes() > 0.2 * baoc.controller.fp32_state_bytes()
