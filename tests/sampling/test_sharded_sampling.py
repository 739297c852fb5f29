"""Gradient sampling over FSDP2-sharded parameters (``lightning_baoc/sampling/gather.py``).

Two gloo ranks on the CPU hold the rows of each layer's gradient (33 and 64 output rows: uneven
shards; the last layer has one row, so one rank holds none of it) and one layer left whole on every
rank. Each rank gathers the sampled elements and rows of its own rows, one all-reduce per sample
assembles them, and every statistic equals the single-process sampler's over the same gradients
(element subsampling and row striding both on), on every rank; under HSDP (2 replicas x 2 shards)
too, each replica summing over its own shard group. Pieces of parameters as DeepSpeed's ZeRO 1 and 2
cut them (``sharding.Piece``: a parameter whole on one rank and absent from the other, one cut inside a
row) give the single-process statistics too.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from support_distributed import needs_gloo, on_gloo_ranks
from torch import nn

from lightning_baoc import GradientSampler

pytestmark = needs_gloo
WORLD = 2
SAMPLES = 7

def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 33), nn.Tanh(), nn.Linear(33, 64), nn.Tanh(), nn.Linear(64, 1), nn.Linear(1, 5))


def _gradients(step: int, model: nn.Module) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    scale = 1.0 + 0.1 * step  # a drifting mean and a changing scale: the statistics move
    return [(torch.randn(p.shape, generator=gen) + 0.3) * scale for p in model.parameters()]


def _statistics(model: nn.Module, sharded: bool, max_rows: int = 8) -> dict:
    from torch.distributed.tensor import distribute_tensor

    blocks = {"first": ["0.weight", "0.bias"], "middle": ["2.weight", "2.bias"], "last": ["4.weight", "4.bias"],
              "whole": ["5.weight", "5.bias"]}
    with GradientSampler(model, blocks, sample_every=1, max_elements=300, max_rows=max_rows, capacity=8) as sampler:
        for step in range(SAMPLES):
            for p, g in zip(model.parameters(), _gradients(step, model)):
                p.grad = distribute_tensor(g, p.device_mesh, p.placements) if sharded and hasattr(p, "device_mesh") else g
            sampler.sample(step)
        sampler.flush()
        return sampler.statistics()


def _check_equal(stats: dict, reference: dict) -> None:
    """Every statistic of ``reference`` in ``stats`` (NaN where it is NaN), to float summation order."""
    for block, ref in reference.items():
        for key, value in ref.items():
            got = stats[block][key]
            if isinstance(value, float) and math.isnan(value):
                assert math.isnan(got), (block, key)
            else:
                assert got == pytest.approx(value, rel=1e-6, abs=1e-9), (block, key, got, value)


def _worker(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    reference = _statistics(_model(), sharded=False)
    model = _model()
    mesh = init_device_mesh("cpu", (WORLD,))
    for i in (0, 2, 4):  # layer 5 stays whole on every rank
        fully_shard(model[i], mesh=mesh)
    assert model[4].weight.to_local().shape[0] == (1 if rank == 0 else 0)
    stats = _statistics(model, sharded=True)
    assert set(stats) == set(reference)
    _check_equal(stats, reference)
    assert reference["first"]["samples"] == SAMPLES and reference["first"]["elements"] == 300
    everyone = [None] * WORLD  # the same numbers on every rank, to the bit (NaN as None)
    dist.all_gather_object(everyone, {b: {k: None if v != v else v for k, v in s.items()} for b, s in stats.items()})
    assert everyone[0] == everyone[1]


@pytest.mark.slow  # two ranks; sampling over ranks is held by default by tests/control/test_controller_sharded.py
def test_sharded_statistics_equal_the_unsharded_ones() -> None:
    on_gloo_ranks(_worker, WORLD)


def _hsdp_worker(rank: int) -> None:
    """HSDP: 2 replicas x 2 shards; every replica assembles its own sample over its shard group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    reference = _statistics(_model(), sharded=False)
    model = _model()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh)
    stats = _statistics(model, sharded=True)
    for block, ref in reference.items():
        for key, value in ref.items():
            got = stats[block][key]
            assert (math.isnan(got) and math.isnan(value)) or got == pytest.approx(value, rel=1e-6, abs=1e-9), (block, key)


@pytest.mark.slow  # 4 processes on the 2 cores of CI: about 12 s (the 2-rank FSDP2 case runs by default)
def test_hsdp_statistics_equal_the_unsharded_ones() -> None:
    on_gloo_ranks(_hsdp_worker, 4)


CUT = 1700  # rank 0 holds the model's flattened parameters [0, CUT), rank 1 the rest: inside a row of 2.weight


def _pieces(model: nn.Module, rank: int) -> nn.Module:
    """``model`` with each parameter replaced by this rank's piece of it, as DeepSpeed's ZeRO 1 and 2 cut the
    flattened parameters (a plain tensor of any run of the whole's elements, or none; ``sharding.Piece``)."""
    from lightning_baoc.optim.sharding import Piece

    start = 0
    for name, p in list(model.named_parameters()):
        numel, cols = p.numel(), math.prod(p.shape[1:])
        bounds = [min(max(c - start, 0), numel) for c in (0, CUT, 3868)]
        lo, hi = bounds[rank], bounds[rank + 1]
        split = 0 < CUT - start < numel
        rows_whole = p.dim() >= 2 and not (split and (CUT - start) % cols)
        view = p.detach().reshape(-1)[lo:hi].clone()
        view = nn.Parameter(view.view(-1, *p.shape[1:]) if rows_whole else view)
        decided = tuple(p.shape) if rows_whole or not split else (numel,)
        view.baoc_piece = Piece(tuple(p.shape), decided, lo, dist.group.WORLD, None)
        module = model.get_submodule(name.rpartition(".")[0])
        module._parameters[name.rpartition(".")[2]] = view
        start += numel
    assert start == 3868
    return model


def _piece_statistics(model: nn.Module, max_rows: int) -> dict:
    blocks = {"first": ["0.weight", "0.bias"], "middle": ["2.weight", "2.bias"], "last": ["4.weight", "4.bias"],
              "whole": ["5.weight", "5.bias"]}
    whole = _model()
    with GradientSampler(model, blocks, sample_every=1, max_elements=300, max_rows=max_rows, capacity=8) as sampler:
        for step in range(SAMPLES):
            for (name, p), g in zip(model.named_parameters(), _gradients(step, whole)):
                offset = p.baoc_piece.offset
                p.grad = g.reshape(-1)[offset : offset + p.numel()].view(p.shape)
            sampler.sample(step)
        sampler.flush()
        return sampler.statistics()


def _piece_worker(rank: int, max_rows: int) -> None:
    reference = _statistics(_model(), sharded=False, max_rows=max_rows)
    model = _pieces(_model(), rank)
    held = {n: p.numel() for n, p in model.named_parameters()}
    assert (held["0.weight"] == 0) == (rank == 1) and (held["5.bias"] == 0) == (rank == 0)
    assert model.get_parameter("2.weight").baoc_piece.cuts_rows
    stats = _piece_statistics(model, max_rows)
    _check_equal(stats, reference)


@pytest.mark.slow  # two ranks; sampling over ranks is held by default by tests/control/test_controller_sharded.py
@pytest.mark.parametrize("max_rows", [64, 8])  # every row (the cut one among them), and every 8th
def test_pieces_of_cut_parameters_sample_what_one_process_samples(max_rows: int) -> None:
    """A parameter held whole by one rank and by none on the other, or cut inside a row (its rows' parts'
    squares summed over the ranks): every statistic is the one-process sampler's."""
    on_gloo_ranks(_piece_worker, WORLD, max_rows)
