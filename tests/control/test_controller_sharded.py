"""The framework-free BAOC lifecycle over an FSDP2-sharded model (2 gloo ranks on the CPU).

Every rank runs the controller on its shards; rank zero decides and broadcasts. Checked: the warm-up
ends in an allocation and a re-evaluation follows; every rank holds the same formats; each rank's
state is within the budget, which is per rank (a share of the fp32 state of a tensor's largest shard,
so it holds on every rank); the factored formats are offered (their column statistics are summed
over the shards); the rank with the smaller shards holds no more than the other.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from support_distributed import needs_gloo, on_gloo_ranks
from torch import nn

from lightning_baoc import BlockwiseAdamW
from lightning_baoc.control.controller import BAOCController

pytestmark = needs_gloo
WORLD = 2


def _broadcast(obj):  # type: ignore[no-untyped-def]
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _worker(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 255), nn.Tanh(), nn.Linear(255, 255), nn.Tanh(), nn.Linear(255, 10))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ctl = BAOCController(memory_budget=0.3, warmup_steps=12, sample_every=2, reevaluate_every_n_epochs=1,
                         hysteresis=0.0, calibration="prior")
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    assert isinstance(opt, BlockwiseAdamW)
    zero = rank == 0
    for step in range(30):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(2 * 16, 64, generator=gen)[rank * 16 : (rank + 1) * 16]
        ctl.before_step(step, _broadcast, zero)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), x[:, :10].argmax(1)).backward()
        ctl.observe(step)
        opt.step()
        ctl.maybe_allocate(step + 1, _broadcast, zero)
        if step + 1 == 20:
            ctl.epoch_end(0)  # an epoch ends: a re-evaluation is due
    assert [h["reason"] for h in ctl.history][:2] == ["warmup", "epoch"] and ctl.phase == "allocated"
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, (opt.formats(), opt.state_bytes(), ctl.memory_budget_bytes()))
    assert everyone[0][0] == everyone[1][0]  # the same allocation on every rank
    assert not {"factored", "int8_factored"} & set(ctl.tables.withheld)  # offered under sharding too
    largest = sum(-(-p.shape[0] // WORLD) * math.prod(p.shape[1:]) for p in model.parameters())
    assert ctl.memory_budget_bytes() == int(0.3 * 8 * largest)  # per rank: a share of the largest shards' fp32 state
    for formats, held, budget in everyone:
        assert held <= budget, (held, budget)
    assert everyone[1][1] <= everyone[0][1]  # the second rank's shards are the smaller (255 rows)
    assert opt.state_bytes() < 8 * sum(p.to_local().numel() for p in model.parameters())
    ctl.close()  # the sampler's worker thread


def test_baoc_controller_allocates_the_same_formats_on_every_rank_within_a_per_rank_budget() -> None:
    on_gloo_ranks(_worker, WORLD)


def _run(rank: int | None, world: int) -> tuple[BAOCController, BlockwiseAdamW]:
    """The controller over the same model and batches: one process (``rank`` None) or a rank of ``world``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 255), nn.Tanh(), nn.Linear(255, 255), nn.Tanh(), nn.Linear(255, 10))
    if rank is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    # the whole model sampled (its ring keeps 32 samples of 4 bytes an element: 16 times AdamW's state), so the
    # sharded and the one-process samplers read the same elements and the scores differ by the sharding alone
    ctl = BAOCController(memory_budget=0.3, warmup_steps=12, sample_every=2, hysteresis=0.0, calibration="prior",
                         instrument_share=64.0)
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    share = 32 // (world if rank is not None else 1)
    for step in range(13):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(32, 64, generator=gen)
        if rank is not None:
            x = x[rank * share : (rank + 1) * share]
        ctl.before_step(step, _broadcast if rank is not None else None, rank in (None, 0))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), x[:, :10].argmax(1)).backward()
        ctl.observe(step)
        opt.step()
        ctl.maybe_allocate(step + 1, _broadcast if rank is not None else None, rank in (None, 0))
    return ctl, opt


def _risk_worker(rank: int, out: str) -> None:
    import json

    ctl, opt = _run(rank, WORLD)
    one, _ = _run(None, WORLD)  # the same in one process (on each rank alike)
    assert ctl.history[0]["reason"] == "warmup" and one.history[0]["reason"] == "warmup"
    if rank == 0:
        payload = {"sharded": ctl.last_event.risk, "one": one.last_event.risk,
                   "formats": [ctl.allocation, one.allocation]}
        with open(out, "w") as f:
            json.dump(payload, f)
    ctl.close()
    one.close()


@pytest.mark.slow  # two ranks; the controller on two ranks is held by default in this file
def test_the_risk_of_a_sharded_model_is_scored_over_every_rank_s_rows(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Each rank scores its rows of every parameter split by rows and the terms are summed: the risk
    table at the warm-up allocation is one process's on the same model and batches, and so is the
    allocation."""
    import json

    out = tmp_path / "risk.json"
    on_gloo_ranks(_risk_worker, WORLD, str(out))
    got = json.loads(out.read_text())
    # Measured (CPU, torch 2.13): within 0.8% of one process's risk for every format but bf16's (within 4%:
    # their stochastic rounding draws other bits); from rank zero's rows alone, as before, the factored
    # risk of the last block was 18% off and int8_factored's of the first 3.5%.
    for block, row in got["one"].items():
        for fmt, value in row.items():
            bound = 0.1 if fmt.startswith("bf16") else 0.02
            assert abs(got["sharded"][block][fmt] - value) <= bound * value + 1e-12, (block, fmt)
    assert got["formats"][0] == got["formats"][1]  # the same allocation as one process
