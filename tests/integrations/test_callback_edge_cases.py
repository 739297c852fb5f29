"""Edge cases through Lightning: ``BackboneFinetuning`` after the allocation, resumes
under changed settings, matplotlib missing, optimizers that name their parameters their own way,
bf16 parameters, and where the report is written.

Tiny runs on digits: 5 optimizer steps per epoch, warm-up of 8 steps sampled every 4.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, Callback, ModelCheckpoint
from support_lightning import DigitsModule, loaders, make_trainer, one_thread  # noqa: F401
from torch import nn

import lightning_baoc.integrations.callback as callback_module
from lightning_baoc import BAOC, BlockwiseAdamW, partition
from lightning_baoc.report import allocation as report_module

WARMUP, EVERY, N_TRAIN = 8, 4, 160  # 160 samples / batches of 32: 5 steps per epoch


def _baoc(**kwargs: Any) -> BAOC:
    settings: dict[str, Any] = dict(memory_budget=0.3, warmup_steps=WARMUP, sample_every=EVERY, report=False)
    settings.update(kwargs)
    return BAOC(**settings)


def _trained_numel(optimizer: torch.optim.Optimizer) -> int:
    return sum(p.numel() for g in optimizer.param_groups for p in g["params"] if p.requires_grad)


class StateProbe(Callback):
    """After every optimizer step: the optimizer's state bytes and the AdamW state of the parameters
    it trains; before every step: the formats held."""

    def __init__(self) -> None:
        self.after: list[tuple[int, int, int]] = []  # (step, state bytes, 8 x trained elements)
        self.before: list[tuple[int, set[str]]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.before.append((trainer.global_step, set(trainer.optimizers[0].formats().values())))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        opt = trainer.optimizers[0]
        self.after.append((trainer.global_step, int(opt.state_bytes()), 8 * _trained_numel(opt)))


# ---------------------------------------------------------------------------- 2: BackboneFinetuning


class TransferModule(DigitsModule):
    """A backbone (frozen by BackboneFinetuning at set-up) and a head; the optimizer gets the head."""

    def __init__(self) -> None:
        super().__init__(schedule="none")
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 128), nn.GELU())
        self.head = nn.Linear(128, 10)
        del self.net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def test_backbone_unfrozen_after_the_allocation_stays_within_the_budget(tmp_path: Path) -> None:
    L.seed_everything(0, verbose=False)
    baoc, probe = _baoc(), StateProbe()
    unfreeze = BackboneFinetuning(unfreeze_backbone_at_epoch=3, backbone_initial_lr=1e-3)
    trainer = make_trainer(tmp_path, max_epochs=5, callbacks=[baoc, unfreeze, probe], limit_val_batches=0)
    model = TransferModule()
    trainer.fit(model, loaders(n_train=N_TRAIN)[0])
    reasons = [(h["reason"], h["step"]) for h in baoc.controller.history]
    assert reasons[0] == ("warmup", WARMUP) and ("params", 15) in reasons
    assert baoc.controller.fp32_state_bytes() == 8 * sum(p.numel() for p in model.parameters())
    after = [(step, used, fp32) for step, used, fp32 in probe.after if step > WARMUP]
    assert max(step for step, _, _ in after) == 25 and any(step > 15 for step, _, _ in after)
    for step, used, fp32 in after:  # every step after the allocation, the unfreeze included
        assert used <= 0.3 * fp32, (step, used, fp32)
    assert fp32 == 8 * sum(p.numel() for p in model.parameters())  # the backbone is trained by the end


@pytest.mark.parametrize("baoc_first", [True, False], ids=["baoc-before-finetuning", "baoc-after-finetuning"])
def test_resume_after_backbone_unfrozen_keeps_its_state_in_either_callback_order(tmp_path: Path, baoc_first: bool) -> None:
    """BaseFinetuning restores the resumed run's param groups by assigning optimizer.param_groups
    (after BAOC installed its optimizer when BAOC is listed first): the backbone's state must load."""

    def callbacks(baoc: BAOC) -> list[Callback]:
        unfreeze = BackboneFinetuning(unfreeze_backbone_at_epoch=3, backbone_initial_lr=1e-3)
        return [baoc, unfreeze] if baoc_first else [unfreeze, baoc]

    L.seed_everything(0, verbose=False)
    first = _baoc()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_on_train_epoch_end=True)
    trainer = make_trainer(tmp_path, max_epochs=5, callbacks=[*callbacks(first), ckpt], enable_checkpointing=True, limit_val_batches=0)
    trainer.fit(TransferModule(), loaders(n_train=N_TRAIN)[0])
    saved_steps = {n: trainer.optimizers[0].step_count(n) for n in trainer.optimizers[0].named_params}
    assert saved_steps["backbone.0.weight"] == 10  # epochs 3 and 4

    L.seed_everything(0, verbose=False)
    resumed, probe = _baoc(), StateProbe()
    trainer = make_trainer(tmp_path, max_epochs=7, callbacks=[*callbacks(resumed), probe], limit_val_batches=0)
    model = TransferModule()
    trainer.fit(model, loaders(n_train=N_TRAIN)[0], ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    opt = trainer.optimizers[0]
    assert trainer.global_step == 35 and resumed.phase == "allocated"
    assert opt.step_count("backbone.0.weight") >= saved_steps["backbone.0.weight"]  # restored, not restarted
    assert set(opt.named_params) == set(saved_steps)
    budget = 0.3 * resumed.controller.fp32_state_bytes()
    for step, used, _ in probe.after:
        assert used <= budget, (step, used, budget)


def test_parameters_assigned_to_param_groups_are_named_from_the_state_dict_at_load() -> None:
    torch.manual_seed(0)
    head, backbone = nn.Linear(8, 4), nn.Linear(8, 8)
    model = nn.ModuleDict({"head": head, "bb": backbone})
    source = BlockwiseAdamW(list(head.parameters()), param_names=model, state_format="int8", min_8bit_numel=0)
    source.add_param_group({"params": list(backbone.parameters())})
    for p in [*head.parameters(), *backbone.parameters()]:
        p.grad = torch.randn_like(p)
    source.step()
    saved = source.state_dict()

    target = BlockwiseAdamW(list(head.parameters()), param_names=model, state_format="int8", min_8bit_numel=0)
    target.param_groups = [target.param_groups[0], {**target.param_groups[0], "params": list(backbone.parameters())}]
    broken = {**saved, "param_groups": [saved["param_groups"][0], {**saved["param_groups"][1], "lr": float("nan")}]}
    with pytest.raises(ValueError):
        target.load_state_dict(broken)
    assert set(target.named_params) == {"head.weight", "head.bias"}  # a refused load adopts nothing
    target.load_state_dict(saved)
    assert set(target.named_params) == {"head.weight", "head.bias", "bb.weight", "bb.bias"}
    assert target.step_count("bb.weight") == 1 and target.formats()["bb.weight"] == "int8"


# ---------------------------------------------------------------------------- 3: changed settings at resume


def _first_run(root: Path, baoc: BAOC, module: L.LightningModule | None = None) -> Path:
    L.seed_everything(0, verbose=False)
    ckpt = ModelCheckpoint(dirpath=root / "ckpt", save_last=True, save_on_train_epoch_end=True)
    trainer = make_trainer(root, max_epochs=3, callbacks=[baoc, ckpt], enable_checkpointing=True, limit_val_batches=0)
    trainer.fit(module or DigitsModule(schedule="none"), loaders(n_train=N_TRAIN)[0])
    assert baoc.phase == "allocated"
    return root / "ckpt" / "last.ckpt"


@pytest.fixture(scope="module")
def allocated_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    baoc = _baoc()
    last = _first_run(tmp_path_factory.mktemp("first"), baoc)
    return last, baoc.allocation


def _resume(root: Path, last: Path, baoc: BAOC, module: L.LightningModule | None = None) -> StateProbe:
    L.seed_everything(0, verbose=False)
    probe = StateProbe()
    trainer = make_trainer(root, max_epochs=4, callbacks=[baoc, probe], limit_val_batches=0)
    trainer.fit(module or DigitsModule(schedule="none"), loaders(n_train=N_TRAIN)[0], ckpt_path=str(last))
    return probe


def test_resume_with_a_format_dropped_from_the_menu_never_steps_in_it(
    tmp_path: Path, allocated_checkpoint: tuple[Path, dict[str, str]]
) -> None:
    last, allocation = allocated_checkpoint
    used = set(allocation.values()) - {"fp32"}
    assert used
    menu = [f for f in ("fp32", "bf16_momentum", "bf16", "nomomentum", "int8", "int8_factored", "factored") if f not in used]
    baoc = _baoc(formats=menu)
    probe = _resume(tmp_path, last, baoc)
    first = probe.before[0][0]
    assert first == 15 and [(h["reason"], h["step"]) for h in baoc.controller.history][-1] == ("settings", 15)
    for step, held in probe.before:  # formats held when each step ran
        assert held <= set(menu), (step, held)
    assert set(baoc.allocation.values()) <= set(menu)


@pytest.mark.parametrize(
    "change", [{"memory_budget": 0.15}, {"max_block_risk": 0.0}, {"granularity": "param"}], ids=["budget", "risk-cap", "granularity"]
)
def test_resume_with_changed_allocation_settings_reevaluates_before_the_first_step(
    change: dict[str, Any], tmp_path: Path, allocated_checkpoint: tuple[Path, dict[str, str]]
) -> None:
    last, _ = allocated_checkpoint
    baoc = _baoc(**change)
    probe = _resume(tmp_path, last, baoc)
    history = baoc.controller.history
    assert [h["reason"] for h in history][0] == "warmup" and (history[-1]["reason"], history[-1]["step"]) == ("settings", 15)
    budget = change.get("memory_budget", 0.3)
    for step, used, fp32 in probe.after:  # every step of the resumed run
        assert used <= budget * fp32, (step, used)
    if "granularity" in change:
        names = [n for n, _ in DigitsModule().named_parameters()]
        assert list(baoc.allocation) == names  # one block per parameter now


def test_resume_whose_parameters_have_no_saved_format_is_refused(tmp_path: Path) -> None:
    class FrozenFirst(DigitsModule):
        def __init__(self) -> None:
            super().__init__(schedule="none")
            self.net[0].requires_grad_(False)

    last = _first_run(tmp_path / "frozen", _baoc(), FrozenFirst())
    with pytest.raises(ValueError, match=r"net\.0\.weight.*have no format.*trainable parameters differ.*without ckpt_path"):
        _resume(tmp_path, last, _baoc())  # net.0 is trainable now: the checkpoint has no format for it


# ---------------------------------------------------------------------------- 9 and 14: reports


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain install: matplotlib cannot be imported."""
    monkeypatch.setattr(report_module, "_MATPLOTLIB_AVAILABLE", False, raising=False)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)


def test_default_report_works_without_matplotlib(tmp_path: Path, no_matplotlib: None) -> None:
    with pytest.raises(ModuleNotFoundError, match=r"report='png'.*pip install matplotlib"):
        _baoc(report="png")  # an explicit request fails at construction, not after the warm-up
    with pytest.warns(UserWarning, match=r"matplotlib is not installed, so baoc_allocation\.png is skipped.*pip install matplotlib"):
        baoc = _baoc(report=True)
    trainer = make_trainer(tmp_path, max_epochs=2, callbacks=[baoc], limit_val_batches=0)
    trainer.fit(DigitsModule(schedule="none"), loaders(n_train=N_TRAIN)[0])
    assert baoc.phase == "allocated"
    assert (Path(trainer.log_dir) / "baoc_allocation.json").exists()
    assert not (Path(trainer.log_dir) / "baoc_allocation.png").exists()


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_report_location_is_printed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Read what the callback says, not a logger whose level and handlers other tests may change.
    said: list[str] = []
    monkeypatch.setattr(callback_module, "rank_zero_info", lambda message, *a, **k: said.append(str(message)))
    lines = Lines()
    lines.lines = said
    baoc = _baoc(report=True, reevaluate_every_n_epochs=1, sparse_sampling=1)
    trainer = make_trainer(tmp_path, max_epochs=5, callbacks=[baoc], limit_val_batches=0)
    trainer.fit(DigitsModule(schedule="none"), loaders(n_train=N_TRAIN)[0])
    assert len(baoc.controller.history) >= 2  # reports were written more than once
    where = [line for line in lines.lines if "report written to" in line]
    assert len(where) == 1
    assert str(Path(trainer.log_dir) / "{baoc_allocation.json, baoc_allocation.png}") in where[0]
    assert (Path(trainer.log_dir) / "baoc_allocation.png").exists()


# ---------------------------------------------------------------------------- 12: the optimizer's own names


class OptimizerForms(DigitsModule):
    """``configure_optimizers`` in the forms BAOC once refused."""

    def __init__(self, form: str) -> None:
        super().__init__(schedule="none")
        self.form = form

    def configure_optimizers(self) -> Any:
        if self.form == "blockwise-positional":
            return BlockwiseAdamW(self.parameters(), lr=self.lr)  # names "0", "1", ...
        if self.form == "adamw-repeated-names":  # each layer's named_parameters(): "weight" and "bias" five times
            return torch.optim.AdamW([np for m in self.net for np in m.named_parameters()],
                                     lr=self.lr)
        return torch.optim.AdamW(self.net.named_parameters(), lr=self.lr)  # names without "net."


class PlainDigits(L.LightningModule):
    """No configure_optimizers: LightningCLI's ``--optimizer`` builds it from ``self.parameters()``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = DigitsModule(schedule="none")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.inner(x), y)


def _assert_allocated_within_budget(baoc: BAOC, trainer: L.Trainer) -> None:
    assert [h["reason"] for h in baoc.controller.history] == ["warmup"]
    # every module of the model is a block (the optimizer's names play no part)
    assert list(baoc.allocation) == list(partition(trainer.lightning_module))
    assert trainer.optimizers[0].state_bytes() <= 0.3 * baoc.controller.fp32_state_bytes()


@pytest.mark.parametrize("form", ["blockwise-positional", "adamw-named-submodule", "adamw-repeated-names"])
def test_optimizers_naming_parameters_their_own_way_are_allocated(form: str, tmp_path: Path) -> None:
    baoc = _baoc()
    trainer = make_trainer(tmp_path, max_epochs=2, callbacks=[baoc], limit_val_batches=0)
    trainer.fit(OptimizerForms(form), loaders(n_train=N_TRAIN)[0])
    _assert_allocated_within_budget(baoc, trainer)
    assert list(baoc.allocation) == ["net.0", "net.1", "net.3", "net.4", "net.6"]
    if form == "adamw-repeated-names":  # named from the module where the optimizer's names repeat
        assert sorted(trainer.optimizers[0].named_params) == sorted(n for n, _ in trainer.lightning_module.named_parameters())


def test_an_optimizer_repeating_names_resumes_to_the_bit(tmp_path: Path) -> None:
    from support_lightning import fit_crash_resume

    straight_model = OptimizerForms("adamw-repeated-names")
    fit_crash_resume(tmp_path / "straight", straight_model, _baoc(), epochs=4)
    fit_crash_resume(tmp_path / "crashed", OptimizerForms("adamw-repeated-names"), _baoc(), epochs=4, crash_at=2)
    resumed_model = OptimizerForms("adamw-repeated-names")
    trainer = fit_crash_resume(tmp_path / "crashed", resumed_model, _baoc(), epochs=4,
                               ckpt_path=str(tmp_path / "crashed" / "ckpt" / "last.ckpt"))
    assert trainer.optimizers[0].state_bytes() <= 0.3 * trainer.callbacks[0].controller.fp32_state_bytes()
    after = {k: v for k, v in straight_model.losses.items() if k[0] >= 2}
    assert after and {k: v for k, v in resumed_model.losses.items() if k[0] >= 2} == after
    for a, b in zip(straight_model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)


def test_lightning_cli_optimizer_blockwise_adamw_is_allocated(tmp_path: Path) -> None:
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    cli = LightningCLI(
        PlainDigits,
        run=False,
        save_config_callback=None,
        args=[
            "--optimizer=lightning_baoc.BlockwiseAdamW",
            "--optimizer.lr=0.003",
            "--trainer.callbacks+=lightning_baoc.BAOC",
            "--trainer.callbacks.memory_budget=0.3",
            f"--trainer.callbacks.warmup_steps={WARMUP}",
            f"--trainer.callbacks.sample_every={EVERY}",
            "--trainer.callbacks.report=false",
            "--trainer.max_epochs=2",
            "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            "--trainer.enable_checkpointing=false",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.logger=false",
        ],
    )
    (baoc,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, BAOC)]
    cli.trainer.fit(cli.model, loaders(n_train=N_TRAIN)[0])
    _assert_allocated_within_budget(baoc, cli.trainer)
    assert list(baoc.allocation)[0] == "inner.net.0" and len(baoc.allocation) == 5


# ---------------------------------------------------------------------------- 13: bf16 parameters


class Bf16Digits(DigitsModule):
    def __init__(self) -> None:
        super().__init__(schedule="none")
        self.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.to(torch.bfloat16)).float()


def _adamw_moment_bytes(module: L.LightningModule) -> int:
    """Bytes of torch AdamW's moments on ``module``'s parameters after one real step."""
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    x, y = next(iter(loaders(n_train=N_TRAIN)[0]))
    nn.functional.cross_entropy(module(x), y).backward()
    opt.step()
    return sum(t.nbytes for s in opt.state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq"))


def test_bf16_model_warms_up_within_adamw_state_and_reports_savings_against_it(tmp_path: Path) -> None:
    adamw_bytes = _adamw_moment_bytes(Bf16Digits())
    baoc, probe = _baoc(memory_budget=0.5), StateProbe()
    trainer = make_trainer(tmp_path, max_epochs=2, callbacks=[baoc, probe], limit_val_batches=0)
    trainer.fit(Bf16Digits(), loaders(n_train=N_TRAIN)[0])
    warmup = [used for step, used, _ in probe.after if step < WARMUP]
    assert len(warmup) == WARMUP - 1 and max(warmup) <= adamw_bytes  # never more than torch's AdamW
    record = baoc.last_record
    assert record is not None and record["baseline_state_bytes"] == adamw_bytes
    assert record["saved_fraction"] == pytest.approx(1 - record["state_bytes"] / adamw_bytes)
    assert record["state_bytes"] <= 0.5 * adamw_bytes and record["memory_budget_bytes"] == int(0.5 * adamw_bytes)


# ---------------------------------------------------------------------------- 2, Fabric: add_param_group


def test_fabric_param_group_added_after_the_allocation_stays_within_the_budget() -> None:
    from lightning.fabric import Fabric
    from support import digits_tensors, mlp

    from lightning_baoc import BAOCStrategy

    strategy = BAOCStrategy(memory_budget=0.3, warmup_steps=WARMUP, sample_every=EVERY, report=False)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    model = mlp((64, 128, 128, 10), seed=0)
    model, opt = fabric.setup(model, torch.optim.AdamW(model[3].parameters(), lr=3e-3))  # the second Linear
    xtr, ytr, _, _ = digits_tensors()
    inner = opt.optimizer
    used: list[tuple[int, int]] = []
    for step in range(WARMUP + 6):
        if step == WARMUP + 1:
            inner.add_param_group({"params": list(model.module[0].parameters()), "lr": 1e-3})
        x, y = xtr[32 * step : 32 * step + 32], ytr[32 * step : 32 * step + 32]
        fabric.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
        used.append((inner.state_bytes(), 8 * _trained_numel(inner)))
    history = [(h["reason"], h["step"]) for h in strategy.controller.history]
    assert history == [("warmup", WARMUP), ("params", WARMUP + 1)]
    assert all(state <= 0.3 * fp32 for state, fp32 in used[WARMUP:]) and used[-1][1] > used[WARMUP][1]
    strategy.teardown()
