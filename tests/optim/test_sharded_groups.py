"""8-bit states of shards that start inside a quantization group (``lightning_baoc/formats/frames.py``).

FSDP2 splits a parameter by rows; where a row is not a multiple of 32 elements, a shard starts inside a
32-element group of the whole parameter (and inside a 1024-element super-block). The shard's states
are laid out in the whole parameter's groups, and a group split between shards takes one scale, from
the maxima of every part (an exchange at each write). So one process and any sharding, given the same
gradients, hold the same codes, scales and exponents, and end with the same weights, to the bit:

- int8, nomomentum_int8 and int8_factored (AdamW) and SGD's int8 momentum, stepped; converted between
  formats mid-run (a conversion writes the states too);
- shapes: a group and a super-block split (33 x 50 on 2 ranks: rank 1 starts at element 850), a
  parameter whose shards all lie in one group (3 x 5), a bias (33 elements), a 40 x 70 weight, and a
  4 x 5 one (on 3 ranks: shards of 2, 2 and no rows; the empty shard takes part in the exchanges);
- gradients spanning 9 orders of magnitude between rows (the super-blocks' exponents matter);
- each rank's state bytes are its storage (a shard holds every group it touches: one more at most);
- the distributed state dict (each rank's row) loads into a fresh sharded run, which continues to
  the bit, and the whole fp32 state gathered by ``to_adamw_state_dict`` equals one process's;
- three ranks (every boundary elsewhere, a group split three ways) agree too (slow).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support_distributed import needs_gloo, on_gloo_ranks
from torch import nn

from lightning_baoc import BlockwiseAdamW, BlockwiseSGD
from lightning_baoc.formats import format_state_bytes, resolve_format
from lightning_baoc.optim.sharding import flat_shards, shard_shape

pytestmark = needs_gloo

SHAPES = {"w": (33, 50), "tiny": (3, 5), "b": (33,), "v": (40, 70), "four": (4, 5)}
PLAN = [  # (formats asked before the steps, steps)
    ({}, 6),
    ({"w": "nomomentum_int8", "v": "int8_factored"}, 4),
    ({"w": "int8", "tiny": "nomomentum_int8", "v": "int8"}, 4),
]


def _params(mesh=None) -> dict[str, nn.Parameter]:  # type: ignore[no-untyped-def]
    from torch.distributed.tensor import Shard, distribute_tensor

    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, shape in SHAPES.items():
        t = torch.randn(shape, generator=gen)
        out[name] = nn.Parameter(t if mesh is None else distribute_tensor(t, mesh, [Shard(0)]))
    return out


def _grads(step: int, single: dict[str, nn.Parameter], sharded: dict[str, nn.Parameter]) -> None:
    """The same gradients, whole and sharded: rows scaled by 1e-7 ... 1e2."""
    from torch.distributed.tensor import distribute_tensor

    gen = torch.Generator().manual_seed(100 + step)
    for name, p in single.items():
        scale = 10.0 ** torch.randint(-7, 3, p.shape[:1], generator=gen).float()
        g = torch.randn(p.shape, generator=gen) * scale.view(-1, *([1] * (p.dim() - 1)))
        q = sharded[name]
        p.grad, q.grad = g, distribute_tensor(g, q.device_mesh, q.placements)


def _full(params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach() for n, p in params.items()}


def _same(one: dict[str, torch.Tensor], two: dict[str, torch.Tensor], what: object, summed: set[str] = frozenset()) -> None:
    """Equal to the bit, but the parameters in ``summed``: a factored second moment's sums over the
    shards add in another order (measured: 1 ulp of the weights), so those agree within 1e-6."""
    for name in one:
        diff = (one[name] - two[name]).abs().max().item()
        assert diff <= 1e-6 if name in summed else torch.equal(one[name], two[name]), (what, name, diff)


def _moments(one, opt, summed: set[str]) -> None:  # type: ignore[no-untyped-def]
    """The whole fp32 moments, gathered from every rank, are one process's: the momentum to the bit
    (it does not depend on the second moment), the second moment too but where it was factored."""
    whole, mine = one.to_adamw_state_dict(), opt.to_adamw_state_dict()
    for index, entry in whole["state"].items():
        name = list(SHAPES)[index]
        assert torch.equal(entry["exp_avg"], mine["state"][index]["exp_avg"]), (name, "exp_avg")
        v, w = entry["exp_avg_sq"], mine["state"][index]["exp_avg_sq"]
        assert torch.allclose(v, w, rtol=1e-5, atol=0) if name in summed else torch.equal(v, w), (name, "exp_avg_sq")


def _run(mesh, make, first: str) -> None:  # type: ignore[no-untyped-def]
    """One process and the mesh's ranks through :data:`PLAN` in ``first`` (then the plan's formats)."""
    single, sharded = _params(), _params(mesh)
    assert flat_shards(sharded["w"]) is not None and flat_shards(sharded["tiny"]) is not None
    one, opt = make(single, first), make(sharded, first)
    step, summed = 0, set()
    for formats, steps in PLAN:
        formats = {n: f for n, f in formats.items() if f in one.format_registry}
        one.set_formats(formats)
        opt.set_formats(formats)
        for _ in range(steps):
            _grads(step, single, sharded)
            one.step()
            opt.step()
            step += 1
        assert opt.formats() == one.formats()
        summed |= {n for n, f in one.formats().items() if "factored" in f}
        _same(_full(single), _full(sharded), (first, formats), summed)
        if one.rule == "adamw":
            _moments(one, opt, summed)
        # each rank's state bytes are the storage it holds
        assert opt.state_bytes() == sum(opt.pool_bytes().values())
    # the distributed state dict (this rank's rows) resumes a fresh sharded run, to the bit
    saved = opt.state_dict()
    again_params = _params(mesh)
    with torch.no_grad():
        for name, p in again_params.items():
            p.to_local().copy_(sharded[name].to_local())
    again = make(again_params, "fp32")
    again.load_state_dict(saved)
    assert again.formats() == opt.formats()
    for _ in range(3):
        _grads(step, single, sharded)
        for name, p in again_params.items():
            p.grad = sharded[name].grad
        opt.step()
        again.step()
        one.step()
        step += 1
    _same(_full(sharded), _full(again_params), (first, "resumed"))
    _same(_full(single), _full(sharded), (first, "after the resume"), summed)


def _adamw(params: dict[str, nn.Parameter], fmt: str) -> BlockwiseAdamW:
    return BlockwiseAdamW(list(params.items()), lr=1e-2, weight_decay=0.01, state_format=fmt, min_8bit_numel=0)


def _sgd(params: dict[str, nn.Parameter], fmt: str) -> BlockwiseSGD:
    return BlockwiseSGD(list(params.items()), lr=1e-2, momentum=0.9, state_format=fmt, min_8bit_numel=0)


def _counted_as_held(mesh, world: int) -> None:  # type: ignore[no-untyped-def]
    """What an allocation counts for a sharded parameter (``shard_shape``) is what the optimizer holds:
    the format decided on the whole parameter (a 60 x 100 weight takes int8 under min_8bit_numel=4096
    though each shard holds 3,000 elements), the bytes the most any rank allocates (a shard holding
    one group more than its size included)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    gen = torch.Generator().manual_seed(1)
    params = {n: nn.Parameter(distribute_tensor(torch.randn(s, generator=gen), mesh, [Shard(0)]))
              for n, s in {"mid": (60, 100), "w": (33, 50), "b": (33,)}.items()}
    opt = BlockwiseAdamW(list(params.items()), lr=1e-2, min_8bit_numel=4096)
    for p in params.values():
        p.grad = torch.zeros_like(p)
    for fmt in ("int8", "nomomentum_int8", "int8_factored", "bf16", "fp32"):
        opt.set_formats({n: fmt for n in params})
        opt.step()
        for name, p in params.items():
            held = sum(t.nbytes for t in opt._records[p].views.values())  # noqa: SLF001
            most = [None] * world
            dist.all_gather_object(most, held)
            counted = format_state_bytes(fmt, shard_shape(p), min_8bit_numel=4096)
            assert counted == max(most), (fmt, name, counted, most)
            assert resolve_format(fmt, shard_shape(p), 4096) == opt.formats()[name], (fmt, name)
    assert opt.formats()["mid"] == "fp32" and resolve_format("int8", shard_shape(params["mid"]), 4096) == "int8"


def _worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    w = _params(mesh)["w"]
    offsets = [None] * world
    dist.all_gather_object(offsets, flat_shards(w).offset)
    assert any(o % 32 for o in offsets), offsets  # a shard starts inside a group
    _run(mesh, _adamw, "int8")
    _run(mesh, _adamw, "nomomentum_int8")
    _run(mesh, _sgd, "int8")
    _counted_as_held(mesh, world)
    # a shard holds the scales of every group it touches: rank 1 of 33 x 50 starts 18 elements into
    # group 26 and holds 800 elements: 26 groups (25 + 1) where its own count would say 25
    single, sharded = _params(), _params(mesh)
    opt = _adamw(sharded, "int8")
    _grads(0, single, sharded)
    opt.step()
    views = opt._records[opt._names["w"]].views  # noqa: SLF001
    if world == 2:
        expected = (-(-850 // 32), -(-850 // 1024)) if rank == 0 else (26, 2)
        assert (views["exp_avg_scale"].numel(), views["exp_avg_exp"].numel()) == expected


@pytest.mark.slow  # two ranks; shards through every route are held by default by tests/optim/test_routes_sharded.py
def test_shards_starting_inside_a_group_quantize_as_one_process_does() -> None:
    on_gloo_ranks(_worker, 2, 2)


@pytest.mark.slow  # 3 processes on the 2 cores of CI: about 20 s
def test_three_shards_starting_inside_groups_quantize_as_one_process_does() -> None:
    on_gloo_ranks(_worker, 3, 3)
