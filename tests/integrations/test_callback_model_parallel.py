"""BAOC under Lightning's ``ModelParallelStrategy`` (FSDP2), 2 CPU ranks (gloo).

The LightningModule shards itself in ``configure_model`` (``fully_shard`` per layer over the
data-parallel mesh); ``configure_optimizers`` returns a plain AdamW, which BAOC takes over. The
uninterrupted run (8 epochs of 5 optimizer steps, accumulation 2, clipping) warms up, allocates at
step 12 and re-evaluates; every rank holds the same formats, within the per-rank budget. A second
run crashes at the start of epoch 4 (after the allocation) and resumes from the last distributed
checkpoint (``torch.distributed.checkpoint``: a directory of per-rank shards and ``meta.pt``):
every loss from then on, the allocation, its history, the formats, each rank's weights and its
compact optimizer state equal the uninterrupted run's, to the bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support_distributed import needs_gloo, on_lightning_ranks

pytestmark = needs_gloo
WORLD = 2
EPOCHS = 8
CRASH_AT = 4


def _fit(root: Path, crash_at: int | None = None, ckpt_path: str | None = None, refused: str | None = None,
         world: int = WORLD, with_baoc: bool = True) -> tuple[Any, Any, Any]:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    from support_lightning import Crash, DigitsModule, loaders
    from torch.distributed.fsdp import fully_shard

    from lightning_baoc import BAOC

    class Sharded(DigitsModule):
        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    L.seed_everything(0, verbose=False)
    model = Sharded()
    baoc = BAOC(memory_budget=0.3, warmup_steps=12, sample_every=4, reevaluate_every_n_epochs=3, report=False)
    checkpoint = ModelCheckpoint(dirpath=root / "ckpt", save_last=True, save_top_k=-1, every_n_epochs=1,
                                 save_on_train_epoch_end=True)
    callbacks = [baoc] * with_baoc + [checkpoint] + ([Crash(crash_at)] if crash_at is not None else [])
    trainer = L.Trainer(
        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1), accelerator="cpu",
        devices=world, max_epochs=EPOCHS, accumulate_grad_batches=2, gradient_clip_val=1.0, callbacks=callbacks,
        deterministic=True, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=str(root),
    )
    train, _ = loaders(n_train=320, batch_size=16)  # 10 batches of 16 per rank and epoch
    if crash_at is not None or refused is not None:
        with pytest.raises((RuntimeError, ValueError), match=refused or "simulated crash"):
            trainer.fit(model, train, ckpt_path=ckpt_path)
    else:
        trainer.fit(model, train, ckpt_path=ckpt_path)
    return model, trainer, baoc


def _same_shards(opt: Any, ref_opt: Any, model: torch.nn.Module, ref_model: torch.nn.Module) -> None:
    """This rank's compact states and weight shards equal the reference run's, to the bit."""
    mine, theirs = opt._local_state_dict(), ref_opt._local_state_dict()  # noqa: SLF001
    for name, entry in theirs["state"].items():
        for key, t in entry["tensors"].items():
            assert torch.equal(t, mine["state"][name]["tensors"][key]), (name, key)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p.to_local(), q.to_local())


def _worker(rank: int, root: str) -> None:
    import torch.distributed as dist

    base = Path(root)
    ref_model, ref_trainer, ref_baoc = _fit(base / "uninterrupted")
    ref_opt = ref_trainer.optimizers[0]
    assert [h["reason"] for h in ref_baoc.controller.history][:2] == ["warmup", "epoch"]
    assert ref_baoc.controller.history[0]["step"] == 12
    assert type(ref_model.net[0].weight).__name__ == "DTensor"
    # the budget is per rank: this rank's state is within it, and every rank holds the same formats
    assert ref_opt.state_bytes() <= ref_baoc.controller.memory_budget_bytes()
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, ref_opt.formats())
    assert everyone[0] == everyone[1] and len(set(everyone[0].values())) > 1

    _fit(base / "crashed", crash_at=CRASH_AT)
    last = base / "crashed" / "ckpt" / "last.ckpt"
    assert (last / "meta.pt").is_file()  # a distributed checkpoint: per-rank shards and metadata
    state = next(v for k, v in torch.load(last / "meta.pt", weights_only=False)["callbacks"].items()
                 if k.startswith("BAOC"))
    assert state["phase"] == "allocated"
    model, trainer, baoc = _fit(base / "crashed", ckpt_path=str(last))
    opt = trainer.optimizers[0]
    resumed = {k: v for k, v in model.losses.items() if k[0] >= CRASH_AT}
    expected = {k: v for k, v in ref_model.losses.items() if k[0] >= CRASH_AT}
    assert resumed.keys() == expected.keys() and len(resumed) == 10 * (EPOCHS - CRASH_AT)
    assert resumed == expected  # bit-equal on CPU
    assert baoc.allocation == ref_baoc.allocation
    assert [h["step"] for h in baoc.controller.history] == [h["step"] for h in ref_baoc.controller.history]
    # the re-evaluations after the resume score what the uninterrupted run scores: each rank's shadow moments came
    # back (rank zero's alone were saved: 0.009382 against 0.008015)
    assert [h["total_risk"] for h in baoc.controller.history] == [h["total_risk"] for h in ref_baoc.controller.history]
    assert opt.formats() == ref_opt.formats() and opt.state_bytes() == ref_opt.state_bytes()
    _same_shards(opt, ref_opt, model, ref_model)
    Path(root, f"rank{rank}.json").write_text(json.dumps({"formats": opt.formats(), "bytes": opt.state_bytes()}))

    # a distributed checkpoint without BAOC's state (saved without BAOC) is refused before its optimizer
    # state is read, naming the ways
    plain = base / "plain"
    if rank == 0:
        import shutil

        shutil.copytree(last, plain)
        meta = torch.load(plain / "meta.pt", weights_only=False)
        meta["callbacks"] = {k: v for k, v in meta["callbacks"].items() if not k.startswith("BAOC")}
        torch.save(meta, plain / "meta.pt")
    dist.barrier()
    _fit(base / "plain_run", ckpt_path=str(plain), refused=r"holds 0 BAOC states.*Resume it as it was saved")
    # BAOC's checkpoint resumed without BAOC: a plain AdamW refuses it at load naming BAOC and the fix (before, DCP
    # failed on the missing key 'exp_avg')
    _fit(base / "without_baoc", ckpt_path=str(last), refused=r"BlockwiseAdamW \(BAOC\).*BAOC callback",
         with_baoc=False)


def _other_world_size_worker(rank: int, root: str) -> None:
    # saved by 2 ranks, resumed by 1: refused before torch's loader, which failed inside with a CheckpointException
    last = Path(root) / "crashed" / "ckpt" / "last.ckpt"
    _fit(Path(root) / "one_rank", ckpt_path=str(last), world=1,
         refused=r"saved by 2 shards, and this run shards them 1 ways .*optimizer.to_adamw_state_dict\(\)")


@pytest.mark.slow  # two ranks; Fabric's FSDP2 resume runs by default
def test_baoc_under_model_parallel_strategy_resumes_from_a_distributed_checkpoint_to_the_bit(tmp_path: Path) -> None:
    on_lightning_ranks(_worker, WORLD, str(tmp_path))
    on_lightning_ranks(_other_world_size_worker, 1, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert ranks[0]["formats"] == ranks[1]["formats"]


# ---------------------------------------------------------------------------- Fabric

FABRIC_STEPS = 30
SAVE_AT = 18  # after the allocation (step 12)


def _fabric_run(rank: int, ckpt: Path, resume: bool) -> tuple[list[float], Any, Any]:
    """A Fabric loop under BAOCStrategy(base="model_parallel"): saves at SAVE_AT, or resumes from there."""
    import lightning as L
    from support import digits_tensors, mlp
    from torch.distributed.fsdp import fully_shard

    from lightning_baoc import BAOCStrategy

    def parallelize(module: torch.nn.Module, mesh: Any) -> torch.nn.Module:
        for layer in module:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh["data_parallel"])
        return fully_shard(module, mesh=mesh["data_parallel"])

    strategy = BAOCStrategy(memory_budget=0.3, warmup_steps=12, sample_every=4, report=False, base="model_parallel",
                            strategy_kwargs={"parallelize_fn": parallelize, "data_parallel_size": WORLD,
                                             "tensor_parallel_size": 1})
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()  # the processes exist already (a launcher started them): this joins them
    fabric.seed_everything(0, verbose=False)
    model = fabric.setup_module(mlp((64, 128, 128, 10), seed=0))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    xtr, ytr, _, _ = digits_tensors()
    start, losses = 0, []
    if resume:
        state = {"model": model, "optimizer": optimizer, "baoc": strategy.controller, "step": 0}
        fabric.load(ckpt, state)
        assert state["baoc"] is strategy.controller and strategy.controller.phase == "allocated"
        start = state["step"]
    for step in range(start, FABRIC_STEPS):
        rows = slice(32 * step % 640 + 16 * rank, 32 * step % 640 + 16 * (rank + 1))  # each rank its half
        loss = torch.nn.functional.cross_entropy(model(xtr[rows]), ytr[rows])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step + 1 == SAVE_AT and not resume:
            fabric.save(ckpt, {"model": model, "optimizer": optimizer, "baoc": strategy.controller, "step": step + 1})
    return losses, model, strategy


def _fabric_worker(rank: int, root: str) -> None:
    ckpt = Path(root) / "fabric_ckpt"
    ref_losses, ref_model, ref_strategy = _fabric_run(rank, ckpt, resume=False)
    assert ref_strategy.controller.history[0]["step"] == 12
    losses, model, strategy = _fabric_run(rank, ckpt, resume=True)
    assert losses == ref_losses[SAVE_AT:]  # bit-equal on CPU
    opt, ref_opt = strategy.controller.optimizer, ref_strategy.controller.optimizer
    assert opt.formats() == ref_opt.formats() and len(set(opt.formats().values())) > 1
    assert opt.state_bytes() <= strategy.controller.memory_budget_bytes()
    _same_shards(opt, ref_opt, model, ref_model)


@pytest.mark.slow  # two ranks; FSDP2 is held by default by tests/optim/test_routes_sharded.py
def test_baoc_strategy_under_fabric_fsdp2_resumes_from_a_distributed_checkpoint_to_the_bit(tmp_path: Path) -> None:
    on_lightning_ranks(_fabric_worker, WORLD, str(tmp_path))
