"""BAOC under Lightning's DeepSpeedStrategy (ZeRO 2 and 3) on the CPU, gloo, 1 and 2 ranks.

Lightning's ``DeepSpeedStrategy`` refuses the CPU ("only supported on CUDA GPUs"); :class:`CPUDeepSpeed`, a
test-only subclass, skips the CUDA and device-index checks and hands DeepSpeed the local rank as its
device rank. Every rank trains the same batches (no distributed sampler) and writes what it holds at the
end (formats, state bytes, allocated storage, budget, whole weights) for the test to compare.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("deepspeed")

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy  # noqa: E402
from lightning.fabric.utilities.seed import reset_seed  # noqa: E402
from support_distributed import needs_gloo, on_lightning_ranks  # noqa: E402
from support_lightning import DigitsModule, loaders, make_trainer  # noqa: E402

from lightning_baoc import BAOC  # noqa: E402

os.environ.setdefault("DS_ACCELERATOR", "cpu")


class CPUDeepSpeed(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy on CPU ranks (tests only)."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # not DeepSpeedStrategy's: it refuses every accelerator but CUDA

    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _get_process_group_backend(self) -> str:
        return "gloo"

    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> Any:
        import deepspeed

        engine, optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank), config=self.config, model=model,
            model_parameters=filter(lambda p: p.requires_grad, model.parameters()), optimizer=optimizer,
            lr_scheduler=lr_scheduler, dist_init_required=False)
        return engine, optimizer


class RankDump(Callback):
    """Each rank writes its formats, state bytes, storage, budget and (whole) weights at the end of training."""

    def __init__(self, directory: Path, tag: str) -> None:
        self.directory, self.tag = directory, tag

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import deepspeed

        baoc = next(cb for cb in trainer.callbacks if isinstance(cb, BAOC))
        client = trainer.strategy.deepspeed_engine.basic_optimizer
        storage = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in client.inner.state_tensors()}
        with deepspeed.zero.GatheredParameters(list(pl_module.parameters()), enabled=trainer.strategy.zero_stage_3):
            weights = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        out = {"formats": client.formats(), "allocation": baoc.allocation, "phase": baoc.phase,
               "state_bytes": client.state_bytes(), "storage": sum(storage.values()),
               "budget": baoc.controller.memory_budget_bytes(), "fp32": baoc.controller.fp32_state_bytes(),
               "dtypes": sorted({str(t.dtype) for t in client.inner.state_tensors()}),
               "lrs": {str(k): v for k, v in pl_module.lrs.items()},
               "inner_lr": [g["lr"] for g in client.inner.param_groups],
               "empty": [f.name for f in client.fragment_map.fragments if not f.numel],
               "split": [f.name for f in client.fragment_map.fragments if 0 < f.numel < math.prod(f.shape)],
               "statistics": baoc.controller.sampler.statistics()}
        rank = trainer.global_rank
        (self.directory / f"{self.tag}{rank}.json").write_text(json.dumps(out))
        torch.save(weights, self.directory / f"{self.tag}{rank}.pt")


def _fit(rank: int, root: str, stage: int, world: int, epochs: int, tag: str, resume: str | None = None,
         offload: bool = False, schedule: str = "none") -> None:
    """Fit the digits MLP under ZeRO ``stage`` on ``world`` ranks (every rank the same 4 batches per epoch),
    BAOC allocating after a warm-up of 4 steps, a checkpoint each epoch; from ``resume`` if given."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    from lightning.pytorch.callbacks import ModelCheckpoint

    root_path = Path(root)
    model = DigitsModule(widths=(64, 48, 10), schedule=schedule)
    baoc = BAOC(memory_budget=0.4, warmup_steps=4, sample_every=1, calibration="prior", report=False, min_8bit_numel=0)
    checkpoint = ModelCheckpoint(dirpath=root_path / "ckpt", save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=True)
    trainer = make_trainer(root_path, devices=world, max_epochs=epochs, limit_train_batches=4, limit_val_batches=0,
                           callbacks=[baoc, checkpoint, RankDump(root_path, tag)], enable_checkpointing=True,
                           strategy=_strategy(stage, offload), use_distributed_sampler=False)
    train, _ = loaders(n_train=64, batch_size=16)
    trainer.fit(model, train, ckpt_path=resume)


def _strategy(stage: int, offload: bool) -> CPUDeepSpeed:
    if not offload:
        return CPUDeepSpeed(stage=stage)
    config = {"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}},
              "zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True,
              "train_micro_batch_size_per_gpu": 16}
    return CPUDeepSpeed(config=config)


def _read(root: Path, tag: str, world: int) -> list[dict]:
    return [json.loads((root / f"{tag}{r}.json").read_text()) for r in range(world)]


def _check_allocated(ranks: list[dict]) -> None:
    assert ranks[0]["phase"] == "allocated"
    assert all(r["formats"] == ranks[0]["formats"] for r in ranks)  # the same formats on every rank
    assert set(ranks[0]["formats"].values()) != {"fp32"}  # the budget made it convert
    for r in ranks:
        assert r["state_bytes"] == r["storage"]  # each rank's bytes are its allocated storage
        assert r["state_bytes"] <= r["budget"] < r["fp32"]  # within the per-rank budget


@pytest.mark.slow  # two ranks; ZeRO 1/2 under Lightning and Fabric's ZeRO-2 run by default
@needs_gloo
def test_baoc_under_zero_3_on_two_ranks(tmp_path: Path) -> None:
    on_lightning_ranks(_fit, 2, str(tmp_path), 3, 2, 2, "run", None, False, "cosine")
    ranks = _read(tmp_path, "run", 2)
    _check_allocated(ranks)
    # the user's cosine LambdaLR, rebound to the client, drives the fragments' learning rate
    lrs = ranks[0]["lrs"]
    assert lrs["0"][0] > lrs[str(len(lrs) - 1)][0]
    assert ranks[0]["inner_lr"] == lrs[str(len(lrs) - 1)]  # the last step ran at the scheduler's rate


def _crash_resume(tmp_path: Path, stage: int, world: int) -> list[dict]:
    """4 epochs straight; 2 epochs (the crash after the checkpoint of epoch 2), then a resume to 4: the
    resumed run's weights equal the straight run's bit for bit, its formats the same."""
    on_lightning_ranks(_fit, world, str(tmp_path / "a"), stage, world, 4, "straight")
    on_lightning_ranks(_fit, world, str(tmp_path / "b"), stage, world, 2, "first")
    ckpt = tmp_path / "b" / "ckpt" / "epoch=1-step=8.ckpt"
    assert ckpt.exists(), sorted(p.name for p in (tmp_path / "b" / "ckpt").iterdir())
    on_lightning_ranks(_fit, world, str(tmp_path / "b"), stage, world, 4, "resumed", str(ckpt))
    straight, resumed = _read(tmp_path / "a", "straight", world), _read(tmp_path / "b", "resumed", world)
    for r in range(world):
        assert resumed[r]["formats"] == straight[r]["formats"]
        assert resumed[r]["state_bytes"] == straight[r]["state_bytes"]
        want = torch.load(tmp_path / "a" / f"straight{r}.pt", weights_only=True)
        got = torch.load(tmp_path / "b" / f"resumed{r}.pt", weights_only=True)
        for name in want:
            assert torch.equal(got[name], want[name]), f"rank {r}: {name} differs after crash and resume"
    return resumed


@pytest.mark.slow
@needs_gloo
def test_crash_and_resume_bit_equal_zero_3_two_ranks(tmp_path: Path) -> None:
    _check_allocated(_crash_resume(tmp_path, 3, 2))


@pytest.mark.slow
@needs_gloo
def test_crash_and_resume_bit_equal_zero_2_one_rank(tmp_path: Path) -> None:
    _check_allocated(_crash_resume(tmp_path, 2, 1))


@pytest.mark.parametrize(("offload", "extra", "match"), [
    ({"device": "cpu"}, {}, "offload_optimizer device 'cpu'.*zero_force_ds_cpu_optimizer"),
    ({"device": "nvme", "nvme_path": "/tmp"}, {"zero_force_ds_cpu_optimizer": False}, "offload_optimizer device 'nvme'"),
])
def test_deepspeed_optimizer_offload_refused_where_it_cannot_combine(offload: dict, extra: dict, match: str) -> None:
    """DeepSpeed's optimizer offload to the CPU combines with BAOC's formats (the client's states live with
    the offloaded partitions) once DeepSpeed accepts a client optimizer there; NVMe does not combine."""
    from types import SimpleNamespace

    strategy = object.__new__(DeepSpeedStrategy)  # the check reads the type and the config only
    strategy.config = {"zero_optimization": {"stage": 3, "offload_optimizer": offload}, **extra}
    baoc = BAOC(memory_budget=0.3)
    module = DigitsModule()
    with pytest.raises(RuntimeError, match=match):
        baoc.setup(SimpleNamespace(strategy=strategy, callbacks=[baoc]), module, "fit")  # type: ignore[arg-type]
    assert "configure_optimizers" not in vars(module)  # refused before anything was wrapped


@pytest.mark.slow
@needs_gloo
def test_baoc_with_deepspeed_cpu_offload(tmp_path: Path) -> None:
    """With offload_optimizer device 'cpu' (and zero_force_ds_cpu_optimizer false) BAOC allocates over the
    offloaded partitions."""
    on_lightning_ranks(_fit, 2, str(tmp_path), 3, 2, 2, "run", None, True)
    _check_allocated(_read(tmp_path, "run", 2))


@needs_gloo
@pytest.mark.slow  # two ranks under Lightning; ZeRO on two ranks is held by default by tests/optim/test_deepspeed.py
@pytest.mark.parametrize("stage", [1, 2])
def test_baoc_under_zero_1_and_2_on_two_ranks(tmp_path: Path, stage: int) -> None:
    """ZeRO 1 and 2 cut the flattened groups: one rank holds none of some parameters, parts of others. Every rank
    samples the whole gradient of every block (its part summed with the others'), so the statistics rank zero
    decides on are the same on both ranks, no block missing."""
    on_lightning_ranks(_fit, 2, str(tmp_path), stage, 2, 2, "run")
    ranks = _read(tmp_path, "run", 2)
    _check_allocated(ranks)
    assert ranks[0]["empty"] and ranks[1]["empty"] and ranks[0]["split"]  # the layout this test is about
    stats = ranks[0]["statistics"]
    for block, s in stats.items():
        other = ranks[1]["statistics"][block]
        assert all(v == other[k] or (math.isnan(v) and math.isnan(other[k])) for k, v in s.items()), (block, s, other)
        assert s["samples"] > 0 and s["missing"] == 0, (block, s)



@pytest.mark.slow
@needs_gloo
def test_zero_2_on_two_ranks_samples_what_one_rank_samples(tmp_path: Path) -> None:
    """The same run on one rank (every parameter whole) and on two (cut): the same formats, and the statistics
    of the whole gradients, up to the gradients' own differences (DeepSpeed's reduction over two ranks)."""
    on_lightning_ranks(_fit, 1, str(tmp_path), 2, 1, 2, "one")
    on_lightning_ranks(_fit, 2, str(tmp_path), 2, 2, 2, "two")
    one, two = _read(tmp_path, "one", 1)[0], _read(tmp_path, "two", 2)[0]
    assert one["formats"] == two["formats"]
    for block, s in one["statistics"].items():
        other = two["statistics"][block]
        assert s["samples"] == other["samples"] and s["numel"] == other["numel"]
        for key in ("anisotropy", "stability", "snr"):
            if not math.isnan(s[key]):
                assert other[key] == pytest.approx(s[key], rel=1e-3), (block, key)


@pytest.mark.slow
@needs_gloo
def test_crash_and_resume_bit_equal_zero_2_two_ranks(tmp_path: Path) -> None:
    _check_allocated(_crash_resume(tmp_path, 2, 2))
