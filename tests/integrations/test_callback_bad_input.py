"""Bad input, unsupported set-ups, manual optimization, configuration.

Each error must name the argument or object, the value, what is allowed and the fix; nothing may
be converted before it is raised.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from support_lightning import DigitsModule, loaders, make_trainer, one_thread  # noqa: F401

from lightning_baoc import BAOC, BlockwiseAdamW, BudgetInfeasibleError
from lightning_baoc.costs.calibration import memory_table


def _fit(
    tmp: Path, baoc: BAOC, model: L.LightningModule | None = None, ckpt_path: str | None = None, **kwargs: Any
) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    settings: dict[str, Any] = dict(max_epochs=3, accumulate_grad_batches=2, callbacks=[baoc])
    settings.update(kwargs)
    trainer = make_trainer(tmp, **settings)
    train, _ = loaders(n_train=320)
    trainer.fit(model or DigitsModule(), train, ckpt_path=ckpt_path)
    return trainer


def test_infeasible_budget_raises_before_training_naming_the_smallest_feasible(tmp_path: Path) -> None:
    baoc = BAOC(memory_budget=0.1, warmup_steps=12, sample_every=4, formats=["fp32", "bf16", "int8"])
    with pytest.raises(BudgetInfeasibleError) as info:
        _fit(tmp_path, baoc)
    message = str(info.value)
    assert "memory_budget=0.1" in message and "smallest feasible" in message
    assert "No format was converted" in message
    # the smallest feasible memory: every block in its cheapest allowed format
    ctl = baoc.controller
    table = memory_table(ctl.tables.shapes, "cpu", ["fp32", "bf16", "int8"])
    assert info.value.min_memory == sum(min(row.values()) for row in table.values())
    assert info.value.min_memory > 0.1 * ctl.fp32_state_bytes()
    opt = baoc.optimizer
    assert isinstance(opt, BlockwiseAdamW) and opt.state_bytes() == 0  # no step was taken


def test_unsupported_optimizer_raises_at_fit_start_naming_the_supported(tmp_path: Path) -> None:
    baoc = BAOC(memory_budget=0.3, warmup_steps=12, sample_every=4)
    with pytest.raises(TypeError, match=r"take over Adagrad .*supported: \['torch\.optim\.AdamW'") as info:
        _fit(tmp_path, baoc, DigitsModule(optimizer="adagrad"))
    assert "configure_optimizers" in str(info.value)
    assert baoc.optimizer is None


def test_adam_with_l2_is_taken_over(tmp_path: Path) -> None:
    trainer = _fit(tmp_path, BAOC(memory_budget=0.3, warmup_steps=12, sample_every=4, report=False), DigitsModule(optimizer="adam"))
    opt = trainer.optimizers[0]
    assert type(opt).__name__ == "Adam" and not opt.param_groups[0]["decoupled_weight_decay"]
    assert opt.state_bytes() <= 0.3 * 8 * sum(p.numel() for p in trainer.lightning_module.parameters())


@pytest.mark.parametrize("strategy", ["FSDPStrategy"])
def test_sharding_strategies_are_refused_at_setup(strategy: str) -> None:
    import lightning.pytorch.strategies as strategies

    # built without __init__: the check only looks at the type
    instance = object.__new__(getattr(strategies, strategy))
    baoc = BAOC(memory_budget=0.3)
    trainer = SimpleNamespace(strategy=instance, callbacks=[baoc])
    with pytest.raises(RuntimeError, match=rf"BAOC cannot run under {strategy}.*strategy='ddp'"):
        baoc.setup(trainer, None, "fit")  # type: ignore[arg-type]
    baoc.setup(trainer, None, "validate")  # only training needs the optimizer


def test_model_parallel_is_refused_only_with_full_checkpoints() -> None:
    """FSDP2 runs (tests/integrations/test_callback_model_parallel.py); its full, gathered checkpoints
    are refused at setup, naming the default that works."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    baoc = BAOC(memory_budget=0.3)
    full = SimpleNamespace(strategy=ModelParallelStrategy(save_distributed_checkpoint=False), callbacks=[baoc])
    with pytest.raises(RuntimeError, match=r"save_distributed_checkpoint=False.*Keep the default save_distributed_checkpoint=True"):
        baoc.setup(full, None, "fit")  # type: ignore[arg-type]
    baoc.setup(SimpleNamespace(strategy=ModelParallelStrategy(), callbacks=[baoc]), None, "fit")  # type: ignore[arg-type]


def test_two_baoc_callbacks_are_refused(tmp_path: Path) -> None:
    # (two with the same state key are already refused by Lightning when the Trainer is built)
    two = [BAOC(memory_budget=0.3), BAOC(memory_budget=0.5, granularity="param")]
    with pytest.raises(RuntimeError, match="keep a single BAOC"):
        _fit(tmp_path, two[0], callbacks=two)


def test_warmup_longer_than_the_run_warns_and_never_converts(tmp_path: Path) -> None:
    baoc = BAOC(memory_budget=0.3, warmup_steps=500)
    with pytest.warns(UserWarning, match=r"warmup_steps=500\) is longer than this run \(15 optimizer steps\)"):
        trainer = _fit(tmp_path, baoc)
    assert baoc.phase == "warmup" and baoc.allocation == {}
    # the states stay in the start allocation: within the budget, from the prior risk
    opt = trainer.optimizers[0]
    assert set(opt.formats().values()) - {"fp32"} and baoc.controller.start_allocation
    assert opt.peak_state_bytes() <= baoc.controller.memory_budget_bytes()


def test_manual_optimization_is_supported(tmp_path: Path) -> None:
    model = DigitsModule(manual=True)
    baoc = BAOC(memory_budget=0.3, warmup_steps=12, sample_every=4, report=False)
    trainer = _fit(tmp_path, baoc, model, accumulate_grad_batches=1, max_epochs=2)
    assert trainer.global_step == 20 and baoc.controller.history[0]["step"] == 12
    assert all(model.optimizer_checks)  # self.optimizers() handed out the installed optimizer
    assert trainer.optimizers[0].state_bytes() <= 0.3 * baoc.controller.fp32_state_bytes()


def test_hydra_style_omegaconf_arguments_checkpoint_under_weights_only(tmp_path: Path) -> None:
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create(
        {
            "memory_budget": "30%",
            "warmup_steps": 12,
            "sample_every": 4,
            "blocks": {"hidden": ["net.0.*", "net.3.*"]},
            "formats": ["fp32", "bf16", "int8", "int8_factored", "nomomentum"],
            "report": False,
        }
    )
    # what hydra.utils.instantiate passes: DictConfig / ListConfig nodes as arguments
    baoc = BAOC(**{k: cfg[k] for k in cfg})
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=-1, save_on_train_epoch_end=True)
    trainer = _fit(tmp_path, baoc, callbacks=[baoc, ckpt], enable_checkpointing=True)
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    saved = next(v for k, v in state["callbacks"].items() if k.startswith("BAOC"))
    assert saved["phase"] == "allocated" and saved["memory_budget"] == "30%"
    assert "hidden" in saved["allocation"]
    # and the run resumes from it (Lightning loads it with weights_only=True too)
    again = BAOC(**{k: cfg[k] for k in cfg})
    resumed = _fit(tmp_path, again, callbacks=[again], max_epochs=4, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert again.allocation == baoc.allocation
    assert resumed.optimizers[0].formats() == trainer.optimizers[0].formats()


def test_lightning_cli_configures_the_callback(tmp_path: Path) -> None:
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    cli = LightningCLI(
        DigitsModule,
        run=False,
        save_config_callback=None,
        args=[
            "--trainer.callbacks+=lightning_baoc.BAOC",
            "--trainer.callbacks.memory_budget=0.25",
            "--trainer.callbacks.warmup_steps=50",
            "--trainer.callbacks.formats=[fp32, int8, bf16]",
            "--trainer.callbacks.blocks={head: net.6.*}",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.logger=false",
        ],
    )
    (baoc,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, BAOC)]
    assert baoc.config.memory_budget == 0.25 and baoc.config.warmup_steps == 50
    assert baoc.config.formats == ["fp32", "int8", "bf16"] and baoc.config.blocks == {"head": "net.6.*"}
    cli_abs = LightningCLI(
        DigitsModule,
        run=False,
        save_config_callback=None,
        args=["--trainer.callbacks+=lightning_baoc.BAOC", "--trainer.callbacks.memory_budget=512KiB", "--trainer.logger=false"],
    )
    assert [cb for cb in cli_abs.trainer.callbacks if isinstance(cb, BAOC)][0].config.memory_budget == "512KiB"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"memory_budget": 2.0}, r"memory_budget"),
        ({"memory_budget": 0.3, "warmup_steps": 3}, r"warmup_steps=3"),
        ({"memory_budget": 0.3, "formats": ["int4"]}, r"did you mean 'int8'.*AdamW's formats: \['fp32'.*SGD's and Lion's: \['fp32', 'bf16', 'int8', 'none'\]"),
        ({"memory_budget": 0.3, "monitor": 3}, r"monitor"),
    ],
)
def test_constructor_validates(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        BAOC(**kwargs)

