"""The route matrix (``tests/optim/test_routes.py``) over sharded parameters: FSDP2's ``DTensor`` shards and
DeepSpeed's ZeRO fragments, on two gloo ranks of the CPU.

Each rank trains the same model through each route (the eager step, the compiled CPU kernels, the device's
route through Triton's interpreter, and that route with graphs on) under FSDP2 (``fully_shard`` per layer:
uneven shards, a rank with no rows of the last layer) and under DeepSpeed ZeRO-2 (``zero_client``: a partition
edge inside a row and an 8-bit group); every route's whole weights agree with the eager route's (the same bits
where every format's arithmetic is the eager step's, within ``SUMS_BOUND`` of the movement where fp32's and the
factored formats' sums are ordered otherwise), and each rank holds the same formats.
"""

from __future__ import annotations

import os

import pytest
import torch
from support_distributed import needs_gloo, on_gloo_ranks
from support_routes import POLICY, ROUTES, on_route, route_unavailable, set_graphs
from torch import nn


pytestmark = needs_gloo
WORLD = 2
STEPS = 4
#: Two allocations. In a model the routes' differences in one parameter move every other's gradients, so a
#: format's own bound holds only where every format's arithmetic is the eager step's: ``EXACT`` (8-bit, 16-bit,
#: no momentum; a 1-D 8-bit bias) must be the same bits on every route; ``SUMS`` adds the formats whose routes
#: order fp32 sums otherwise (fp32's compiled loop, the factored sums) and is held to the movement within
#: ``SUMS_BOUND``.
EXACT = {"0.weight": "int8", "0.bias": "nomomentum", "2.weight": "bf16", "2.bias": "bf16_momentum",
         "4.weight": "nomomentum_int8", "4.bias": "int8"}
SUMS = {"0.weight": "int8_factored", "0.bias": "fp32", "2.weight": "fp32", "2.bias": "int8", "4.weight": "factored",
        "4.bias": "bf16"}
SUMS_BOUND = 1e-5  # relative to the weights' movement (measured: a few 1e-7 after 4 steps)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 37), nn.Tanh(), nn.Linear(37, 40), nn.Tanh(), nn.Linear(40, 5))


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=gen) for _ in range(STEPS)]


def _optimizer(model: nn.Module, route: str, formats: dict[str, str]):  # type: ignore[no-untyped-def]
    from lightning_baoc import BlockwiseAdamW

    opt = BlockwiseAdamW(model.named_parameters(), lr=1e-2, weight_decay=0.1, min_8bit_numel=0, kernels=POLICY[route])
    opt.set_formats(formats)
    return opt


def _fsdp2(route: str, formats: dict[str, str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    model = _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with on_route(route):
        opt = _optimizer(model, route, formats)
        set_graphs(opt, route)
        for x in _batches():
            opt.zero_grad(set_to_none=False)
            model(x).square().mean().backward()
            opt.step()
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return full, opt.formats()


def _zero2(rank: int, route: str, formats: dict[str, str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(WORLD))
    import deepspeed

    from lightning_baoc.optim.deepspeed import zero_client

    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2},
              "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9}
    model = _model()
    with on_route(route):
        client = zero_client(_optimizer(model, route, formats))
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config, dist_init_required=False)
        client.bind()
        set_graphs(client.inner, route)
        for x in _batches():
            engine.backward(engine(x).square().mean())
            engine.step()
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}, client.formats()


def _worker(rank: int, routes: list[str]) -> None:
    start = {n: p.detach().clone() for n, p in _model().named_parameters()}
    for name, train in (("fsdp2", _fsdp2), ("zero2", lambda route, formats: _zero2(rank, route, formats))):
        for formats in (EXACT, SUMS):
            eager, held = train("eager", formats)
            assert held == formats, (name, held)
            for route in routes:
                got, got_formats = train(route, formats)
                assert got_formats == formats, (name, route, got_formats)
                for key, tensor in got.items():
                    where = f"{name}: {key} ({formats[key]}) on the {route} route"
                    if formats is EXACT:
                        assert torch.equal(tensor, eager[key]), (where, (tensor - eager[key]).abs().max().item())
                        continue
                    moved = (eager[key] - start[key]).double().norm()
                    error = float((tensor - eager[key]).double().norm() / moved)
                    assert error <= SUMS_BOUND, (where, error)


@pytest.mark.slow
def test_every_route_agrees_over_fsdp2_shards_and_zero_fragments() -> None:
    pytest.importorskip("deepspeed")
    routes = [route for route in ROUTES[1:] if route_unavailable(route) is None]
    on_gloo_ranks(_worker, WORLD, routes)


def test_the_device_route_agrees_over_fsdp2_shards_and_zero_fragments() -> None:
    """The default run's case: the device route (the one a GPU takes) against the eager step."""
    pytest.importorskip("deepspeed")
    why = route_unavailable("device")
    if why is not None:
        pytest.skip(why)
    on_gloo_ranks(_worker, WORLD, ["device"])
