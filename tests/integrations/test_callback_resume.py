"""Crash and resume, mid-warm-up and after the allocation.

A deterministic CPU run (5 optimizer steps per epoch, accumulation 2, warm-up 12 steps, a
re-evaluation scheduled every 3 epochs) is interrupted by an exception at the start of epoch 2
(step 10, in warm-up) and of epoch 4 (step 20: allocated at step 12, a re-evaluation pending and
waiting for fresh samples); ``fit(ckpt_path=last.ckpt)`` must then give the same loss at every
batch as the uninterrupted run, and end with the same allocation, formats and optimizer state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from support_lightning import DigitsModule, fit_crash_resume, loaders, make_trainer, one_thread  # noqa: F401

from lightning_baoc import BAOC, BlockwiseAdamW

EPOCHS = 8


def _baoc() -> BAOC:
    return BAOC(memory_budget=0.3, warmup_steps=12, sample_every=4, reevaluate_every_n_epochs=3, report=False)


def _fit(root: Path, crash_at: int | None = None, ckpt_path: str | None = None) -> tuple[DigitsModule, L.Trainer, BAOC]:
    L.seed_everything(0, verbose=False)
    model = DigitsModule()
    baoc = _baoc()
    return model, fit_crash_resume(root, model, baoc, EPOCHS, crash_at, ckpt_path), baoc


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[DigitsModule, L.Trainer, BAOC]:
    return _fit(tmp_path_factory.mktemp("uninterrupted"))


@pytest.mark.parametrize("crash_at", [2, 4], ids=["mid-warmup", "after-allocation"])
def test_resume_equals_uninterrupted(crash_at: int, tmp_path: Path, uninterrupted: Any) -> None:
    ref_model, ref_trainer, ref_baoc = uninterrupted
    _, crashed, crashed_baoc = _fit(tmp_path, crash_at=crash_at)
    last = tmp_path / "ckpt" / "last.ckpt"
    # Lightning loads local checkpoints with weights_only=True: the BAOC state must allow it.
    ckpt = torch.load(last, weights_only=True)
    state = next(v for k, v in ckpt["callbacks"].items() if k.startswith("BAOC"))
    assert state["phase"] == ("warmup" if crash_at == 2 else "allocated")
    assert ckpt["global_step"] == 5 * crash_at

    model, trainer, baoc = _fit(tmp_path, ckpt_path=str(last))
    resumed = {k: v for k, v in model.losses.items() if k[0] >= crash_at}
    expected = {k: v for k, v in ref_model.losses.items() if k[0] >= crash_at}
    assert resumed.keys() == expected.keys() and len(resumed) == 10 * (EPOCHS - crash_at)
    assert resumed == expected  # bit-equal on CPU
    assert baoc.allocation == ref_baoc.allocation
    assert [h["step"] for h in baoc.controller.history] == [h["step"] for h in ref_baoc.controller.history]
    opt, ref_opt = trainer.optimizers[0], ref_trainer.optimizers[0]
    assert opt.formats() == ref_opt.formats()
    assert opt.state_bytes() == ref_opt.state_bytes()
    for name in opt.named_params:
        a, b = opt.param_state(name), ref_opt.param_state(name)
        for key in ("exp_avg", "exp_avg_sq", "row", "col"):
            x, y = getattr(a, key, None), getattr(b, key, None)
            assert (x is None) == (y is None)
            if x is not None:
                assert torch.equal(x, y), (name, key)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


def test_reference_run_allocated_and_reevaluated(uninterrupted: Any) -> None:
    """The uninterrupted run itself went through warm-up, allocation and a re-evaluation."""
    _, trainer, baoc = uninterrupted
    history = baoc.controller.history
    assert [h["reason"] for h in history][:2] == ["warmup", "epoch"]
    assert history[0]["step"] == 12
    assert trainer.optimizers[0].state_bytes() <= 0.3 * 8 * sum(p.numel() for p in trainer.lightning_module.parameters())


def test_plain_adamw_checkpoint_resumes_under_baoc(tmp_path: Path) -> None:
    """A run started without BAOC continues under it: the AdamW state is taken over into the start
    allocation (within the budget from the first step), warm-up counts on from the checkpoint's step
    and ends in an allocation."""
    L.seed_everything(0, verbose=False)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=-1, save_on_train_epoch_end=True)
    trainer = make_trainer(tmp_path, max_epochs=2, accumulate_grad_batches=2, callbacks=[checkpoint], enable_checkpointing=True)
    train, _ = loaders(n_train=320)
    trainer.fit(DigitsModule(), train)
    plain_state = trainer.optimizers[0].state_dict()
    assert not isinstance(trainer.optimizers[0], BlockwiseAdamW)

    L.seed_everything(0, verbose=False)
    baoc = BAOC(memory_budget=0.3, warmup_steps=16, sample_every=4, report=False)
    probe: dict[str, Any] = {}

    class Probe(Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            opt = trainer.optimizers[0]
            probe["step"] = trainer.global_step
            probe["exp_avg"] = opt.param_state("net.0.weight").exp_avg.clone()
            probe["format"] = opt.formats()["net.0.weight"]
            probe["state_bytes"] = opt.state_bytes()

    trainer = make_trainer(tmp_path, max_epochs=6, accumulate_grad_batches=2, callbacks=[baoc, Probe()], limit_val_batches=0)
    trainer.fit(DigitsModule(), train, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert probe["step"] == 10
    first = next(iter(plain_state["state"].values()))
    # net.0.weight is the first parameter of group 0; it was taken over into its start format
    assert probe["format"] in ("int8", "bf16_momentum", "int8_factored", "fp32")
    error = (probe["exp_avg"] - first["exp_avg"]).abs().max() / first["exp_avg"].abs().max()
    assert error <= (0.0 if probe["format"] == "fp32" else 0.02)
    assert probe["state_bytes"] <= 0.3 * baoc.controller.baseline_state_bytes()
    # warm-up ends once two samples were taken after the resume (steps 12 and 16)
    assert baoc.controller.history[0]["step"] == 17
    assert trainer.optimizers[0].state_bytes() <= 0.3 * baoc.controller.fp32_state_bytes()


@pytest.mark.parametrize("crash_at", [2, 4], ids=["mid-warmup", "after-allocation"])
def test_a_fit_says_where_it_starts_once_its_states_exist_and_a_resume_says_it_resumed(
    crash_at: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh fit's summary comes after its first step (the states exist then, not at fit start); a
    resumed fit says, when its optimizer's state is restored, the step, phase and allocation it resumed
    into, and no "optimizer state 0 B" line comes before it."""
    import lightning_baoc.integrations.callback as callback

    said: list[str] = []
    monkeypatch.setattr(callback, "rank_zero_info", lambda *args, **_: said.append(" ".join(map(str, args))))
    _, trainer, baoc = _fit(tmp_path, crash_at=crash_at)
    summaries = [line for line in said if line.startswith("BAOC: phase")]
    assert summaries and summaries[0].startswith("BAOC: phase warmup, ") and " optimizer state 0 B " not in summaries[0]
    said.clear()
    _, trainer, baoc = _fit(tmp_path, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    resumed = [line for line in said if line.startswith("BAOC: resumed at step ")]
    assert len(resumed) == 1 and resumed[0].startswith(f"BAOC: resumed at step {5 * crash_at} into ")
    into = "the allocation of step 12 (" if crash_at == 4 else "the warm-up, 2 step(s) before the first allocation"
    assert into in resumed[0] and " optimizer state 0 B " not in resumed[0]
    assert not [line for line in said[: said.index(resumed[0])] if line.startswith("BAOC: phase")]
