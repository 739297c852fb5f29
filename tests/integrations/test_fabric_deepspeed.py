"""BAOCStrategy(base="deepspeed") under Fabric on the CPU: ZeRO 2 and 3, gloo, 2 ranks.

Fabric's ``DeepSpeedStrategy`` refuses the CPU ("only supported on CUDA GPUs"); :class:`CPUDeepSpeed`, a
test-only subclass of the BAOC strategy, skips the CUDA and device-index checks and hands DeepSpeed the
local rank as its device rank. Every rank trains the same batches (a Fabric loop, its own steps), saves
with ``fabric.save`` halfway and a second run resumes there with ``fabric.load``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("deepspeed")

from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.strategies import DDPStrategy  # noqa: E402
from lightning.fabric.utilities.seed import reset_seed  # noqa: E402
from support import digits_tensors, mlp  # noqa: E402
from support_distributed import needs_gloo, on_lightning_ranks  # noqa: E402

from lightning_baoc import BAOCStrategy  # noqa: E402
from lightning_baoc.integrations.fabric import _BAOCDeepSpeedStrategy  # noqa: E402

os.environ.setdefault("DS_ACCELERATOR", "cpu")
STEPS, SAVE_AT = 12, 6


class CPUDeepSpeed(_BAOCDeepSpeedStrategy):
    """BAOCStrategy(base="deepspeed") on CPU ranks (tests only)."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # not DeepSpeedStrategy's: it refuses every accelerator but CUDA

    def _setup_distributed(self) -> None:
        reset_seed()
        self._set_world_ranks()
        self._init_deepspeed_distributed()
        if not self._config_initialized:
            self._format_config()
            self._config_initialized = True

    def _get_process_group_backend(self) -> str:
        return "gloo"

    def _initialize_engine(self, model: Any, optimizer: Any = None, scheduler: Any = None) -> Any:
        import deepspeed

        engine, optimizer, _, scheduler = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank), config=self.config, model=model,
            model_parameters=filter(lambda p: p.requires_grad, model.parameters()), optimizer=optimizer,
            lr_scheduler=scheduler, dist_init_required=False)
        return engine, optimizer, scheduler


def _run(rank: int, root: Path, stage: int, resume: bool) -> dict[str, Any]:
    strategy = CPUDeepSpeed(memory_budget=0.4, warmup_steps=4, sample_every=1, calibration="prior", report=False,
                            min_8bit_numel=0, strategy_kwargs={"stage": stage})
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="32-true")
    fabric.launch()  # the processes exist already (a launcher started them): this joins them
    fabric.seed_everything(0, verbose=False)
    model = mlp((64, 48, 10), seed=0)
    torch_opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch_opt, lambda s: 1.0 - s / (2 * STEPS))  # left on the user's
    model, optimizer = fabric.setup(model, torch_opt)
    xtr, ytr, _, _ = digits_tensors()
    ckpt = root / "ckpt"
    start, losses = 0, []
    state = {"model": model, "optimizer": optimizer, "baoc": strategy.controller, "step": 0}
    if resume:
        fabric.load(ckpt, state)
        start = state["step"]
        for _ in range(start):
            scheduler.step()
    for step in range(start, STEPS):
        rows = slice(16 * step, 16 * (step + 1))  # every rank the same batch
        loss = torch.nn.functional.cross_entropy(model(xtr[rows]), ytr[rows])
        fabric.backward(loss)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if step + 1 == SAVE_AT and not resume:
            state["step"] = step + 1
            fabric.save(ckpt, state)
    client = strategy.controller.optimizer
    storage = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in client.state_tensors()}
    out = {"losses": losses, "formats": client.formats(), "phase": strategy.controller.phase,
           "bytes": client.state_bytes(), "storage": sum(storage.values()),
           "budget": strategy.controller.memory_budget_bytes(), "fp32": strategy.controller.fp32_state_bytes(),
           "lr": [g["lr"] for g in client.param_groups], "steps": strategy.controller.steps}
    strategy.teardown()
    return out


def _worker(rank: int, root: str, stage: int) -> None:
    straight = _run(rank, Path(root) / "a", stage, resume=False)
    _run(rank, Path(root) / "b", stage, resume=False)
    resumed = _run(rank, Path(root) / "b", stage, resume=True)
    assert straight["phase"] == "allocated" and straight["steps"] == STEPS
    assert set(straight["formats"].values()) != {"fp32"}  # the budget made it convert
    assert straight["bytes"] == straight["storage"]  # this rank's bytes are its allocated storage
    assert straight["bytes"] <= straight["budget"] < straight["fp32"]  # within the per-rank budget
    # the scheduler left on the user's AdamW drives the fragments' learning rate
    assert straight["lr"] == [pytest.approx(3e-3 * (1.0 - (STEPS - 1) / (2 * STEPS)))], straight["lr"]  # the last step's
    every: list[Any] = [None, None]
    torch.distributed.all_gather_object(every, straight["formats"])
    assert every[0] == every[1]  # the same formats on every rank
    assert resumed["formats"] == straight["formats"] and resumed["bytes"] == straight["bytes"]
    assert resumed["losses"] == straight["losses"][SAVE_AT:]  # crash and resume: bit-equal


@needs_gloo
@pytest.mark.slow  # two ranks under Fabric; ZeRO on two ranks is held by default by tests/optim/test_deepspeed.py
@pytest.mark.parametrize("stage", [2, 3])
def test_baoc_strategy_under_fabric_deepspeed_two_ranks(tmp_path: Path, stage: int) -> None:
    on_lightning_ranks(_worker, 2, str(tmp_path), stage)


def test_deepspeed_base_takes_fabrics_setup_only() -> None:
    strategy = BAOCStrategy(memory_budget=0.3, base="deepspeed")
    with pytest.raises(NotImplementedError, match="jointly"):
        strategy.setup_optimizer(torch.optim.AdamW(mlp((4, 2)).parameters()))
    assert not strategy.controller.installed
